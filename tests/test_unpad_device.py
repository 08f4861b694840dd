"""A padded CUDA batch leaves the GPU unpadded (device/unpad.py): its token fields' tokens are selected on
the device at ``append`` and only they are copied to the host; the step file is byte-identical to the one the
whole-tensor copy gives. On the CPU (CI) the same steps run on CPU tensors (``unpad.DEVICES``); the ``cuda``
tests run them on a GPU, with the caller's stream and in-place updates after ``append``."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trajstore
from trajstore import schema
from trajstore.device import unpad
from trajstore.device.pinned import PinnedPool
from trajstore.format import dtypes as dt
from trajstore.format.codec.unpadded import Unpadded
from trajstore.testing import assert_batch_equal, tensors
from trajstore.testing.bits import padded_values, run_mask
from trajstore.testing.forms import padded_batches, prompt_completion_batches, two_sided_batches
from trajstore.write import snapshot
from trajstore.write.snapshot import Snapshot

from test_masks_holes import MASKS, multi_turn_batches

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def on_cpu(monkeypatch):
    """Run the device path on CPU tensors too, whatever their size; returns the Unpaddings made."""
    monkeypatch.setattr(unpad, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(unpad, "MIN_BYTES", 0)
    made = []
    finish = unpad.Pending.finish

    def spy(self):
        u = finish(self)
        made.append(u)
        return u

    monkeypatch.setattr(unpad.Pending, "finish", spy)
    return made


def _tables(batch, masks=None, device=None):
    """The step's table through the device path (a Snapshot as append takes it) and through the whole
    tensors; and the Snapshot's Unpadding (None where the device path was not taken)."""
    if device is not None:
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    snap = Snapshot(batch, True, PinnedPool(), masks=masks)
    try:
        got = schema.encode_plain(snap.batch(), None, step=3, split="train", masks=masks, unpadded=snap.unpadded)
        u = snap.unpadded
    finally:
        snap.release()
    whole = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    want = schema.encode_plain(whole, None, step=3, split="train", masks=masks)
    return got, want, u


def _same(got: pa.Table, want: pa.Table) -> None:
    assert got.schema.equals(want.schema, check_metadata=True)
    assert _parquet(got) == _parquet(want)  # the bits, not Arrow's float equality


def _parquet(t: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(t, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


@SETTINGS
@given(st.one_of(padded_batches(), two_sided_batches(), prompt_completion_batches()))
def test_the_step_is_the_same_as_from_the_whole_tensors(on_cpu, batch):
    got, want, u = _tables(batch)
    _same(got, want)
    tokens = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.ndim >= 2 and v.numel()]
    if "input_ids" in batch and batch["input_ids"].numel():
        assert u is not None and "input_ids" in u.fields  # the device path was taken
    if u is not None:
        assert set(u.fields) <= set(tokens)


@SETTINGS
@given(multi_turn_batches())
def test_declared_masks_with_holes_use_the_whole_tensor(on_cpu, batch):
    got, want, _ = _tables(batch, masks=MASKS)
    _same(got, want)


@SETTINGS
@given(st.data())
def test_masks_of_every_kind(on_cpu, data):
    """Right, left, span and holed masks; a mask that is not 0/1 (fields stored whole, or refused for
    attention_mask, the same error either way); padded values of one value or several; [B, T, k] fields."""
    B, T = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 9))
    side = data.draw(st.sampled_from(["right", "left", "span"]))
    am = run_mask(data.draw, B, T, side)
    if data.draw(st.integers(0, 4)) == 0:
        am[0] = data.draw(tensors((T,), [torch.bool]))
    batch = {"input_ids": padded_values(data.draw, am, [torch.int64, torch.int32]),
             "attention_mask": am.to(data.draw(st.sampled_from([torch.bool, torch.int64, torch.float32]))),
             "logprobs": padded_values(data.draw, am, [torch.float32, torch.bfloat16, torch.float16]),
             "hidden": padded_values(data.draw, am[:, :, None].expand(B, T, 3), [torch.float32])}
    lm = data.draw(tensors((B, T), [torch.bool]))
    batch["x_mask"] = lm.to(torch.int64) * data.draw(st.sampled_from([1, 2]))  # an inferred group, maybe not 0/1
    batch["x_ids"] = padded_values(data.draw, lm, [torch.int64])
    if data.draw(st.integers(0, 6)) == 0:
        batch["attention_mask"] = batch["attention_mask"].to(torch.int64)
        batch["attention_mask"][0, 0] = 2
        with pytest.raises(trajstore.BatchError) as a:
            _tables(batch)
        with pytest.raises(trajstore.BatchError) as b:
            schema.encode_plain(batch, None, step=3, split="train")
        assert str(a.value) == str(b.value)
        return
    got, want, u = _tables(batch)
    _same(got, want)
    assert u is not None and {"input_ids", "logprobs", "hidden"} <= set(u.fields)


def test_padded_values_that_differ_are_kept_and_one_value_is_recorded(on_cpu):
    am = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    batch = {"input_ids": torch.tensor([[5, 6, 0, 0], [7, 8, 9, 0]]), "attention_mask": am,
             "logprobs": torch.tensor([[0.5, 0.25, 1.0, -0.0], [1.5, 2.5, 3.5, 0.0]])}
    got, want, u = _tables(batch)
    _same(got, want)
    assert u.fields["input_ids"].pad == 0 and u.fields["input_ids"].padvals is None
    assert u.fields["logprobs"].pad is None and u.fields["logprobs"].padvals.tolist() == [1.0, -0.0, 0.0]
    assert u.fields["input_ids"].values.tolist() == [5, 6, 7, 8, 9]
    assert u.masks["attention_mask"].tolist() == (am == 1).tolist()


def test_a_batch_without_padding_and_one_of_empty_rows(on_cpu):
    for am in (torch.ones(3, 5, dtype=torch.int64), torch.zeros(3, 5, dtype=torch.int64)):
        batch = {"input_ids": torch.arange(15).reshape(3, 5) * am, "attention_mask": am}
        got, want, u = _tables(batch)
        _same(got, want)
        ids = u.fields["input_ids"]
        assert ids.pad is None if bool(am.all()) else ids.pad == 0


def test_small_batches_and_cpu_tensors_are_copied_whole(monkeypatch):
    """Without the tests' settings: a CPU batch is never unpadded here, nor a CUDA one under MIN_BYTES."""
    batch = {"input_ids": torch.zeros(64, 4096, dtype=torch.int64), "attention_mask": torch.ones(64, 4096)}
    assert unpad.start(batch, None, PinnedPool()) is None
    monkeypatch.setattr(unpad, "DEVICES", ("cuda", "cpu"))
    assert unpad.start({k: v[:2, :8] for k, v in batch.items()}, None, PinnedPool()) is None
    assert unpad.start(batch, None, PinnedPool()) is not None


@pytest.mark.parametrize("where", ["append", "pass"])
def test_no_device_memory_takes_the_whole_tensor_path(on_cpu, monkeypatch, where):
    """Out of device memory for the copies made at ``append`` (the fields are copied whole instead), or
    for the copier's pass (the fields go whole from those copies): the same step either way."""
    def no_memory(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(unpad, "_snapshot", no_memory) if where == "append" else \
        monkeypatch.setattr(unpad.torch, "empty_like", no_memory)
    batch = {"input_ids": torch.tensor([[1, 2, 0]]), "attention_mask": torch.tensor([[1, 1, 0]]),
             "logprobs": torch.tensor([[0.5, -0.5, 0.0]])}
    got, want, u = _tables(batch)
    assert u is None
    assert on_cpu == ([] if where == "append" else [None])  # the pass ran (and gave up) only in the second case
    _same(got, want)


def test_without_the_copier_thread_the_writer_thread_collects(on_cpu, monkeypatch):
    """At interpreter exit no new work reaches the copier thread: ``finish`` runs the pass itself, once."""
    class Closed:
        def submit(self, *a, **k):
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(unpad, "_copier", Closed)
    batch = {"input_ids": torch.tensor([[1, 2, 0], [3, 0, 0]]), "attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}
    got, want, u = _tables(batch)
    assert u is not None and u.fields["input_ids"].values.tolist() == [1, 2, 3] and len(on_cpu) == 1
    _same(got, want)


@SETTINGS
@given(st.data())
def test_unpadded_rebuilds_its_tensor_bit_for_bit(data):
    """``Unpadded.full()``: the tensor whose tokens, padded values or pad bits it holds (NaN payloads too)."""
    B, W = data.draw(st.integers(0, 4)), data.draw(st.integers(0, 6))
    m = data.draw(tensors((B, W), [torch.bool]))
    x = padded_values(data.draw, m[:, :, None].expand(B, W, 2), [torch.float32, torch.bfloat16, torch.int8])
    flat, fm = x.reshape(B * W, 2), m.reshape(-1)
    pads = flat[~fm]
    bits = dt.bits_view(pads)
    one = bool(pads.numel()) and bool((bits == bits.reshape(-1)[0]).all())
    u = Unpadded("m", 0, W, tuple(x.shape), x.dtype, m, flat[fm], None if one else pads,
                 int(bits.reshape(-1)[0]) if one else None)
    assert torch.equal(dt.bits_view(u.full()), dt.bits_view(x))


def test_a_writer_dumps_the_same_file_bytes(on_cpu, tmp_path, monkeypatch):
    """Through ``Writer.append``: the committed step files of both paths hold the same bytes, and read back."""
    g = torch.Generator().manual_seed(0)
    L = torch.randint(0, 300, (16,), generator=g)
    am = torch.arange(512)[None] < L[:, None]
    batch = {"input_ids": torch.randint(0, 150_000, (16, 512), generator=g) * am, "attention_mask": am.long(),
             "logprobs": torch.randn(16, 512, generator=g).to(torch.bfloat16), "rewards": torch.randn(16, generator=g)}
    files = {}
    for on in (True, False):
        monkeypatch.setattr(snapshot, "UNPAD", on)
        with trajstore.Writer(tmp_path / str(on)) as w:
            w.append(0, batch)
        files[on] = {p.name: p.read_bytes() for p in Path(tmp_path / str(on)).rglob("*.parquet")}
    assert files[True] == files[False] and files[True]
    assert len(on_cpu) == 1
    assert_batch_equal(batch, trajstore.Reader(tmp_path / "True")[0])


# ----------------------------------------------------------------------------- on a GPU
cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@needs_gpu
@SETTINGS
@given(st.one_of(padded_batches(), two_sided_batches(), prompt_completion_batches()))
def test_on_the_gpu_the_step_is_the_same(monkeypatch, batch):
    monkeypatch.setattr(unpad, "MIN_BYTES", 0)
    got, want, u = _tables(batch, device="cuda")
    _same(got, want)
    if "input_ids" in batch and batch["input_ids"].numel():
        assert u is not None


@cuda
@needs_gpu
def test_on_the_gpu_a_long_tail_batch_copies_its_tokens_only_and_later_updates_do_not_reach_it(tmp_path):
    """[128, 16384] int64 ids right-padded (about 1/8 of their width tokens): what reaches pinned memory is
    the tokens and the [B, T] bool mask, not the padded fields; ``append`` never synchronizes (torch's sync
    debug mode raises if it does); the caller's stream overwrites every field right after ``append``
    without waiting, and the step holds the values as they were at ``append``."""
    g = torch.Generator().manual_seed(1)
    B, T = 128, 16384
    L = torch.randint(1, T // 4, (B,), generator=g)
    am = torch.arange(T)[None] < L[:, None]
    cpu = {"input_ids": torch.randint(0, 150_000, (B, T), generator=g) * am, "attention_mask": am.long(),
           "logprobs": torch.where(am, torch.randn(B, T, generator=g), 0.0).to(torch.bfloat16)}
    dev = {k: v.cuda() for k, v in cpu.items()}
    pool = PinnedPool()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # append never synchronizes the device or a stream
    try:
        snap = Snapshot(dev, True, pool)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for v in dev.values():  # queued on the caller's stream: ordered after the device pass
        v.fill_(7)
    try:
        batch = snap.batch()
        u = snap.unpadded
        assert u is not None and set(u.fields) == set(cpu)
        tokens = int(am.sum())
        copied = sum(f.values.numel() * f.values.element_size() for f in u.fields.values())
        assert copied == tokens * (8 + 8 + 2)
        assert all(f.padvals is None for f in u.fields.values())
        assert pool.allocated == 2  # the stats and masks, the tokens
    finally:
        snap.release()
    assert pool.cached_bytes < B * T * (8 + 8 + 2) // 3
    snap = Snapshot({k: v.cuda() for k, v in cpu.items()}, True, pool)
    try:
        batch, u = snap.batch(), snap.unpadded
        got = schema.encode_plain(batch, None, step=0, split="train", unpadded=u)
    finally:
        snap.release()
    want = schema.encode_plain(cpu, None, step=0, split="train")
    _same(got, want)
    with trajstore.Writer(tmp_path) as w:
        step = {k: v.cuda() for k, v in cpu.items()}
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            w.append(0, step)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert_batch_equal(cpu, trajstore.Reader(tmp_path)[0])

