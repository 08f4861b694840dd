"""A rank replaying a contiguous slice of a step dumped by another number of ranks reads only the shards
its slice overlaps, and in a shard it cuts only the row groups holding its rows (``shard_read._cut``),
and gets exactly the slice of the logical batch that joining every shard gives."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch
from _dumps import many_row_groups
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore.read import shards as shard_read
from trajstore.format.file import parquet
from trajstore.format.shard import shards
from trajstore.store import stepfile
from trajstore.testing import assert_batch_equal


def shard_batch(rows: int, T: int, seed: int, side: str) -> dict:
    """A rank's padded shard as RL trainers dump it: one padded width for every rank, pad 0 (or none,
    in a shard whose rows are all full), ``logprobs * mask`` leaving both 0.0 and -0.0 on padding."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, T + 1, (rows,), generator=g)
    pos = torch.arange(T)[None]
    am = pos < lens[:, None] if side == "right" else pos >= T - lens[:, None]
    return {"input_ids": torch.randint(1, 1000, (rows, T), generator=g, dtype=torch.int32) * am,
            "attention_mask": am.to(torch.int64),
            "old_logprobs": torch.randn(rows, T, generator=g).to(torch.bfloat16) * am,
            "rewards": torch.randn(rows, generator=g)}


def dump(d, sizes: list[int], T: int, side: str = "right") -> None:
    n = len(sizes)
    for r, rows in enumerate(sizes):
        with trajstore.Writer(d, rank=r, world_size=n) as w:
            w.append(0, shard_batch(rows, T, r, side), meta={"lr": 1e-6, "rank": r})


def slices(d, m: int, columns=None) -> list:
    return [trajstore.Reader(d, rank=k, world_size=m).read(0, columns=columns) for k in range(m)]


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(1, 7), min_size=2, max_size=4), T=st.integers(1, 9),
       side=st.sampled_from(["right", "left"]), data=st.data())
def test_a_cut_slice_is_the_slice_of_the_joined_step(tmp_path_factory, sizes, T, side, data):
    """Every rank's slice read from the shards it overlaps (several row groups each) equals the slice cut
    from the join of every shard (the general path), for any M dividing B; the shards are cut whenever
    their specs are ``uniform`` (a left-padded shard of full rows only says "right": not uniform)."""
    B, d = sum(sizes), tmp_path_factory.mktemp("cut")
    with pytest.MonkeyPatch.context() as mp:
        many_row_groups(mp)
        dump(d, sizes, T, side)
        m = data.draw(st.sampled_from([k for k in range(2, B + 1) if B % k == 0 and k != len(sizes)] or [B]))
        cols = data.draw(st.sampled_from([None, ["input_ids"], ["rewards", "old_logprobs"]]))
        taken = []
        mp.setattr(shard_read, "_cut", lambda *a, real=shard_read._cut: taken.append(real(*a)) or taken[-1])
        got = slices(d, m, cols)
        docs = [stepfile.open_step(f, 0).doc for f in trajstore.Reader(d).files(0)]
        assert len(taken) == (m if m != len(sizes) else 0)
        assert all((t is not None) == shards.uniform(docs) for t in taken)
        mp.setattr(shards, "uniform", lambda docs: False)  # the general path: every shard joined, then cut
        want = slices(d, m, cols)
    for g, w in zip(got, want):
        assert_batch_equal(g, w)
    whole = trajstore.Reader(d)[0]
    for k, g in enumerate(got):
        for name, v in g.items():
            assert torch.equal(v, whole[name][k * B // m:(k + 1) * B // m])


def test_two_ranks_of_a_four_rank_dump_each_decode_half(tmp_path, monkeypatch):
    """Two ranks replaying a four-rank dump each decode at most 0.6 of the bytes a read of the whole step
    decodes (the Arrow tables read from its files), and a rank whose slice cuts shards reads only the row
    groups it needs."""
    monkeypatch.setattr(parquet, "ROW_GROUP_BYTES", 1024)  # shards of several row groups
    dump(tmp_path, [24] * 4, 64)
    decoded = []
    for name in ("read_row_group", "read"):
        real = getattr(pq.ParquetFile, name)
        monkeypatch.setattr(pq.ParquetFile, name, lambda self, *a, real=real, **k: _count(decoded, real(self, *a, **k)))
    real_table = pq.read_table
    monkeypatch.setattr(pq, "read_table", lambda *a, **k: _count(decoded, real_table(*a, **k)))
    trajstore.Reader(tmp_path)[0]
    total = sum(decoded)
    assert total > 0
    for m in (2, 3):
        for k in range(m):
            decoded.clear()
            part = trajstore.Reader(tmp_path, rank=k, world_size=m)[0]
            assert part["input_ids"].shape[0] == 96 // m
            assert sum(decoded) <= (0.6 if m == 2 else 0.5) * total, (m, k, sum(decoded) / total)


def _count(out: list, table):
    out.append(table.nbytes)
    return table


@pytest.mark.parametrize("m", [2, 6])
def test_a_cut_slice_decodes_a_pad_column_chunked_apart_from_its_values(tmp_path, monkeypatch, m):
    """A slice joined from shards' rows (no copy), and the whole logical step, whose recorded padded values
    (``__pad__`` column: ranks whose padding holds both 0.0 and -0.0; one rank's has none) are chunked apart
    from the field's values decode exactly: the padded values are cut where the values' chunks are (a case
    hypothesis found; the whole step's read raised before)."""
    many_row_groups(monkeypatch)
    dump(tmp_path, [2, 1, 3], 5)
    r = trajstore.Reader(tmp_path)
    whole = r[0]
    for name, v in whole.items():
        assert torch.equal(v, torch.cat([r.shard(0, k)[name] for k in range(3)])), name
    got = slices(tmp_path, m)
    monkeypatch.setattr(shards, "uniform", lambda docs: False)  # the general path: every shard joined, then cut
    for g, w in zip(got, slices(tmp_path, m)):
        assert_batch_equal(g, w)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [None, 2])
@pytest.mark.parametrize("prefetch", [0, 4])
def test_cuda_replay_of_a_pad_column_chunked_apart_equals_the_cpu_read(tmp_path, monkeypatch, m, prefetch):
    """The same joined step replayed to a GPU (its padded fields built on the device from each chunk's values and
    recorded padding values, ``device/plan.py``): the whole step and each rank's slice equal their CPU reads."""
    many_row_groups(monkeypatch)
    dump(tmp_path, [2, 1, 3], 5)
    for k in range(m or 1):
        r = trajstore.Reader(tmp_path) if m is None else trajstore.Reader(tmp_path, rank=k, world_size=m)
        cpu = r.read(0)
        (_, gpu), = list(r.iter(device="cuda", prefetch=prefetch))
        torch.cuda.synchronize()
        assert all(v.is_cuda for v in gpu.values())
        assert_batch_equal(cpu, {n: v.cpu() for n, v in gpu.items()})


def test_padding_values_are_cut_where_the_values_chunks_are():
    """The decoder's recorded padding values of a field (``__pad__`` column) chunked apart from its values are cut
    at the values' chunks, row for row; with no chunk at all (no rows) each values' chunk gets none."""
    import numpy as np
    import pyarrow as pa

    from trajstore.format.arrow import Columns
    from trajstore.format.codec import tensors

    typ = pa.large_list(pa.field("element", pa.int32(), nullable=False))
    node = {"t": "tensor", "col": "x", "pad_col": "__pad__x", "dtype": "int32", "lib": "torch", "trail": []}
    vals, pads = [[1, 2], [3], [4, 5, 6]], [[7, 8], [9, 10, 11], [12]]  # rows of 2, 1, 3 tokens padded to 4
    for pchunks in ([pads], [pads[:1], pads[1:]], [pads[:1], [], pads[1:]]):
        cols = Columns(pa.table({"x": pa.chunked_array([pa.array(vals[:2], typ), pa.array(vals[2:], typ)]),
                                 "__pad__x": pa.chunked_array([pa.array(c, typ) for c in pchunks], typ)}), "t")
        off, parts = cols.chunks("x", "int32")
        poff, got = tensors._padvals(cols, node, 3, np.array([2, 1, 3]), 4, 1, parts)
        assert poff.tolist() == [0, 2, 5, 6] and [g.tolist() for g in got] == [[7, 8, 9, 10, 11], [12]]
    cols = Columns(pa.table({"x": pa.chunked_array([pa.array([], typ)]), "__pad__x": pa.chunked_array([], typ)}), "t")
    off, parts = cols.chunks("x", "int32")
    poff, got = tensors._padvals(cols, node, 0, np.zeros(0, np.int64), 4, 1, parts)
    assert poff.tolist() == [0] and [g.tolist() for g in got] == [[]]


@pytest.mark.parametrize("m", [None, 2])
def test_the_shards_a_read_needs_are_read_at_once_on_the_readers_budget(tmp_path, monkeypatch, m):
    """The shards a whole step (or a rank's slice of several) needs are read at once on the thread pool, each
    read raising Arrow's pool to the reader's ``threads=`` (not the process default), and join to the same batch."""
    import threading

    from trajstore.base import threads

    many_row_groups(monkeypatch)
    monkeypatch.setattr(threads, "PARALLEL_BYTES", 0)
    dump(tmp_path, [4, 3, 5, 4], 6)
    want = {n: torch.cat([trajstore.Reader(tmp_path).shard(0, k)[n] for k in range(4)]) for n in ("input_ids", "rewards")}
    seen, real = [], parquet.arrow_pool

    def spy(n, exact=False):
        seen.append((n, threading.current_thread().name))
        return real(n, exact)
    monkeypatch.setattr(parquet, "arrow_pool", spy)
    r = trajstore.Reader(tmp_path, threads=3) if m is None else trajstore.Reader(tmp_path, rank=0, world_size=m, threads=3)
    got = r.read(0)
    rows = 16 if m is None else 8
    for n, v in want.items():
        assert torch.equal(got[n], v[:rows]), n
    assert len(seen) == (4 if m is None else 3) and all(n == 3 for n, _ in seen)  # rows 0-7: shards 0, 1 and 2
    assert all(name.startswith("trajstore-decode") for _, name in seen)
