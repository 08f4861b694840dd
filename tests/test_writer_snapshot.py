"""What ``append`` records when the caller reuses its buffers: the batch as it was at ``append``, by
default (copies into reused pool buffers), tensors inside object arrays and containers included
(issue 16 "appending never loses data by default", issue 17 "silently recorded mutation")."""

import tempfile
import threading
from collections import OrderedDict

import numpy as np
import pytest
import torch
from _dumps import clone
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore import WriterError
from trajstore.write import snapshot as snapshot_mod
from trajstore.write import pool as pool_mod
from trajstore.format.dtypes import bits_view
from trajstore.testing import assert_batch_equal, padded_batches, typed_batches


def refill(x, k: int) -> int:
    """Change every tensor and numeric array of ``x`` in place, wherever it sits (object arrays,
    dicts, lists, tuples), to values that depend on ``k``; returns how many were changed."""
    if isinstance(x, torch.Tensor):
        if not x.numel():
            return 0
        if x.dtype == torch.bool:
            x.logical_not_()
        else:
            bits_view(x).add_(k)
        return 1
    if isinstance(x, np.ndarray) and x.dtype == object:
        return sum(refill(v, k) for v in x.reshape(-1))
    if isinstance(x, np.ndarray):
        if x.dtype.kind in "biuf" and x.size:
            (x[None] if x.ndim == 0 else x).view(np.uint8)[...] += np.uint8(k)
            return 1
        return 0
    if isinstance(x, dict):
        return sum(refill(v, k) for v in list(x.values()))
    if isinstance(x, list | tuple):
        return sum(refill(v, k) for v in x)
    return 0


class Gate:
    """Hold every background write inside ``pq.write_table`` until ``open()``."""

    def __init__(self, mp):
        self.ev = threading.Event()
        real = pool_mod.pq.write_table
        mp.setattr(pool_mod.pq, "write_table", lambda *a, **k: (self.ev.wait(30), real(*a, **k))[1])

    def open(self):
        self.ev.set()


def _big_batch(B=64, T=2048):
    """A padded step whose token fields are over ``STAGE_BYTES`` (staged in pool buffers)."""
    m = torch.arange(T)[None, :] < torch.arange(B)[:, None] * (T // B) + 1
    return {"input_ids": torch.zeros(B, T, dtype=torch.int64), "attention_mask": m,
            "logprobs": torch.zeros(B, T, dtype=torch.float32), "rewards": torch.zeros(B)}


def _fill(b: dict, step: int) -> None:
    """The RL loop's refill of its reused buffers for ``step``."""
    m = b["attention_mask"]
    b["input_ids"].copy_((torch.arange(b["input_ids"].numel(), device=m.device).reshape(m.shape) * 7 + step) % 1000 * m)
    b["logprobs"].fill_(-0.5 * step).mul_(m)
    b["rewards"].fill_(float(step))


def test_reused_buffer_loop_records_every_step_by_default(tmp_path, monkeypatch):
    """Six steps refilled into the same tensors while none is written yet: each step as it was at its append."""
    b = _big_batch()
    assert b["input_ids"].nbytes >= snapshot_mod.STAGE_BYTES
    gate = Gate(monkeypatch)
    want = []
    w = trajstore.Writer(tmp_path)
    for step in range(6):
        _fill(b, step)
        want.append(clone(b))
        w.append(step, b)
    gate.open()
    w.close()
    r = trajstore.Reader(tmp_path)
    assert r.steps == list(range(6))
    for step in range(6):
        assert_batch_equal(want[step], r[step])


def test_staging_buffers_are_reused(tmp_path):
    """After the first steps, a loop of same-sized steps allocates no new staging buffer."""
    b = _big_batch()
    with trajstore.Writer(tmp_path, workers=1) as w:
        for step in range(8):
            _fill(b, step)
            w.append(step, b)
            w.flush()
            if step == 1:
                allocated = w._staging.allocated
        assert 0 < allocated == w._staging.allocated and w._staging.in_use == 0


@settings(max_examples=15, deadline=None)
@given(st.lists(padded_batches(), min_size=1, max_size=3), st.integers(1, 3), st.booleans())
def test_refilled_batches_are_recorded_as_at_append(steps, workers, stage_all):
    """Hypothesis: each step's batch refilled in place right after ``append`` (so the buffers the
    caller hands over change under the writer), through clones or through pool buffers."""
    with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
        if stage_all:
            mp.setattr(snapshot_mod, "STAGE_BYTES", 1)
        gate = Gate(mp)
        wants = [clone(b) for b in steps]
        w = trajstore.Writer(d, workers=workers)
        for i, b in enumerate(steps):
            w.append(i, b)
            refill(b, i + 1)
        gate.open()
        w.close()
        r = trajstore.Reader(d)
        for i, want in enumerate(wants):
            assert_batch_equal(want, r[i])


def _mm_batch():
    """verl's ``multi_modal_inputs``: an object array of dicts of tensors, and a list of dicts of tensors."""
    mm = np.empty(2, dtype=object)
    mm[0] = {"pixel_values": torch.arange(12, dtype=torch.float32).reshape(3, 4),
             "image_grid_thw": torch.tensor([[1, 2, 2]])}
    mm[1] = OrderedDict(pixel_values=torch.ones(2, 4), image_grid_thw=torch.tensor([[1, 1, 2]]))  # kept as such
    return {"input_ids": torch.arange(8).reshape(2, 4), "multi_modal_inputs": mm,
            "extras": [{"t": (torch.zeros(2), np.zeros(3))}, {"t": (torch.ones(2), np.ones(3))}]}


def test_tensor_in_object_array_changed_after_append_is_recorded_as_at_append(tmp_path, monkeypatch):
    b = _mm_batch()
    want = clone(b)
    gate = Gate(monkeypatch)
    w = trajstore.Writer(tmp_path)
    w.append(0, b)
    b["multi_modal_inputs"][0]["pixel_values"].mul_(-1)
    b["multi_modal_inputs"][1]["image_grid_thw"][0, 0] = 9
    b["extras"][1]["t"][0].add_(5)
    b["extras"][1]["t"][1][:] = 7
    gate.open()
    w.close()
    assert_batch_equal(want, trajstore.Reader(tmp_path)[0])


@pytest.mark.parametrize("where", ["object array", "OrderedDict in an object array", "list of dicts"])
def test_tensor_in_object_array_changed_without_copy_fails_the_step(tmp_path, monkeypatch, where):
    b = _mm_batch()
    gate = Gate(monkeypatch)
    w = trajstore.Writer(tmp_path)
    w.append(0, b, copy=False)
    if where == "object array":
        b["multi_modal_inputs"][0]["pixel_values"].mul_(-1)
        field = r"multi_modal_inputs\.0\.pixel_values"
    elif where.startswith("OrderedDict"):
        b["multi_modal_inputs"][1]["image_grid_thw"][0, 0] = 9
        field = r"multi_modal_inputs\.1\.image_grid_thw"
    else:
        b["extras"][1]["t"][0].add_(5)
        field = r"extras\.1\.t\.0"
    gate.open()
    with pytest.raises(WriterError, match=f"step 0: field '{field}' was modified in place"):
        w.close()
    assert trajstore.Reader(tmp_path).steps == []


@settings(max_examples=15, deadline=None)
@given(typed_batches(), st.booleans())
def test_typed_values_changed_after_append(batch, copy):
    """Hypothesis, tensors and arrays at any depth of object arrays, dicts, lists and tuples changed
    after ``append``: recorded as at ``append`` (copy=True), or with copy=False never recorded changed:
    the step fails with ``WriterError`` when a tensor was changed."""
    want = clone(batch)
    with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
        gate = Gate(mp)
        w = trajstore.Writer(d)
        w.append(0, batch, copy=copy)
        changed_tensors = _count_tensors(batch)
        refill(batch, 3)
        gate.open()
        if not copy and changed_tensors:
            with pytest.raises(WriterError, match="modified in place"):
                w.close()
            return
        w.close()
        assert_batch_equal(want, trajstore.Reader(d)[0])


def _count_tensors(x) -> int:
    if isinstance(x, torch.Tensor):
        return int(x.numel() > 0)
    if isinstance(x, np.ndarray):
        return sum(_count_tensors(v) for v in x.reshape(-1)) if x.dtype == object else 0
    if isinstance(x, dict):
        return sum(_count_tensors(v) for v in x.values())
    if isinstance(x, list | tuple):
        return sum(_count_tensors(v) for v in x)
    return 0


def test_writer_copy_false_is_the_writers_default_for_append(tmp_path, monkeypatch):
    b = {"input_ids": torch.arange(6).reshape(2, 3)}
    gate = Gate(monkeypatch)
    w = trajstore.Writer(tmp_path, copy=False)
    w.append(0, b)
    w.append(1, b, copy=True)  # per call, the other way
    b["input_ids"].add_(1)
    gate.open()
    with pytest.raises(WriterError, match="step 0: field 'input_ids' was modified"):
        w.close()
    assert trajstore.Reader(tmp_path).steps == [1]
    with pytest.raises(trajstore.ConfigError, match="copy must be True or False"):
        trajstore.Writer(tmp_path, copy="yes")


@pytest.mark.cuda
def test_cuda_tensors_refilled_after_append_are_recorded_as_at_append(tmp_path, monkeypatch):
    """CUDA tensors (top level and inside an object array) refilled on the caller's stream right
    after ``append``, with the background held: every step as it was at its append."""
    gate = Gate(monkeypatch)
    b = {k: v.cuda() for k, v in _big_batch().items()}
    mm = np.empty(b["rewards"].shape[0], dtype=object)
    for i in range(len(mm)):
        mm[i] = {"pixel_values": torch.zeros(3, 4, device="cuda")}
    b["multi_modal_inputs"] = mm
    want = []
    w = trajstore.Writer(tmp_path)
    for step in range(4):
        _fill(b, step)
        for i, d in enumerate(mm):
            d["pixel_values"].fill_(step * 100 + i)
        want.append({k: v.cpu() if isinstance(v, torch.Tensor) else clone(v) for k, v in b.items()})
        w.append(step, b)
    gate.open()
    w.close()
    r = trajstore.Reader(tmp_path)
    for step in range(4):
        got = r[step]
        want_mm = want[step]["multi_modal_inputs"]
        for i in range(len(want_mm)):
            want_mm[i] = {"pixel_values": want_mm[i]["pixel_values"].cpu()}
        assert_batch_equal(want[step], got)
