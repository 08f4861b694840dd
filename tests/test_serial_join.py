"""A thread that decodes serially (``Reader.iter`` with a deep prefetch: several steps decode at once,
one a thread) joins each token column in a few calls (``Columns._combined``: Arrow concatenates its
chunks, then one conversion or copy) instead of the pool join's copies in pieces, whose hundreds of
Python calls a step serialize on the GIL across the prefetch threads. The batch is bit for bit the
one the pool join gives, in every form and layout, to host memory and into the pinned arena the
GPU path decodes into."""

import tempfile
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import _dumps
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings, strategies as st
from test_device_pad import device_read

import trajstore
from trajstore import torch_bridge
from trajstore.base import threads as _threads
from trajstore.format.arrow import Columns
from trajstore.testing import batches
from trajstore.testing.compare import assert_batch_equal
from trajstore.testing.forms import (
    group_lists,
    packed_batches,
    padded_batches,
    prompt_completion_batches,
    trajectory_lists,
    two_sided_batches,
)


@contextmanager
def counted():
    """``calls``: the columns each ``Columns._combined`` joined."""
    calls: list[str] = []
    real = Columns._combined

    def combined(self, name, dtype):
        calls.append(name)
        return real(self, name, dtype)

    with mock.patch.object(Columns, "_combined", combined):
        yield calls


def _reads(r, layout, arena):
    """(the step read serially, the step read with the pool join, the columns joined serially)."""
    def read():
        return device_read(r, 0, layout)[0] if arena else r._read(0, None, layout)

    with _dumps.serial_thread(), counted() as calls:
        got = read()
    with _threads.using(3):
        want = read()
    return got, want, calls


@settings(max_examples=80, deadline=None)
@given(st.one_of(batches(), padded_batches(), two_sided_batches(), prompt_completion_batches(), packed_batches(),
                 trajectory_lists(), group_lists()),
       st.sampled_from([None, "packed", "padded"]), st.booleans())
def test_a_serial_decode_is_the_pool_join_bit_for_bit(batch, layout, arena):
    """Hypothesis over the batch forms (tensors of arbitrary bits: int64 ids stored int32, half
    values stored widened, bools), each step in several row groups: the serial read equals the pool
    join's read and, in the recorded layout, the batch written."""
    mp = pytest.MonkeyPatch()
    try:
        with tempfile.TemporaryDirectory() as d:
            _dumps.many_row_groups(mp)
            with trajstore.Writer(Path(d) / "r") as w:
                w.append(0, batch)
            r = trajstore.Reader(Path(d) / "r")
            try:
                got, want, _ = _reads(r, layout, arena)
            except trajstore.errors.ConfigError:
                return  # no such layout for this batch
            assert_batch_equal(got, want)
            if layout is None:
                assert_batch_equal(got, batch)
    finally:
        mp.undo()


@pytest.mark.parametrize("arena", [False, True])
def test_a_serial_decode_joins_each_token_column_once_with_its_values_exact(tmp_path, monkeypatch, arena):
    """A padded step of several row groups read packed on a serial thread: every token column is
    joined by ``_combined`` (each once), int64 ids stored as int32 come back int64, the masks' bools
    and the bf16 values exact; into the arena, the joined columns are in its pinned memory."""
    _dumps.many_row_groups(monkeypatch)
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 50, (16,), generator=g)
    m = torch.arange(50)[None, :] < lengths[:, None]
    b = {"input_ids": torch.randint(0, 152_064, (16, 50), generator=g).masked_fill(~m, 0), "attention_mask": m,
         "loss_mask": (torch.rand(16, 50, generator=g) < 0.5) & m,
         "logprobs": torch.randn(16, 50, generator=g).to(torch.bfloat16).masked_fill(~m, 0)}
    with trajstore.Writer(tmp_path / "r") as w:
        w.append(0, b)
    r = trajstore.Reader(tmp_path / "r")
    if arena:
        pool = torch_bridge.PinnedPool()
        a = torch_bridge.Arena(pool)
        with _dumps.serial_thread(), counted() as calls:
            got = r._read(0, None, "packed", a)
        assert a.holds(got["input_ids"]) and a.holds(got["loss_mask"]) and a.holds(got["logprobs"])
        got = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in got.items()}
        a.release()
    else:
        with _dumps.serial_thread(), counted() as calls:
            got = r._read(0, None, "packed")
    assert sorted(calls) == ["input_ids", "logprobs", "loss_mask"]
    assert got["input_ids"].dtype == torch.int64 and torch.equal(got["input_ids"], b["input_ids"][m])
    assert torch.equal(got["loss_mask"], b["loss_mask"][m])
    assert torch.equal(got["logprobs"].view(torch.int16), b["logprobs"][m].view(torch.int16))


def test_a_thread_that_is_not_serial_keeps_the_pool_join(tmp_path, monkeypatch):
    _dumps.many_row_groups(monkeypatch)
    with trajstore.Writer(tmp_path / "r") as w:
        w.append(0, {"input_ids": torch.arange(64).reshape(8, 8), "attention_mask": torch.ones(8, 8, dtype=torch.bool)})
    r = trajstore.Reader(tmp_path / "r", threads=2)
    with counted() as calls:
        got = r.read(0, layout="packed")
    assert calls == [] and torch.equal(got["input_ids"], torch.arange(64))


@pytest.mark.cuda
@pytest.mark.parametrize("layout", [None, "packed", "padded"])
def test_a_deep_prefetch_to_the_gpu_is_the_cpu_read_bit_for_bit(tmp_path, monkeypatch, layout):
    """``Reader.iter(device="cuda", prefetch=8)``: the serial threads join into the pinned arena
    (``_combined``; the int64 ids as stored, and a packed read's bools, converted on the GPU), the batches on
    the GPU are the CPU reads, int64 ids and bf16 values included."""
    _dumps.many_row_groups(monkeypatch)
    g = torch.Generator().manual_seed(5)
    steps = {}
    with trajstore.Writer(tmp_path / "r") as w:
        for s in range(10):
            lengths = torch.randint(0, 60, (20,), generator=g)
            m = torch.arange(60)[None, :] < lengths[:, None]
            steps[s] = {"input_ids": torch.randint(0, 152_064, (20, 60), generator=g).masked_fill(~m, 151_643),
                        "attention_mask": m, "loss_mask": (torch.rand(20, 60, generator=g) < 0.5) & m,
                        "logprobs": torch.randn(20, 60, generator=g).to(torch.bfloat16).masked_fill(~m, 0),
                        "rewards": torch.randn(20, generator=g)}
            w.append(s, steps[s])
    r = trajstore.Reader(tmp_path / "r")
    with counted() as calls:
        got = list(r.iter(device="cuda", prefetch=8, layout=layout))
    assert [s for s, _ in got] == list(range(10)) and "logprobs" in calls
    assert "input_ids" not in calls  # packed or padded: the int64 ids joined as stored (format/codec/late.py)
    for s, b in got:
        devices = []
        host = torch_bridge.map_tensors(b, lambda t: devices.append(t.device.type) or t.cpu())
        assert devices and set(devices) == {"cuda"}
        assert_batch_equal(host, r.read(s, layout=layout))


@pytest.mark.parametrize("stored, dtype", [(pa.int32(), "int64"), (pa.float32(), "float32"), (pa.bool_(), "bool"),
                                           (pa.float32(), "bfloat16")])
@pytest.mark.parametrize("chunks", [0, 1, 3])
def test_a_column_of_no_or_empty_chunks_joins_serially_as_the_pool_does(stored, dtype, chunks):
    """A column of no chunks at all (an empty slice of a shard), or of empty ones, joins to no values of
    the spec's storage dtype, on a serial thread as with the pool join."""
    t = pa.table({"x": pa.chunked_array([pa.array([], pa.large_list(stored))] * chunks, type=pa.large_list(stored))})
    with _dumps.serial_thread():
        off, v = Columns(t, "w").list_parts("x", dtype)
    off2, v2 = Columns(t, "w").list_parts("x", dtype)
    assert off.tolist() == off2.tolist() == [0] and len(v) == len(v2) == 0 and v.dtype == v2.dtype
