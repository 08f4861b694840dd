"""A list batch of AReaL-style groups (each element ``[g, T]``, as ``concat_padded_tensors`` makes it)
is shown, counted and compared as ``g`` trajectories each, not as one per group."""

import json

import torch

import trajstore
from trajstore.cli import run
from trajstore.inspection.describe import describe


def _group(lengths, T, seed):
    g = torch.Generator().manual_seed(seed)
    G = len(lengths)
    m = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    return {"input_ids": torch.randint(1, 99, (G, T), generator=g, dtype=torch.int32).masked_fill(~m, 0),
            "loss_mask": m.to(torch.int32), "logprobs": torch.randn(G, T, generator=g).masked_fill(~m, 0.0),
            "versions": torch.full((G, T), 3, dtype=torch.int32), "attention_mask": m,
            "rewards": torch.arange(G, dtype=torch.float32) + seed}


def test_groups_are_trajectories(tmp_path, capsys):
    lengths = [[5, 3, 7, 2], [4, 4, 1, 6]]
    with trajstore.Writer(tmp_path) as w:
        w.append(0, [_group(lengths[0], 7, 0), _group(lengths[1], 6, 1)])
    r = trajstore.Reader(tmp_path)
    df = r.to_pandas(0)
    assert len(df) == 8 and list(df["group"]) == [0] * 4 + [1] * 4
    assert [len(x) for x in df["input_ids"]] == lengths[0] + lengths[1]
    assert list(df["rewards"]) == [0, 1, 2, 3, 1, 2, 3, 4]
    d = describe(tmp_path)["splits"]["train"]
    assert d["rows"] == 8 and d["tokens"] == sum(lengths[0] + lengths[1])
    assert run(["show", str(tmp_path), "--step", "0", "--sample", "5", "--json"]) == 0
    t = json.loads(capsys.readouterr().out)
    assert t["index"] == 5 and t["reward"] == 2.0
    assert trajstore.diff(tmp_path, tmp_path).identical
    sql = r.duckdb().execute('SELECT "group", len(input_ids), rewards FROM train').fetchall()
    assert sorted(sql) == sorted((j, n, [float(i + j)]) for j in (0, 1) for i, n in enumerate(lengths[j]))


def test_single_episodes_stay_one_row_each(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, [_group([3], 5, 0), None, _group([5], 5, 1)])
    df = trajstore.Reader(tmp_path).to_pandas(0)
    assert len(df) == 3 and list(df["rejected"]) == [False, True, False] and "group" not in df
    assert describe(tmp_path)["splits"]["train"]["rows"] == 3


def test_recorder_logs_the_valid_tokens_of_a_list_batch(tmp_path, caplog):
    """The dump log line counts each element's valid tokens ([1, T] episodes and [g, T] groups)."""
    import logging

    caplog.set_level(logging.INFO, logger="trajstore.recorder")
    batch = [_group([3], 5, 0), None, _group([5, 2], 6, 1)]
    with trajstore.Recorder(trajstore.DumpReplayConfig(dump=True, path=str(tmp_path))) as rec:
        rec.batch(0, lambda: batch)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("trajstore dump step=0 "))
    assert "tokens=10 " in line
