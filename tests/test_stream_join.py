"""A large read to host memory joins the token columns it packs row group by row group as Arrow's
reader yields them (``format/file/joining.py`` ``StreamJoin``): the batch is bit for bit the one the
join after the read gives, the copies start before the last row group is decoded, and a column that
outgrows its first buffer, or that the stream join cannot take, still comes back exact."""

import shutil
import tempfile
import types
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import _dumps
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import trajstore
from trajstore.base import threads as _threads
from trajstore.format.file import joining, parquet
from trajstore.read import decode as read_decode
from trajstore.read import prefetch as prefetch_mod
from trajstore.testing.bits import TORCH_DTYPES, tensors
from trajstore.testing.compare import assert_batch_equal
from trajstore.testing import batches
from trajstore.testing.forms import packed_batches, padded_batches


@contextmanager
def many_row_groups():
    """``_dumps.many_row_groups`` for a block: every step of several rows in up to 16 row groups, every
    read through Arrow's scan (the path of a large step), so small hypothesis batches take that path."""
    mp = pytest.MonkeyPatch()
    _dumps.many_row_groups(mp)
    try:
        yield
    finally:
        mp.undo()


@contextmanager
def spied():
    """``joined``: the columns each read's StreamJoin handed to the decode."""
    joined: list[list[str]] = []
    real = joining.StreamJoin.parts

    def parts(self, table):
        out = real(self, table)
        joined.append(sorted(out))
        return out

    with mock.patch.object(joining.StreamJoin, "parts", parts):
        yield joined


def _read_both(batch, layout="packed", threads=None):
    """(read with the stream join, read joining after the read, the columns the stream join gave)."""
    d = Path(tempfile.mkdtemp())
    try:
        with many_row_groups():
            with trajstore.Writer(d / "r") as w:
                w.append(0, batch)
            r = trajstore.Reader(d / "r", threads=threads)
            with spied() as joined:
                got = r.read(0, layout=layout)
            with mock.patch.object(read_decode, "joined_first", lambda *a: []):
                want = r.read(0, layout=layout)
        return got, want, (joined[0] if joined else None)
    finally:
        shutil.rmtree(d)


@st.composite
def padded_with_extra(draw):
    """A padded batch with one more per-token field of any dtype (its pad left uniform)."""
    b = draw(padded_batches(max_batch=12))
    B, T = b["input_ids"].shape
    x = draw(tensors((B, T), TORCH_DTYPES))
    m = b["attention_mask"].bool()
    b["extra"] = torch.where(m, x, torch.zeros((), dtype=x.dtype)) if x.dtype != torch.bool else x & m
    return b


@settings(max_examples=60, deadline=None)
@given(padded_with_extra(), st.sampled_from([1, 2, 4]))
def test_a_padded_step_read_packed_is_the_joined_one(batch, threads):
    got, want, joined = _read_both(batch, threads=threads)
    assert_batch_equal(got, want)
    tokens = int(batch["attention_mask"].bool().sum())
    if batch["input_ids"].shape[0] >= 2 and tokens:  # several row groups: joined while read
        half = batch["extra"].dtype in (torch.float16, torch.bfloat16)  # stored widened: joined after the read
        assert "input_ids" in joined and ("extra" in joined) != half


@settings(max_examples=40, deadline=None)
@given(packed_batches(max_batch=12))
def test_a_packed_step_is_the_joined_one(batch):
    got, want, joined = _read_both(batch, layout=None)
    assert_batch_equal(got, want)
    if len(batch["cu_seqlens"]) >= 3 and int(batch["cu_seqlens"][-1]):
        assert "input_ids" in joined


def test_a_column_that_outgrows_its_first_buffer_moves_to_a_larger_one():
    """The first row groups' rows are short, the last ones long: the buffer sized from the first
    row group is too small, the column moves, and the batch is still exact."""
    lengths = [1] * 16 + [300] * 16
    T = max(lengths)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.randint(0, 1000, (32, T)).masked_fill(~mask, 0)
    lp = torch.randn(32, T).masked_fill(~mask, 0.0)
    batch = {"input_ids": ids, "attention_mask": mask, "logprobs": lp}
    allocated = []
    real = joining.empty

    def empty(n, dtype):
        allocated.append(n)
        return real(n, dtype)

    with mock.patch.object(joining, "empty", empty):
        got, want, joined = _read_both(batch)
    assert joined == ["input_ids", "logprobs"]
    assert len(allocated) > 2 and max(allocated) >= sum(lengths)  # the columns grew (the first buffers: 144)
    assert_batch_equal(got, want)
    assert torch.equal(got["input_ids"], ids[mask]) and torch.equal(got["logprobs"], lp[mask])


def test_the_copies_start_before_the_last_row_group_is_decoded():
    """Each row group's values are copied as it arrives (budget 1: on the reading thread, at once),
    not once the whole step is read."""
    lengths = list(range(1, 33))
    T = max(lengths)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    batch = {"input_ids": torch.arange(32 * T).reshape(32, T).masked_fill(~mask, 0), "attention_mask": mask}
    seen = []
    real_feed, real_copy = joining.StreamJoin.feed, joining._copy_values
    fed = [0]

    def feed(self, b):
        fed[0] += 1
        return real_feed(self, b)

    def copy(dst, src):
        seen.append(fed[0])
        return real_copy(dst, src)

    with mock.patch.object(joining.StreamJoin, "feed", feed), mock.patch.object(joining, "_copy_values", copy):
        got, want, joined = _read_both(batch, threads=1)
    assert joined == ["input_ids"]
    assert seen == list(range(1, 17))  # 16 row groups, each copied when it was the latest yielded
    assert_batch_equal(got, want)


def test_widened_or_unreadable_columns_are_left_to_the_join_after_the_read():
    """A column whose values are not the spec's storage type as stored is not taken by the stream
    join (``Columns`` converts or refuses it after the read)."""
    import pyarrow as pa

    j = joining.StreamJoin([("a", "float16"), ("b", "int32"), ("c", "int64")], rows=4)
    off = pa.array([0, 2, 3], pa.int64())
    batch = pa.RecordBatch.from_arrays(
        [pa.LargeListArray.from_arrays(off, pa.array([1.0, 2.0, 3.0], pa.float32())),  # half stored widened
         pa.LargeListArray.from_arrays(off, pa.array([1, None, 3], pa.int32())),  # a null inside
         pa.LargeListArray.from_arrays(off, pa.array([1, 2, 3], pa.int64()))], names=["a", "b", "c"])
    j.feed(batch)
    j.feed(batch)
    table = pa.Table.from_batches([batch, batch])
    parts = j.parts(table)
    assert list(parts) == ["c"]
    off, vals = parts["c"]
    assert off.tolist() == [0, 2, 3, 5, 6] and vals.tolist() == [1, 2, 3, 1, 2, 3] and vals.dtype == np.int64


def test_a_read_to_the_gpu_or_of_one_row_group_makes_no_stream_join(tmp_path):
    """The pinned-arena path keeps its own join; a step of one row group is read zero-copy."""
    made = []
    real = joining.StreamJoin.__init__

    def init(self, *a, **k):
        made.append(1)
        real(self, *a, **k)

    mask = torch.ones(4, 8, dtype=torch.bool)
    with trajstore.Writer(tmp_path / "r") as w:
        w.append(0, {"input_ids": torch.arange(32).reshape(4, 8), "attention_mask": mask})
    with mock.patch.object(joining.StreamJoin, "__init__", init), mock.patch.object(parquet, "PARALLEL_READ_BYTES", 0):
        trajstore.Reader(tmp_path / "r").read(0, layout="packed")
    assert made == []


@pytest.mark.parametrize("threads", [1, 3])
def test_submit_runs_inline_or_on_the_pool(threads):
    out = []
    with _threads.using(threads):
        f = _threads.submit(out.append, 1)
    if threads == 1:
        assert f is None and out == [1]
    else:
        f.result()
        assert out == [1]


@pytest.mark.parametrize("prefetch", [0, 2, 8])
def test_replay_on_the_cpu_joins_while_it_reads_below_the_serial_prefetch_depth(tmp_path, prefetch):
    """``Reader.iter`` to host memory: below ``SERIAL_PREFETCH`` the decoder threads join as they read;
    from it on, each of the serial threads joins a column in a few calls after its read
    (``Columns._combined``, tests/test_serial_join.py), not as the row groups arrive."""
    g = torch.Generator().manual_seed(0)
    steps = {}
    with many_row_groups():
        with trajstore.Writer(tmp_path / "r") as w:
            for s in range(6):
                lengths = torch.randint(0, 40, (24,), generator=g)
                mask = torch.arange(40)[None, :] < lengths[:, None]
                steps[s] = {"input_ids": torch.randint(0, 99, (24, 40), generator=g).masked_fill(~mask, 7),
                            "attention_mask": mask, "loss_mask": (torch.rand(24, 40, generator=g) < 0.5) & mask}
                w.append(s, steps[s])
        with spied() as joined:
            got = dict(trajstore.Reader(tmp_path / "r").iter(prefetch=prefetch, layout="packed"))
    assert sorted(got) == list(range(6))
    if prefetch >= prefetch_mod.SERIAL_PREFETCH:
        assert joined == []
    else:
        assert len(joined) == 6 and all(j == ["input_ids", "loss_mask"] for j in joined)
    for s, b in steps.items():
        m = b["attention_mask"]
        assert torch.equal(got[s]["input_ids"], b["input_ids"][m]) and torch.equal(got[s]["loss_mask"], b["loss_mask"][m])


@settings(max_examples=80, deadline=None)
@given(batches(), st.sampled_from([None, "packed", "padded"]))
def test_the_columns_joined_while_reading_are_the_ones_the_decode_joins_first(batch, layout):
    """``joined_first`` names exactly the columns the decoder joins before anything else (its one
    join of several columns); where it names none, the decoder joins columns one at a time as it
    needs them."""
    from trajstore.format.arrow import Columns
    from trajstore.format.codec.decoder import joined_first

    calls = []
    real = Columns.join

    def join(self, names):
        calls.append([n for n, _ in names])
        return real(self, names)

    with tempfile.TemporaryDirectory() as d:
        with trajstore.Writer(Path(d) / "r") as w:
            w.append(0, batch)
        r = trajstore.Reader(Path(d) / "r")
        spec = r._open(0).doc["batch"]
        with mock.patch.object(read_decode, "joined_first", lambda *a, **k: []), mock.patch.object(Columns, "join", join):
            try:
                r.read(0, layout=layout)
            except trajstore.errors.ConfigError:
                return  # no such layout for this batch
    first = joined_first(spec, None, layout)
    if first:
        assert calls and calls[0] == [c for c, _ in first], (calls, first)
    else:
        assert all(len(c) <= 1 for c in calls), calls


def test_a_buffer_over_the_decode_limit_is_left_to_the_join_after_the_read(monkeypatch):
    """A first row group far off the rest (or a damaged file) would size a buffer over the decode
    limit (``TRAJSTORE_MAX_DECODED_BYTES``): the column is joined after the read instead."""
    monkeypatch.setattr(joining, "limits", types.SimpleNamespace(MAX_DECODED_BYTES=4000))  # here only
    lengths = [100] * 8
    mask = torch.arange(100)[None, :] < torch.tensor(lengths)[:, None]
    batch = {"input_ids": torch.arange(800).reshape(8, 100), "attention_mask": mask,
             "versions": torch.ones(8, 100, dtype=torch.int8)}
    got, want, joined = _read_both(batch)
    assert joined == ["versions"]  # 800 int64 ids (6.4 kB) over the limit; 800 int8 values under it
    assert_batch_equal(got, want)
