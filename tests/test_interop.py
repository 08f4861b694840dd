"""Other tools read the files directly, without trajstore."""

import subprocess
import sys

import torch

import trajstore


def make(tmp_path, steps=3):
    lengths = [[3, 1, 4], [0, 2, 2], [5, 5, 1]]
    with trajstore.Writer(tmp_path) as w:
        for s in range(steps):
            L = torch.tensor(lengths[s])
            m = torch.arange(6)[None, :] < L[:, None]
            w.append(s, {"input_ids": torch.arange(18).reshape(3, 6) * m, "attention_mask": m,
                         "rewards": torch.tensor([1.0, 2.0, 3.0]) * (s + 1), "uid": ["a", "b", None]})
    return lengths


def test_pandas_one_row_per_trajectory(tmp_path):
    import pandas as pd

    lengths = make(tmp_path)
    df = pd.read_parquet(tmp_path / "train" / "step_00000001.parquet")
    assert len(df) == 3
    assert [len(x) for x in df["input_ids"]] == lengths[1]
    assert df["step"].tolist() == [1, 1, 1]
    assert df["uid"].tolist()[:2] == ["a", "b"]


def test_polars(tmp_path):
    import polars as pl

    lengths = make(tmp_path)
    df = pl.read_parquet(str(tmp_path / "train" / "*.parquet"))
    assert df.height == 9
    assert df.sort("step")["input_ids"].list.len().to_list() == sum(lengths, [])


def test_duckdb_without_trajstore(tmp_path):
    lengths = make(tmp_path)
    code = (
        "import sys, duckdb\n"
        "assert 'trajstore' not in sys.modules\n"
        f"rows = duckdb.sql(\"SELECT step, count(*), avg(len(input_ids)), avg(rewards) FROM read_parquet('{tmp_path}/train/*.parquet') "
        "GROUP BY step ORDER BY step\").fetchall()\n"
        "print(rows)\n"
        "assert 'trajstore' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    rows = eval_free_parse(out)
    for s, (step, n, avg_len, avg_r) in enumerate(rows):
        assert (step, n) == (s, 3)
        assert abs(avg_len - sum(lengths[s]) / 3) < 1e-9
        assert abs(avg_r - 2.0 * (s + 1)) < 1e-6


def eval_free_parse(out: str):
    import ast

    return ast.literal_eval(out.strip())
