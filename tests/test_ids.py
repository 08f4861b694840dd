"""Trajectory ids (trajstore/format/shard/ids.py, docs/FORMAT.md 3.13): every row of a logical step is
``(step, row)`` of the batch as dumped, whatever slice, balance, layout or rank layout reads it; a row
recorded elsewhere with its id keeps it; SQL readers get the same ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trajstore
from _shards import batch_rows, cuts, select
from test_shards import FORMS
from trajstore.errors import BatchError
from trajstore.testing import assert_batch_equal, multimodal_batches, non_tensor_batches

SETTINGS = settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=30)
EVERY = st.one_of(FORMS, multimodal_batches(), non_tensor_batches())  # every batch strategy of trajstore.testing
STEP = 5


def _dump(path, batch, chunks) -> None:
    """``batch`` dumped as step STEP by ``len(chunks)`` ranks, rank r holding the rows ``chunks[r]``."""
    if len(chunks) == 1:
        with trajstore.Writer(path) as w:
            w.append(STEP, batch)
        return
    for r, rows in enumerate(chunks):
        with trajstore.Writer(path, rank=r, world_size=len(chunks)) as w:
            w.append(STEP, select(batch, rows))


@SETTINGS
@given(st.data())
def test_ids_name_the_rows_of_every_slice(tmp_path_factory, data):
    """For every batch strategy, cut by N ranks and replayed on M (contiguous or token-balanced, read
    padded or packed): each slice's rows are the logical rows its ids name, every row of the step once;
    outputs recorded with those ids read back in id order whatever the replay's layout."""
    batch = data.draw(EVERY)
    B = batch_rows(batch)
    if not B:
        return
    d = tmp_path_factory.mktemp("ids")
    chunks = cuts(data.draw, B)
    _dump(d, batch, chunks)
    whole = trajstore.Reader(d)
    assert whole.ids(STEP).tolist() == [[STEP, i] for i in range(B)]
    M = data.draw(st.sampled_from([m for m in range(1, min(B, 4) + 1) if B % m == 0]))
    balance = data.draw(st.sampled_from(["contiguous", "tokens"]))
    seen = []
    for k in range(M):
        r = trajstore.Reader(d, rank=k, world_size=M, balance=balance)
        ids = r.ids(STEP)
        as_dumped = balance == "contiguous" and M == len(chunks) > 1  # the shard rank k dumped
        n = len(chunks[k]) if as_dumped else B // M
        assert ids.dtype == np.int64 and ids.shape == (n, 2) and (ids[:, 0] == STEP).all()
        rows = ids[:, 1].tolist()
        assert_batch_equal(r[STEP], select(batch, rows))
        seen += rows
        with trajstore.Writer(d, split="outputs", rank=k, world_size=M) as w:  # per-trajectory outputs
            w.append(STEP, {"out": torch.tensor(rows, dtype=torch.float64) * 0.5}, ids=ids)
    assert sorted(seen) == list(range(B))
    out = trajstore.Reader(d, "outputs")
    assert sorted(out.ids(STEP)[:, 1].tolist()) == list(range(B))
    assert (out[STEP]["out"].numpy() == out.ids(STEP)[:, 1] * 0.5).all()  # each row kept its id


def _padded(B: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 7, (B,), generator=g)
    am = (torch.arange(6)[None] < lens[:, None]).long()
    return {"input_ids": torch.randint(0, 50, (B, 6), generator=g) * am, "attention_mask": am,
            "score": torch.rand(B, generator=g)}


def test_ids_survive_packing_and_id_order(tmp_path):
    """A token-balanced slice read packed has the ids of the padded read; outputs in id order."""
    batch = _padded(8, 0)
    _dump(tmp_path, batch, [[0, 1, 2], [3], [4, 5, 6, 7]])
    r = trajstore.Reader(tmp_path, rank=1, world_size=2, balance="tokens")
    ids = r.ids(STEP)
    packed = r.read(STEP, layout="packed")
    assert torch.equal(packed["score"], batch["score"][torch.tensor(ids[:, 1])])
    with trajstore.Writer(tmp_path, split="outputs") as w:
        w.append(STEP, {"score": packed["score"]}, ids=ids)
    o = trajstore.Reader(tmp_path, "outputs")
    o._by_id = True
    got = o.ids(STEP)
    assert (np.diff(got[:, 1]) > 0).all() and sorted(got[:, 1].tolist()) == sorted(ids[:, 1].tolist())
    assert torch.equal(o[STEP]["score"], batch["score"][torch.tensor(got[:, 1])])


def test_ids_read_by_sql(tmp_path):
    """DuckDB gives every row the id Reader.ids gives (the query of docs/FORMAT.md 3.13), for whole
    step files, shards, and a split recorded with ids."""
    duckdb = pytest.importorskip("duckdb")
    _dump(tmp_path, _padded(6, 1), [[0, 1], [], [2, 3, 4, 5]])
    with trajstore.Writer(tmp_path) as w:
        w.append(STEP + 1, _padded(3, 2))
    with trajstore.Writer(tmp_path, split="outputs") as w:
        w.append(STEP, {"x": torch.arange(2)}, ids=[[STEP, 4], [STEP, 1]])
    sql = ("SELECT step AS traj_step, row_number() OVER (PARTITION BY step ORDER BY filename, file_row_number) - 1 "
           "AS traj_row FROM read_parquet('{}/train/*.parquet', filename = true, file_row_number = true, "
           "union_by_name = true) ORDER BY filename, file_row_number")
    got = duckdb.sql(sql.format(tmp_path)).fetchall()
    r = trajstore.Reader(tmp_path)
    assert got == [tuple(i) for s in r.steps for i in r.ids(s).tolist()]
    got = duckdb.sql(f"SELECT traj_step, traj_row, x FROM '{tmp_path}/outputs/*.parquet'").fetchall()
    assert got == [(STEP, 4, 0), (STEP, 1, 1)]


def test_ids_refused_with_reasons(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        with pytest.raises(BatchError, match=r"step 1: ids of shape \[2, 3\]"):
            w.append(1, {"x": torch.zeros(2)}, ids=np.zeros((2, 3), np.int64))
        with pytest.raises(BatchError, match="field named 'traj_row'"):
            w.append(1, {"traj_row": torch.zeros(2)}, ids=[0, 1])
        with pytest.raises(BatchError, match="same .step, row. twice"):
            w.append(1, {"x": torch.zeros(2)}, ids=[3, 3])
    with pytest.raises(trajstore.errors.WriterError, match="3 ids for a batch of 2"):
        with trajstore.Writer(tmp_path, split="o", on_error="raise") as w:
            w.append(1, {"x": torch.zeros(2)}, ids=[0, 1, 2])


def test_recorder_outputs_next_to_the_inputs(tmp_path):
    """Dumping, outputs go to the dump's own split (implicit ids: the rank's rows); at replay to the dump
    ``outputs`` names, each row with the id of the row it came from; off, nowhere."""
    base, out = tmp_path / "base", tmp_path / "out"
    with trajstore.Recorder(dump=True, path=base) as rec:
        b = rec.batch(STEP, lambda: _padded(4, 3))
        rec.record(STEP, {"loss": b["score"] * 2}, split="outputs", meta={"loss": 0.5})
    assert trajstore.Reader(base, "outputs").ids(STEP).tolist() == [[STEP, i] for i in range(4)]
    assert trajstore.Reader(base, "outputs").meta(STEP) == {"loss": 0.5}
    with pytest.raises(trajstore.ConfigError, match="DumpReplayConfig.outputs"):
        trajstore.Recorder(replay=True, path=base).record(STEP, {"x": torch.zeros(4)}, split="outputs")
    with pytest.raises(trajstore.ConfigError, match="is the replayed dump"):
        trajstore.Recorder(replay=True, path=base, outputs=str(base)).record(STEP, {"x": torch.zeros(4)},
                                                                             split="outputs")
    with pytest.raises(trajstore.ConfigError, match="known at replay"):
        trajstore.Recorder(dump=True, path=tmp_path / "other").ids(STEP)
    with trajstore.Recorder(replay=True, path=base, outputs=str(out)) as rec:
        b = rec.batch(STEP, lambda: pytest.fail("replay samples"))
        assert rec.ids(STEP).tolist() == [[STEP, i] for i in range(4)]
        rec.record(STEP, {"loss": b["score"] * 2}, split="outputs", meta={"loss": 0.5})
    assert trajstore.Reader(out, "outputs").ids(STEP).tolist() == [[STEP, i] for i in range(4)]
    assert trajstore.diff(base, out, split="outputs").identical
    assert [e.field for e in trajstore.diff(base, out, split="outputs").entries] == ["loss", "meta.loss"]
    off = trajstore.Recorder()
    off.record(STEP, {"x": torch.zeros(1)}, split="outputs")  # off: nothing recorded, nothing raised
    assert not (tmp_path / "trajstore_dumps").exists()


def test_diff_names_the_trajectories_on_one_side_only(tmp_path):
    """Runs whose outputs of a step hold other trajectories: that step is one mismatch naming their ids,
    the other steps are compared row by row in id order."""
    a, b = tmp_path / "a", tmp_path / "b"
    with trajstore.Writer(a, split="outputs") as w:
        for s in (0, 1):
            w.append(s, {"loss": torch.arange(4, dtype=torch.float32)})
    with trajstore.Writer(b, split="outputs") as w:
        w.append(0, {"loss": torch.tensor([3.0, 1.0, 2.0, 0.0])}, ids=[3, 1, 2, 0])
        w.append(1, {"loss": torch.tensor([2.0, 0.0, 1.0])}, ids=[[1, 2], [1, 0], [1, 1]])
    rep = trajstore.diff(a, b, split="outputs")
    assert [(e.step, e.field, e.status) for e in rep.entries] == [(0, "loss", "identical"), (1, "*", "mismatch")]
    assert "1 only in a ((1, 3))" in rep.entries[1].note and not rep.ok
