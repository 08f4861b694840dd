"""Reader.read(device=...) / Reader.iter(...): prefetch order, early break, CUDA == CPU bit for bit."""

import tempfile
import threading

import numpy as np
import pytest
import torch
from _dumps import many_row_groups, read_as
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore.device import bridge as torch_bridge
from trajstore.format.file import parquet
from trajstore.testing import assert_batch_equal, batches, packed_batches, padded_batches


def write_steps(d, n=6, seed=0):
    out = {}
    with trajstore.Writer(d) as w:
        for s in range(n):
            g = torch.Generator().manual_seed(seed + s)
            B, T = 4, 9
            m = torch.arange(T)[None, :] < torch.randint(1, T + 1, (B,), generator=g)[:, None]
            b = {"input_ids": torch.randint(0, 152_000, (B, T), generator=g).masked_fill(~m, 0),
                 "attention_mask": m,
                 "logprobs": torch.randn(B, T, generator=g).masked_fill(~m, 0.0),
                 "rewards": torch.randn(B, generator=g), "uids": [f"u{s}-{i}" for i in range(B)],
                 "scores": np.arange(B, dtype=np.float32) + s}
            w.append(10 * s, b)
            out[10 * s] = b
    return out


def read_threads():
    return [t for t in threading.enumerate() if t.name.startswith("trajstore-read")]


def in_threads(fn, n):
    """Run ``fn`` on ``n`` threads at once; fail with every error any of them raised."""
    errors = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("prefetch", [0, 1, 2, 5])
def test_iter_yields_steps_in_order_with_prefetch(tmp_path, prefetch):
    want = write_steps(tmp_path)
    r = trajstore.Reader(tmp_path)
    got = list(r.iter(prefetch=prefetch))
    assert [s for s, _ in got] == sorted(want)
    for s, b in got:
        assert_batch_equal(want[s], b)
    order = [40, 0, 20]
    assert [s for s, _ in r.iter(steps=order, prefetch=prefetch)] == order


def test_iter_columns_and_layout_match_read(tmp_path):
    write_steps(tmp_path, n=3)
    r = trajstore.Reader(tmp_path)
    for s, b in r.iter(columns=["input_ids", "rewards"], layout="packed"):
        assert_batch_equal(r.read(s, columns=["input_ids", "rewards"], layout="packed"), b)


def test_early_break_frees_threads(tmp_path):
    write_steps(tmp_path)
    r = trajstore.Reader(tmp_path)
    before = len(read_threads())
    for s, _ in r.iter(prefetch=3):
        assert len(read_threads()) > before
        break
    assert len(read_threads()) == before


def test_errors_propagate_and_free_threads(tmp_path):
    write_steps(tmp_path, n=3)
    r = trajstore.Reader(tmp_path)
    with pytest.raises(KeyError, match="step 5 is not in dump"):
        for _ in r.iter(steps=[0, 5, 10]):
            pass
    assert read_threads() == []
    with pytest.raises(trajstore.ConfigError, match="prefetch"):
        next(r.iter(prefetch=-1))


def test_read_on_cpu_device_is_the_plain_read(tmp_path):
    want = write_steps(tmp_path, n=1)
    r = trajstore.Reader(tmp_path)
    assert_batch_equal(want[0], r.read(0, device="cpu"))
    with pytest.raises(trajstore.ConfigError, match="device"):
        r.read(0, device="nonsense")


def test_concurrent_iteration_from_several_threads(tmp_path):
    want = write_steps(tmp_path)
    r = trajstore.Reader(tmp_path)

    def run():
        for _ in range(2):
            for s, b in r.iter(prefetch=2):
                assert_batch_equal(want[s], b)

    in_threads(run, 4)


def test_pinned_pool_reuses_and_bounds_cache():
    pool = torch_bridge.PinnedPool(max_cached_bytes=3 << 20)
    a = pool.take(1000)
    pool.give(a)
    b = pool.take(900)
    assert b.data_ptr() == a.data_ptr() and pool.allocated == 1
    c = pool.take(2 << 20)
    pool.give(b)
    pool.give(c)
    assert pool.in_use == 0 and pool.cached_bytes <= 3 << 20


def test_stage_packs_every_tensor_into_one_buffer():
    obj = {"a": torch.arange(5), "b": [torch.ones(2, 3, dtype=torch.bfloat16), None],
           "c": (torch.tensor(True),), "n": np.arange(3), "z": torch.zeros(0, 4)}
    pool = torch_bridge.PinnedPool()
    st_ = torch_bridge.stage(obj, pool)
    assert_batch_equal(obj, st_.obj)
    base = st_.buf.data_ptr()
    for t in torch_bridge._leaves(st_.obj):
        assert t.numel() == 0 or base <= t.data_ptr() < base + st_.buf.numel()
    assert st_.offsets == sorted(st_.offsets) and len(st_.offsets) == 4
    st_.release()
    assert pool.in_use == 0


@settings(max_examples=40, deadline=None)
@given(st.one_of(batches(), packed_batches(), padded_batches()), st.sampled_from([None, "packed"]),
       st.booleans())
def test_decode_into_arena_equals_plain_read_and_stages_in_place(batch, layout, many_groups):
    """The GPU path decodes into pinned staging (an Arena); staging then copies only what is not
    already there. Runs on the CPU too (the pool hands out unpinned memory without CUDA)."""
    mp = pytest.MonkeyPatch()
    if many_groups:  # every step split into row groups: the joins land in the arena
        many_row_groups(mp)
    try:
        with tempfile.TemporaryDirectory() as d:
            step = read_as(d, batch, layout)
            if step is None:
                return  # this batch has no layout to convert
            r, want = step
            pool = torch_bridge.PinnedPool()
            arena = torch_bridge.Arena(pool)
            got = r._read(0, None, layout, arena)
            assert_batch_equal(want, got)
            held = [arena.holds(t) for t in torch_bridge._leaves(got)]
            before = [t.data_ptr() for t in torch_bridge._leaves(got)]
            buf = arena.buf
            staged = torch_bridge.stage(got, pool, arena)
            assert_batch_equal(want, staged.obj)
            leaves = torch_bridge._leaves(staged.obj)
            if staged.buf is None:  # nothing to stage: the arena went back to the pool
                assert not leaves and arena.buf is None and pool.in_use == 0
                return
            base = staged.buf.data_ptr()
            for t, p, h in zip(leaves, before, held):
                if h and any(held):
                    assert t.data_ptr() == p  # decoded in place: not copied again
                if t.numel():
                    assert base <= t.data_ptr() < base + staged.buf.numel()
            if any(held):  # the arena's buffer became the staging buffer: no second buffer
                assert staged.buf is buf and arena.buf is None and pool.allocated == 1
            staged.release()
            assert pool.in_use == 0
    finally:
        mp.undo()


def test_big_packed_step_is_joined_into_the_arena(tmp_path, monkeypatch):
    monkeypatch.setattr(parquet, "ROW_GROUP_BYTES", 1 << 10)
    monkeypatch.setattr(parquet, "PARALLEL_READ_BYTES", 0)
    write_steps(tmp_path, n=1)
    g = torch.Generator().manual_seed(0)
    b = {"input_ids": torch.randint(0, 9, (64, 500), generator=g), "attention_mask": torch.ones(64, 500, dtype=torch.bool),
         "logprobs": torch.randn(64, 500, generator=g)}
    with trajstore.Writer(tmp_path, overwrite=True) as w:
        w.append(0, b)
    r = trajstore.Reader(tmp_path)
    arena = torch_bridge.Arena(torch_bridge.PinnedPool())
    got = r._read(0, None, "packed", arena)
    assert arena.holds(got["input_ids"]) and arena.holds(got["logprobs"])
    assert_batch_equal(r.read(0, layout="packed"), got)
    arena.release()


def test_failed_decode_into_the_arena_returns_its_buffer(tmp_path, monkeypatch):
    """A step that fails to decode on the way to the GPU gives its pinned staging back."""
    write_steps(tmp_path, n=1)
    pool = torch_bridge.PinnedPool()
    monkeypatch.setattr(torch_bridge, "host_arena", lambda device: torch_bridge.Arena(pool))

    def broken(*a, **k):
        raise trajstore.errors.FormatError("step.parquet: damaged")

    monkeypatch.setattr(trajstore.schema, "decode", broken)
    with pytest.raises(trajstore.errors.FormatError, match="damaged"):
        trajstore.Reader(tmp_path).read(0, layout="packed", device="cuda")
    assert pool.in_use == 0 and pool.allocated == 1


# ----------------------------------------------------------------------------- CUDA
def _cuda_equal(cpu, gpu):
    leaves = torch_bridge._leaves(gpu)
    assert all(t.is_cuda for t in leaves)
    torch.cuda.synchronize()
    assert_batch_equal(cpu, torch_bridge.map_tensors(gpu, lambda t: t.cpu()))


@pytest.mark.cuda
@settings(max_examples=30)
@given(st.one_of(batches(), padded_batches(), packed_batches()), st.sampled_from([None, "padded", "packed"]))
def test_cuda_read_equals_cpu_read_bit_for_bit(batch, layout):
    with tempfile.TemporaryDirectory() as d:
        with trajstore.Writer(d) as w:
            w.append(0, batch)
        r = trajstore.Reader(d)
        try:
            cpu = r.read(0, layout=layout)
        except trajstore.ConfigError:
            return  # layout does not apply to this batch form
        _cuda_equal(cpu, r.read(0, layout=layout, device="cuda"))


@pytest.mark.cuda
def test_cuda_iter_equals_cpu_on_a_side_stream_consumer(tmp_path):
    write_steps(tmp_path, n=8)
    r = trajstore.Reader(tmp_path)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # the consumer's stream is not the default one
        got = [(k, b) for k, b in r.iter(device="cuda", prefetch=2)]
        sums = [b["input_ids"].sum() for _, b in got]
    s.synchronize()
    for (k, b), x in zip(got, sums):
        _cuda_equal(r.read(k), b)
        assert int(x) == int(r.read(k)["input_ids"].sum())


@pytest.mark.cuda
@pytest.mark.parametrize("ahead", [True, False])
def test_cuda_next_decode_starts_after_the_launch_only_where_decodes_are_ahead(monkeypatch, ahead):
    """``read/prefetch.py`` ``WHEN_AHEAD``: where every decode in flight is done when the consumer takes a step, the
    next decode is submitted after that step's copy is launched (its start does not slow the staging), and the steps
    decoded after that are staged on their prefetch threads; where the step taken is still decoding, the next
    decode is submitted before, and every step is staged on the consumer's thread. The batches are the steps', in
    order, either way."""
    from trajstore.read import prefetch

    events, futures, staged_on = [], [], {}
    real_launch, real_stage = prefetch.launch, prefetch.stage

    def stage(obj, **kw):
        staged_on[int(obj["x"][0])] = threading.current_thread().name.startswith("trajstore-read")
        return real_stage(obj, **kw)

    def launch(staged, *a):
        events.append(("launch", int(staged.obj["x"][0])))
        return real_launch(staged, *a)

    class Pool(prefetch.ThreadPoolExecutor):
        def submit(self, fn, step):
            events.append(("submit", step))
            futures.append(super().submit(fn, step))
            return futures[-1]

    def read(step, arena):
        if not ahead:
            threading.Event().wait(0.05)  # still decoding when the consumer takes it
        return {"x": torch.full((4,), step)}

    monkeypatch.setattr(prefetch, "launch", launch)
    monkeypatch.setattr(prefetch, "stage", stage)
    monkeypatch.setattr(prefetch, "ThreadPoolExecutor", Pool)
    it = prefetch.iterate(read, list(range(6)), device="cuda", prefetch=2)
    got = []
    for _ in range(6):
        while ahead and not all(f.done() for f in futures):
            threading.Event().wait(0.001)  # the consumer computes until every decode in flight is done
        got.append(next(it))
    assert [s for s, _ in got] == list(range(6)) and [int(b["x"][0]) for _, b in got] == list(range(6))
    for k in range(1, 4):  # (step 0: nothing was decoded before the first next(), so never ahead)
        first = min(events.index(("launch", k)), events.index(("submit", k + 2)))
        assert events[first] == (("launch", k) if ahead else ("submit", k + 2)), events
    it.close()
    assert torch_bridge._read_pool.in_use == 0 and read_threads() == []
    # ahead: steps 0 and 1 were decoded before the consumer first took a step; step 2 before or after it found
    # the decodes ahead (taking step 0 or 1, as the first decodes' speed goes); the later ones after
    assert [staged_on[k] for k in (0, 1, 3, 4, 5)] == [False, False] + [ahead] * 3 and staged_on[2] <= ahead


@pytest.mark.cuda
def test_cuda_early_break_returns_staging_memory(tmp_path):
    write_steps(tmp_path, n=8)
    r = trajstore.Reader(tmp_path)
    for _ in r.iter(device="cuda", prefetch=3):
        break
    assert torch_bridge._read_pool.in_use == 0 and read_threads() == []
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_cuda_concurrent_readers(tmp_path):
    write_steps(tmp_path)
    r = trajstore.Reader(tmp_path)

    def run():
        with torch.cuda.stream(torch.cuda.Stream()):
            for k, b in r.iter(device="cuda", prefetch=2):
                _cuda_equal(r.read(k), b)

    in_threads(run, 3)


@pytest.mark.cuda
def test_writer_snapshots_cuda_tensors_modified_in_place_after_append(tmp_path):
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T = 64, 4096
    m = torch.ones(B, T, dtype=torch.bool, device="cuda")
    b = {"input_ids": torch.randint(0, 152_000, (B, T), device="cuda", generator=g), "attention_mask": m,
         "logprobs": torch.randn(B, T, device="cuda", generator=g).t().contiguous().t(),  # non-contiguous
         "rewards": torch.randn(B, device="cuda", generator=g)}
    want = torch_bridge.map_tensors(b, lambda t: t.cpu())
    with trajstore.Writer(tmp_path) as w:
        for step in range(3):
            w.append(step, b)
            # training goes on: in-place updates queued right after append on the same stream
            b["input_ids"].add_(1)
            b["logprobs"].mul_(2.0)
            b["rewards"].zero_()
    r = trajstore.Reader(tmp_path)
    assert_batch_equal(want, r[0])
    assert torch.equal(r[2]["input_ids"], want["input_ids"] + 2)
    assert not torch.equal(r[1]["input_ids"], want["input_ids"])


def _freed_without_gc(make):
    """``make()`` returns weak references to tensors a call held; with the cycle collector off, they
    must be dead once the call's results are dropped (no reference cycle keeps them)."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        refs = [weakref.ref(t) for t in make()]
        return [r() is None for r in refs]
    finally:
        gc.enable()


def test_map_tensors_and_staging_leave_no_reference_cycle(tmp_path):
    # a cycle would hold a whole step (and on CUDA its device batch) until the collector runs
    from trajstore.write import snapshot

    def mapped():
        t = torch.arange(10)
        out = torch_bridge.map_tensors({"a": t, "b": [t, (t, {"c": t})], "n": np.arange(3)}, lambda x: x + 1)
        assert out["b"][1][1]["c"].tolist() == list(range(1, 11))
        assert snapshot.nbytes_of({"a": t, "o": np.array([t, None], dtype=object)}) == 2 * 80 + 16
        seen = []
        torch_bridge.map_tensors({"a": t, "b": [t]}, lambda x: seen.append(x) or x)  # fn holds the tensors
        return [t, out["a"]]

    assert _freed_without_gc(mapped) == [True, True]
    write_steps(tmp_path)
    r = trajstore.Reader(tmp_path)

    def staged():
        arena = torch_bridge.Arena(defer=True)
        st = torch_bridge.stage(r._read(10, None, None, arena), arena=arena)
        held = torch_bridge._leaves(st.obj)
        st.release()
        return [t for t in held if not t.is_meta]

    assert all(_freed_without_gc(staged))


def test_a_read_and_its_staging_leave_no_garbage_for_the_cycle_collector(tmp_path):
    # what a replay step allocates is freed by reference counting alone (pyarrow's FileMetaData and
    # the ParquetSchema md.schema caches in it would hold each other: reader._read_columns avoids it)
    import gc

    write_steps(tmp_path)
    r = trajstore.Reader(tmp_path)
    r.read(10)  # imports and caches
    gc.collect()
    gc.disable()
    try:
        for layout in (None, "packed"):
            arena = torch_bridge.Arena(defer=True)
            st_ = torch_bridge.stage(r._read(10, None, layout, arena), arena=arena)
            st_.release()
            del st_
            assert gc.collect() == 0, layout
    finally:
        gc.enable()
