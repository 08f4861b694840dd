"""SQL over a dump (DuckDB views per split) and to_pandas answer per-step questions correctly."""

import sys
import tempfile

import numpy as np
import pytest
import torch
from _dumps import write
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore import MissingDependencyError
from trajstore.inspection.traces import load_tokenizer

duckdb = pytest.importorskip("duckdb")
pd = pytest.importorskip("pandas")


def _dump(path, rewards_by_step, split="train"):
    return write(path, {s: {"input_ids": torch.arange(len(rw) * 3).reshape(len(rw), 3),
                            "attention_mask": torch.ones(len(rw), 3, dtype=torch.bool),
                            "rewards": torch.tensor(rw, dtype=torch.float64),
                            "info": {"uid": [f"{s}-{i}" for i in range(len(rw))]}}
                        for s, rw in rewards_by_step.items()}, split=split)


@settings(max_examples=15, deadline=None)
@given(st.dictionaries(st.integers(0, 40), st.lists(st.floats(-10, 10), min_size=1, max_size=5),
                       min_size=1, max_size=5))
def test_per_step_reward_means(rewards_by_step):
    with tempfile.TemporaryDirectory() as d:
        r = _dump(d, rewards_by_step)
        q = "SELECT step, avg(rewards), count(*) FROM train GROUP BY step ORDER BY step"
        got = r.duckdb().execute(q).fetchall()
    want = [(s, float(np.mean(v)), len(v)) for s, v in sorted(rewards_by_step.items())]
    assert [s for s, _, _ in got] == [s for s, _, _ in want]
    for (_, m, n), (_, wm, wn) in zip(got, want):
        assert n == wn and m == pytest.approx(wm, abs=1e-9)


def test_one_view_per_split_with_steps(tmp_path):
    _dump(tmp_path, {0: [1.0, 2.0], 5: [3.0]})
    _dump(tmp_path, {0: [10.0]}, split="val")
    con = trajstore.Reader(tmp_path).duckdb()
    assert con.execute("SELECT step, rewards FROM val").fetchall() == [(0, 10.0)]
    assert con.execute("SELECT sum(rewards) FROM train WHERE step = 5").fetchone()[0] == 3.0
    # nested fields have dotted names; per-token fields are lists
    rows = con.execute('SELECT "info.uid", input_ids FROM train ORDER BY step, "info.uid"').fetchall()
    assert rows[0] == ("0-0", [0, 1, 2]) and rows[-1] == ("5-0", [0, 1, 2])


def test_to_pandas(tmp_path):
    r = write(tmp_path, {0: [{"ids": torch.tensor([1, 2, 3]), "reward": 1.5}, None],
                         1: [{"ids": torch.tensor([4]), "reward": -1.0}]})
    df = r.to_pandas()
    assert list(df["step"]) == [0, 0, 1] and list(df["index"]) == [0, 1, 0]
    assert list(df["rejected"]) == [False, True, False]
    assert df.loc[0, "reward"] == 1.5 and np.array_equal(df.loc[2, "ids"], [4])
    one = r.to_pandas(1)
    assert len(one) == 1 and one.loc[0, "reward"] == -1.0


def test_to_pandas_bfloat16_and_packed(tmp_path):
    lp = torch.tensor([-0.5, -1.25, -2.0], dtype=torch.bfloat16)
    batch = {"logprobs": lp, "cu_seqlens": torch.tensor([0, 1, 3]), "rewards": torch.tensor([0.0, 1.0])}
    df = write(tmp_path, {0: batch}).to_pandas(0)
    assert "cu_seqlens" not in df.columns
    assert df.loc[1, "logprobs"].dtype == np.float32 and list(df.loc[1, "logprobs"]) == [-1.25, -2.0]


def test_missing_optional_packages_named(tmp_path, monkeypatch):
    r = _dump(tmp_path, {0: [1.0]})
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "duckdb", None)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(MissingDependencyError, match=r"trajstore\[cli\]"):
        r.duckdb()
    with pytest.raises(ImportError, match=r"trajstore\[cli\]"):
        load_tokenizer(tmp_path / "tokenizer.json")
