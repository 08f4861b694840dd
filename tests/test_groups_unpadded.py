"""A list batch of AReaL-style ``[g, T]`` groups stores each trajectory of a group unpadded
(docs/FORMAT.md 3.10; format version 3): the token cells of a grouped row hold each trajectory's run
only, the runs in ``__runs__attention_mask``, and the group comes back at its padded width with its
pad values, dtype and key order; a file that lies about its runs is refused."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings

import trajstore
from trajstore import ConfigError, FormatError, schema
from trajstore.format.file import validate
from trajstore.format.codec.rows import rows
from trajstore.testing import assert_batch_equal, group_lists
from _dumps import encoded as roundtrip


def group(lengths, T, seed=0, pad=0.0):
    g = torch.Generator().manual_seed(seed)
    m = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    return {"input_ids": torch.randint(1, 99, (len(lengths), T), generator=g).masked_fill(~m, 7),
            "attention_mask": m, "logprobs": torch.randn(len(lengths), T, generator=g).masked_fill(~m, pad),
            "rewards": torch.arange(len(lengths), dtype=torch.float32)}


def test_a_group_is_stored_unpadded_and_restored_exactly(int64_tokens):
    batch = [group([5, 2, 7], 7), None, group([1, 1], 4, seed=1), group([3], 3, seed=2)]  # the last: no padding
    out, doc, t = roundtrip(batch)
    assert_batch_equal(batch, out)
    assert doc["format_version"] == 3
    keys = dict(doc["batch"]["elem"]["keys"])
    assert keys["input_ids"]["runs"] == "__runs__attention_mask" and keys["input_ids"]["pad"] == 7
    assert keys["logprobs"]["pad"] == 0 and "runs" not in keys["rewards"]
    assert [len(x) if x is not None else None for x in t.column("input_ids").to_pylist()] == [14, None, 2, 3]
    assert t.column("__runs__attention_mask").to_pylist() == [[0, 0, 0, 5, 2, 7], None, [0, 0, 1, 1], None]
    assert t.column("__shape__input_ids").to_pylist()[0] == [3, 7]  # the group's width is kept
    r = rows(out, doc["batch"])
    assert [len(x["input_ids"]) for x in r if x] == [5, 2, 7, 1, 1, 3] and r[3] is None


def test_different_pad_values_are_kept():
    b = group([2, 4], 4)
    b["logprobs"][0, 2:] = torch.tensor([-0.0, float("nan")])
    out, doc, t = roundtrip([b])
    assert_batch_equal([b], out)
    node = dict(doc["batch"]["elem"]["keys"])["logprobs"]
    assert node["pad_col"] == "__pad__logprobs" and node["pad"] is None


def test_no_padding_changes_nothing():
    batch = [group([3, 3], 3), {"input_ids": torch.ones(1, 4), "attention_mask": torch.ones(1, 4)}]
    _, doc, t = roundtrip(batch)
    assert doc["format_version"] < 3 and "__runs__attention_mask" not in t.column_names


@settings(max_examples=150, deadline=None)
@given(group_lists())
def test_any_groups_round_trip_exactly(batch):
    out, doc, t = roundtrip(batch)
    assert_batch_equal(batch, out)
    if "__runs__attention_mask" in t.column_names:
        runs = t.column("__runs__attention_mask").to_pylist()
        for k, node in doc["batch"]["elem"]["keys"]:
            if "runs" not in node:
                continue
            for e, r, v in zip(batch, runs, t.column(k).to_pylist()):
                if r is not None:  # the group's tokens only (an action cell: the tokens after the first)
                    m = e["attention_mask"] if node["runs"] == "__runs__attention_mask" else e["attention_mask"][:, 1:]
                    assert len(v) == int((m != 0).sum()) * int(np.prod(e[k].shape[2:]))


def test_packed_read_of_a_list_batch_is_refused(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, [group([2, 3], 3)])
    with pytest.raises(ConfigError, match="dict batches"):
        trajstore.Reader(tmp_path).read(0, layout="packed")


def _lie(t, doc, runs=None, values=None, node=None):
    cols = dict(zip(t.column_names, t.columns))
    if runs is not None:
        cols["__runs__attention_mask"] = pa.chunked_array([pa.array(runs, type=pa.list_(pa.int64()))])
    if values is not None:
        cols["input_ids"] = pa.chunked_array([pa.array(values, type=t.schema.field("input_ids").type)])
    if node is not None:
        dict(doc["batch"]["elem"]["keys"])["input_ids"].update(node)
    t2 = pa.table(list(cols.values()), schema=t.schema.with_metadata({"trajstore": json.dumps(doc)}))
    validate.check(doc, t2.schema, t2.num_rows, "x")
    return schema.decode(t2, doc["batch"], where="x")


@pytest.mark.parametrize("lie", [dict(runs=[[0, 0, 5, 5]]), dict(runs=[[0, 3, 2, 3]]), dict(runs=[[0, 0, 2]]),
                                 dict(runs=[[-1, 0, 2, 3]]), dict(values=[[1, 2, 3]]), dict(node={"runs": "x"}),
                                 dict(node={"pad": 1 << 70}), dict(node={"kind": None})])
def test_a_lying_file_is_refused(lie):
    _, doc, t = roundtrip([group([2, 3], 4)])
    with pytest.raises(FormatError):
        _lie(t, doc, **lie)


def test_an_old_version_with_runs_is_refused(int64_tokens):
    _, doc, t = roundtrip([group([2, 3], 4)])
    doc["format_version"] = 2
    with pytest.raises(FormatError, match="version 2"):
        validate.check(doc, t.schema, t.num_rows, "x")


def test_sql_and_to_pandas_cut_each_trajectory(tmp_path):
    """Left-padded and two-sided groups, a group with holes (stored whole), a rejected element, and
    a [g, T, k] field: SQL and to_pandas give each trajectory its own tokens."""
    m_left = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    m_span = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.bool)
    m_holes = torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.bool)
    batch = []
    for s, m in enumerate((m_left, m_span, m_holes)):
        g, T = m.shape
        batch.append({"input_ids": (torch.arange(g * T).reshape(g, T) + 100 * s).masked_fill(~m, -1),
                      "attention_mask": m, "topk": torch.arange(g * T * 2, dtype=torch.float32).reshape(g, T, 2),
                      "rewards": torch.arange(g, dtype=torch.float32)})
        if s == 1:
            batch.append(None)
    with trajstore.Writer(tmp_path) as w:
        w.append(0, batch)
    r = trajstore.Reader(tmp_path)
    assert_batch_equal(batch, r.read(0))
    want = [(e["input_ids"][j][e["attention_mask"][j]].tolist(), e["topk"][j][e["attention_mask"][j]].reshape(-1).tolist())
            for e in batch if e is not None for j in range(len(e["input_ids"]))]
    got = r.duckdb().execute("SELECT input_ids, topk FROM train").fetchall()
    got = [(list(a), list(b)) for a, b in got if a is not None]
    assert [a for a, _ in got] == [a for a, _ in want]
    assert [b for b, _ in zip(got, range(5))] == [b for b, _ in zip(want, range(5))]  # the groups stored by runs
    df = r.to_pandas(0)
    assert [x.tolist() for x in df["input_ids"] if isinstance(x, np.ndarray)] == [a for a, _ in want]
    runs = pq.read_table(next(tmp_path.rglob("*.parquet")), columns=["__runs__attention_mask"]).column(0).to_pylist()
    assert runs == [[2, 1, 2, 3], [1, 3, 0, 2, 2, 4], None, None]


def _experience(n, T, with_actions=True):
    """An OpenRLHF-like element: a ``[1, T]`` group, with or without its ``[1, T-1]`` action cells."""
    e = group([n], T)
    if with_actions:
        e.update(sequences=e["input_ids"].long(), action_mask=e["attention_mask"][:, 1:],
                 action_log_probs=e["logprobs"][:, 1:])
    return e


def test_a_cell_some_groups_lack_is_stored_by_runs(tmp_path):
    """A token cell present in only some of the grouped rows (an element without the action fields) is
    stored by the runs of the rows that hold it, like the rows that all hold it; so shards of which one has
    every row holding it and another not join into the logical step (they raised 'stored by runs in some
    shards and whole in others')."""
    rows = [_experience(2, 4), _experience(0, 0, with_actions=False), _experience(1, 3)]
    out, doc, _ = roundtrip(rows[1:])
    assert_batch_equal(rows[1:], out)
    keys = dict(doc["batch"]["elem"]["keys"])
    assert "runs" in keys["sequences"] and "runs" in keys["action_log_probs"], keys["sequences"]
    for r, part in ((0, rows[:1]), (1, rows[1:])):
        with trajstore.Writer(tmp_path, rank=r, world_size=2) as w:
            w.append(3, part)
    assert_batch_equal(rows, trajstore.Reader(tmp_path)[3])
