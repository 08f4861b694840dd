"""Arrow decoding a step straight into pinned memory (``trajstore/device/decode_pool.py``): the arena's joins become
copies to the device from Arrow's memory (``torch_bridge.Arena.send``). On the CPU the pool's large buffers are plain
cached memory and ``launch`` copies on the host, so the whole path runs here: every batch form read through it equals
the plain read bit for bit, with the arena's place of each value taken to send overwritten (``sends.POISON``), so a
host read of one before it is copied back shows. The pool's build: cached, and what ``pinned()`` says where it cannot
be had."""

import os
import subprocess
import sys
import tempfile
import time
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _dumps import cuda_replay_equals_cpu, many_row_groups, on_cuda_equal, read_as, serial_thread, write
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore.device import bridge, decode_pool, sends
from trajstore.device import plan as plan_mod
from trajstore.testing import (
    assert_batch_equal,
    batches,
    group_lists,
    non_tensor_batches,
    packed_batches,
    padded_batches,
    prompt_completion_batches,
    two_sided_batches,
    typed_batches,
)

CPU = torch.device("cpu")

needs_cxx = pytest.mark.skipif(decode_pool.compiler() is None, reason="needs a C++ compiler to build the pool")


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    if decode_pool.compiler() is None:
        pytest.skip("needs a C++ compiler to build the pool")
    return decode_pool.plain(threshold=1, dest=tmp_path_factory.mktemp("pool"))  # every buffer: small batches too


def direct_read(r, step, layout, pool, sent, deep=False):
    """``Reader.read(step, device=...)``'s path with the CPU as the device and Arrow decoding into ``pool`` (``deep``:
    on a deep prefetch's thread, columns joined in a few calls); what ``stage`` kept to send goes to ``sent``."""
    if deep:
        with serial_thread():
            return direct_read(r, step, layout, pool, sent)
    staging = bridge.PinnedPool(pin=False)
    arena = bridge.Arena(staging, defer=True, direct=pool)
    staged = bridge.stage(r._read(step, None, layout, arena), staging, arena)
    sent.append(list(staged.sends))
    out, ev = bridge.launch(staged, CPU, None)
    assert ev is None and staging.in_use == 0 and not arena.sends.items
    return out


@needs_cxx
@settings(max_examples=60, deadline=None)
@given(st.one_of(batches(), padded_batches(), packed_batches(), two_sided_batches(), prompt_completion_batches(),
                 group_lists(), non_tensor_batches(), typed_batches()),
       st.sampled_from([None, "padded", "packed"]), st.booleans(), st.booleans())
def test_every_batch_read_through_the_pinned_decode_is_the_plain_read(pool, batch, layout, many_groups, deep):
    mp = pytest.MonkeyPatch()
    mp.setattr(sends, "POISON", True)
    mp.setattr(sends, "SEND_BYTES", 1)  # the small chunks of these batches go through ``send`` too
    if many_groups:
        many_row_groups(mp)
    try:
        with tempfile.TemporaryDirectory() as d:
            step = read_as(d, batch, layout)
            if step is None:
                return  # no layout to convert
            r, want = step
            assert_batch_equal(want, direct_read(r, 0, layout, pool, [], deep))
    finally:
        mp.undo()


@needs_cxx
@pytest.mark.parametrize("deep", [False, True])
@pytest.mark.parametrize("layout", ["packed", None])
def test_a_packed_step_sends_its_token_columns_from_arrows_memory(tmp_path, monkeypatch, pool, deep, layout):
    many_row_groups(monkeypatch)
    monkeypatch.setattr(sends, "POISON", True)
    g = torch.Generator().manual_seed(0)
    lens = [5, 0, 300, 41, 2000, 7]
    b = {"input_ids": torch.randint(0, 152_000, (sum(lens),), generator=g),
         "loss_mask": torch.rand(sum(lens), generator=g) < 0.5,
         "logprobs": torch.randn(sum(lens), generator=g).to(torch.bfloat16),
         "cu_seqlens": torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32),
         "rewards": torch.randn(len(lens), generator=g)}
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, b)
    r = trajstore.Reader(tmp_path / "d")
    want = r.read(0, layout=layout)
    monkeypatch.setattr(sends, "SEND_BYTES", 1)
    sent: list = []
    assert_batch_equal(want, direct_read(r, 0, layout, pool, sent, deep))
    assert len(sent[0]) > 0  # the chunks of the token columns went from Arrow's memory, not through the arena
    assert all(pool.owns(src.ctypes.data, src.nbytes) for _, src in sent[0])
    monkeypatch.setattr(sends, "SEND_BYTES", 1 << 40)  # none large enough: all joined in the arena, as before
    sent.clear()
    assert_batch_equal(want, direct_read(r, 0, layout, pool, sent))
    assert sent == [[]]


@needs_cxx
@pytest.mark.parametrize("deep", [False, True])
@pytest.mark.parametrize("side", ["right", "left"])
def test_a_padded_step_sends_the_values_its_fields_are_built_from(tmp_path, monkeypatch, pool, deep, side):
    many_row_groups(monkeypatch)
    monkeypatch.setattr(sends, "POISON", True)
    g = torch.Generator().manual_seed(1)
    B, T = 160, 8192  # outputs over pad_plan.FLAT_BYTES: built from their values where the arena holds them
    lens = torch.randint(0, T + 1, (B,), generator=g)
    ar = torch.arange(T)[None, :]
    m = ar < lens[:, None] if side == "right" else ar >= (T - lens)[:, None]
    b = {"input_ids": torch.randint(0, 152_000, (B, T), generator=g).masked_fill(~m, 151_643),
         "attention_mask": m.long(),
         "logprobs": torch.randn(B, T, generator=g).masked_fill(~m, 0.0),
         "loss_mask": m & (torch.rand(B, T, generator=g) < 0.7),
         "rewards": torch.randn(B, generator=g)}
    assert len(padded_sends(tmp_path, monkeypatch, pool, b, deep)) > 0  # the values the device builds the padded
    # fields from went from Arrow's memory


def padded_sends(tmp_path, monkeypatch, pool, b, deep=False):
    """``b`` written as step 0 and read padded through the pinned decode, every chunk large enough to send: equal to
    the plain read; what ``stage`` kept to send."""
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, b)
    r = trajstore.Reader(tmp_path / "d")
    want = r.read(0)
    monkeypatch.setattr(sends, "SEND_BYTES", 1)
    sent: list = []
    assert_batch_equal(want, direct_read(r, 0, None, pool, sent, deep))
    return sent[0]


@needs_cxx
def test_a_padded_fields_probe_for_one_value_leaves_its_values_sent(tmp_path, monkeypatch, pool):
    """The pad plan looks for one value a field repeats (``plan._const``) in pieces that grow; a field of long equal
    runs (a trajectory's policy version) is read far past ``PEEK_BYTES`` before a different value shows. Those
    reads copy the bytes they read alone: every value of the field still goes from Arrow's memory."""
    many_row_groups(monkeypatch)
    monkeypatch.setattr(sends, "POISON", True)
    g = torch.Generator().manual_seed(2)
    B, T = 160, 8192  # outputs over pad_plan.FLAT_BYTES (built from their values where the arena holds them)
    lens = torch.randint(T // 2, T + 1, (B,), generator=g)
    m = torch.arange(T)[None, :] < lens[:, None]
    versions = (1000 + torch.arange(B, dtype=torch.int32) // 16)[:, None].expand(B, T).masked_fill(~m, 0)
    b = {"input_ids": torch.randint(0, 152_000, (B, T), generator=g).masked_fill(~m, 0), "attention_mask": m,
         "versions": versions.contiguous(), "rewards": torch.randn(B, generator=g)}
    sent = padded_sends(tmp_path, monkeypatch, pool, b)
    assert sum(src.nbytes for _, src in sent) >= 2 * 4 * int(lens.sum())  # ids and versions, int32 each


@needs_cxx
def test_a_padded_field_of_one_value_sent_from_arrows_memory_is_not_probed(tmp_path, monkeypatch, pool):
    """A field whose values go to the device from Arrow's memory is not scanned for one repeated value (it would be
    copied back to be read, where sending it costs the host nothing): a field of one version goes whole, and the
    padded batch is the same."""
    many_row_groups(monkeypatch)
    monkeypatch.setattr(sends, "POISON", True)
    g = torch.Generator().manual_seed(3)
    B, T = 160, 8192
    lens = torch.randint(T // 2, T + 1, (B,), generator=g)
    m = torch.arange(T)[None, :] < lens[:, None]
    b = {"input_ids": torch.randint(0, 152_000, (B, T), generator=g).masked_fill(~m, 0), "attention_mask": m,
         "versions": torch.full((B, T), 1000, dtype=torch.int32).masked_fill(~m, 0)}
    calls = []
    real = plan_mod._const
    monkeypatch.setattr(plan_mod, "_const", lambda srcs, *a: calls.append(srcs[0].dtype) or real(srcs, *a))
    sent = padded_sends(tmp_path, monkeypatch, pool, b)
    assert sum(src.nbytes for _, src in sent) >= 2 * 4 * int(lens.sum())  # ids and versions, int32 each
    assert torch.int32 not in calls  # (the mask of ones, one value repeated as stored, is looked at: no read)


def test_the_arena_copies_back_what_a_host_reader_needs(monkeypatch):
    monkeypatch.setattr(sends, "POISON", True)
    monkeypatch.setattr(sends, "SEND_BYTES", 1)
    pageable = np.arange(100, dtype=np.int32)  # memory the pinned pool does not own: copied on the host
    owner = SimpleNamespace(pool=None, owns=lambda address, n: address != pageable.ctypes.data)
    arena = bridge.Arena(bridge.PinnedPool(pin=False), direct=owner)
    arena.reserve(1 << 16)
    a, b = arena.alloc(100, np.int32), arena.alloc(50, np.float32)
    src_a, src_b = np.arange(100, dtype=np.int32), np.linspace(0, 1, 50, dtype=np.float32)
    d = arena.sends
    assert not d.send(a, pageable)
    assert d.send(a, src_a) and d.send(b, src_b)
    assert not d.send(a[:10], src_a[:5])  # not the same shape
    assert not d.send(a, src_a.astype(np.int64))  # a conversion between them
    assert not d.send(np.empty(100, np.int32), src_a)  # not in the arena
    assert (a.view(np.uint8) == 0xA5).all() and (b.view(np.uint8) == 0xA5).all()
    d.ready_for(b[10:20])  # a small read: those bytes alone, b's values still taken (the device writes the same)
    assert np.array_equal(b[10:20], src_b[10:20]) and (b[:10].view(np.uint8) == 0xA5).all() and len(d.items) == 2
    monkeypatch.setattr(sends, "PEEK_BYTES", 16)
    d.ready_for(b[10:20])  # a larger one: all of the one send it meets, a's untouched
    assert np.array_equal(b, src_b) and (a.view(np.uint8) == 0xA5).all() and len(d.items) == 1
    base = arena.buf.data_ptr()
    keep = d.keep_within([(a.ctypes.data - base, a.nbytes)])
    assert [off for off, _ in keep] == [a.ctypes.data - base] and d.items == []
    arena.release()


def test_the_build_is_cached_and_a_missing_compiler_leaves_the_staged_replay(tmp_path, monkeypatch):
    if decode_pool.compiler() is None:
        pytest.skip("needs a C++ compiler to build the pool")
    decode_pool.build(tmp_path)
    built = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))  # (and the build's lock)
    assert len(built) == 1 and built[0].startswith("decode_pool-") and built[0].endswith(".so")
    mtime = (tmp_path / built[0]).stat().st_mtime_ns
    decode_pool.build(tmp_path)  # found, not built again
    assert (tmp_path / built[0]).stat().st_mtime_ns == mtime and len(list(tmp_path.iterdir())) == 2

    monkeypatch.setattr(decode_pool, "_state", {})
    monkeypatch.setenv(decode_pool.ENV, "0")
    assert decode_pool.pinned() is None and decode_pool.status().startswith("off")
    monkeypatch.setenv(decode_pool.ENV, "1")
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler, no cached build under this cache
    monkeypatch.setenv("TRAJSTORE_CACHE", str(tmp_path / "empty"))
    with pytest.warns(trajstore.errors.ConfigWarning, match="not available here"):
        assert decode_pool.pinned() is None
    assert decode_pool.status().startswith("unavailable: MissingDependencyError: no C++ compiler")
    with pytest.raises(trajstore.errors.MissingDependencyError, match="install one"):
        decode_pool.build(tmp_path / "empty")
    assert decode_pool.pinned() is None  # decided once


@pytest.mark.cuda
@settings(max_examples=40, deadline=None)
@given(st.one_of(batches(), padded_batches(), packed_batches(), two_sided_batches(), prompt_completion_batches()),
       st.sampled_from([None, "padded", "packed"]), st.sampled_from([0, 2, 8]))
def test_cuda_replay_decoding_into_pinned_memory_equals_the_cpu_read(batch, layout, prefetch):
    mp = pytest.MonkeyPatch()
    mp.setenv(decode_pool.ENV, "1")
    mp.setattr(sends, "POISON", True)
    mp.setattr(sends, "SEND_BYTES", 1)
    try:
        assert decode_pool.pinned() is not None, decode_pool.status()
        cuda_replay_equals_cpu(batch, layout, prefetch)
    finally:
        mp.undo()



@pytest.mark.cuda
def test_cuda_replay_by_default_while_the_pool_is_built_and_after(tmp_path, monkeypatch):
    """The variable unset (the default): a replay started before the pool is built stages its first steps as
    before and decodes the later ones into the pool once it is there; both equal the CPU read bit for bit, and a
    deep prefetch's steps decode into the pool after ``wait``."""
    monkeypatch.delenv(decode_pool.ENV, raising=False)
    monkeypatch.setenv("TRAJSTORE_CACHE", str(tmp_path / "cache"))  # a build of its own, not one cached already
    monkeypatch.setattr(decode_pool, "_state", {})
    monkeypatch.setattr(sends, "POISON", True)
    g = torch.Generator().manual_seed(7)
    mask = torch.arange(3000) < torch.randint(1000, 3001, (64, 1), generator=g)  # right-padded
    batch = {"input_ids": torch.randint(0, 50_000, (64, 3000), generator=g) * mask, "attention_mask": mask,
             "loss_mask": (torch.rand(64, 3000, generator=g) > 0.3) & mask,
             "logprobs": torch.randn(64, 3000, generator=g).to(torch.bfloat16), "rewards": torch.rand(64)}
    r = write(tmp_path / "d", {s: batch for s in range(12)})
    cpu = {layout: r.read(0, layout=layout) for layout in (None, "packed")}
    for i, layout in enumerate((None, "packed", None)):
        for prefetch in (1, 4):
            for _, b in r.iter(device="cuda", prefetch=prefetch, layout=layout):
                on_cuda_equal(cpu[layout], b)
        if i == 0:
            decode_pool.wait(120)
    assert decode_pool.status() == "on", decode_pool.status()
    assert decode_pool.pinned().made() > 0  # steps did decode into it


def test_by_default_the_pool_is_built_in_the_background_and_no_step_waits(tmp_path, monkeypatch):
    """Unset, the first ``pinned()`` starts the build on a thread and returns None (that step stages as before),
    ``status()`` saying so; once built, ``pinned()`` has it. Where it cannot be had, no warning: ``status()`` says
    why."""
    if decode_pool.compiler() is None:
        pytest.skip("needs a C++ compiler to build the pool")
    monkeypatch.delenv(decode_pool.ENV, raising=False)
    monkeypatch.setenv("TRAJSTORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(decode_pool, "_state", {})
    monkeypatch.setattr(decode_pool, "cuda_host_alloc", lambda: None)  # (its plain twin: no CUDA here)
    gate = __import__("threading").Event()
    real = decode_pool.build
    monkeypatch.setattr(decode_pool, "build", lambda *a: gate.wait(60) and real(*a))
    assert decode_pool.DEFAULT and decode_pool.wanted()
    assert decode_pool.pinned() is None and decode_pool.status().startswith("on, being built")
    assert decode_pool.pinned() is None  # still building: one build thread, no wait
    gate.set()
    got = decode_pool.wait(60)
    assert got is not None and decode_pool.pinned() is got and decode_pool.status() == "on"

    monkeypatch.setattr(decode_pool, "_state", {})
    monkeypatch.setattr(decode_pool, "build", lambda *a: (_ for _ in ()).throw(
        trajstore.errors.MissingDependencyError("no C++ compiler")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert decode_pool.wait(60) is None
    assert decode_pool.status() == "unavailable: MissingDependencyError: no C++ compiler"


def test_a_build_removes_what_dead_builds_left_and_spares_a_young_one(tmp_path):
    """A process that exits while its background build runs leaves the compiler's output unrenamed (``*.tmp``): the
    next build in that cache removes those older than ``STALE_S``, and leaves a young one (a build elsewhere, where the
    lock is not honoured) and everything else."""
    if decode_pool.compiler() is None:
        pytest.skip("needs a C++ compiler to build the pool")
    old, young, other = (tmp_path / "decode_pool-25.0.0-0.so.x1.tmp", tmp_path / "decode_pool-25.0.0-0.so.x2.tmp",
                         tmp_path / "notes.tmp")
    for p in (old, young, other):
        p.write_text("")
    t = time.time() - decode_pool.STALE_S - 60
    os.utime(old, (t, t))
    os.utime(other, (t, t))
    decode_pool.build(tmp_path)
    assert not old.exists() and young.exists() and other.exists()
    assert len(list(tmp_path.glob("decode_pool-*.so"))) == 1


def test_the_ranks_of_a_host_build_the_pool_once(tmp_path):
    """Processes building into one cache at once: one runs the compiler, the others wait for it and load its
    build (a file lock in the cache)."""
    if decode_pool.compiler() is None:
        pytest.skip("needs a C++ compiler to build the pool")
    log = tmp_path / "runs"
    cxx = tmp_path / "cxx"
    cxx.write_text(f"#!/bin/sh\necho run >> {log}\nexec {decode_pool.compiler()} \"$@\"\n")
    cxx.chmod(0o755)
    code = ("import sys; from pathlib import Path; from trajstore.device import decode_pool; "
            "decode_pool.build(Path(sys.argv[1])); print('ok')")
    env = {**os.environ, "CXX": str(cxx)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "cache")], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    assert [p.communicate(timeout=300)[0].strip() for p in procs] == ["ok"] * 3
    assert log.read_text().split() == ["run"]
    assert len([p for p in (tmp_path / "cache").iterdir() if p.suffix == ".so"]) == 1


def test_a_cache_that_cannot_be_written_builds_in_the_temporary_folder(tmp_path, monkeypatch):
    """``$TRAJSTORE_CACHE`` (or the home's cache) that cannot be made: the pool is built in ``trajstore-<uid>`` of the
    system's temporary folder instead."""
    if decode_pool.compiler() is None:
        pytest.skip("needs a C++ compiler to build the pool")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TRAJSTORE_CACHE", str(tmp_path / "a-file" / "cache"))  # under a file: never a folder
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert decode_pool.build() is not None
    (built,) = (tmp_path / "tmp").glob("trajstore-*/decode_pool-*.so")
    assert built.parent.name == f"trajstore-{os.getuid()}"
