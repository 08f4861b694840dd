"""Page-locked buffers as plain memory registered with the CUDA driver (``trajstore/device/pinned.py``): the exact
size pinned, the registration ended before the memory is freed and not while any view of it lives, a refusal
cleared and given up for torch's allocator. On the CPU through a stand-in for the CUDA runtime; the ``cuda`` tests
register for real."""

import gc
import mmap
import os
import sys

import pytest
import torch
from _dumps import in_forked_child

from trajstore.device import pinned


class FakeRuntime:
    """The three CUDA runtime calls ``pinned`` makes, recorded; ``refuse``: the error cudaHostRegister returns."""

    def __init__(self, refuse: int = 0):
        self.refuse, self.calls, self.live = refuse, [], {}

    def cudaHostRegister(self, address, size, flags):
        self.calls.append(("register", address, size, flags))
        if self.refuse:
            return self.refuse
        self.live[address] = size
        return 0

    def cudaHostUnregister(self, address):
        self.calls.append(("unregister", address))
        return 0 if self.live.pop(address, None) is not None else 713  # cudaErrorHostMemoryNotRegistered

    def cudaGetLastError(self):
        self.calls.append(("clear",))
        return 0


@pytest.fixture
def runtime(monkeypatch):
    gc.collect()  # no buffer of another test released into this one's count
    rt = FakeRuntime()
    monkeypatch.setattr(pinned, "_rt", [rt])
    monkeypatch.setattr(pinned, "_reg", {"live": 0, "why": None})
    return rt


def test_a_buffer_is_registered_exactly_and_released_after_its_last_view(runtime):
    t = pinned.pinned(3 * mmap.PAGESIZE + 5)
    assert t.dtype == torch.uint8 and t.numel() == 3 * mmap.PAGESIZE + 5
    (kind, address, size, flags), = runtime.calls
    assert kind == "register" and flags == 1  # portable: pinned for every device's context
    assert address == t.data_ptr() and address % mmap.PAGESIZE == 0 and size == 4 * mmap.PAGESIZE
    assert pinned.registered_bytes() == size and pinned.registration() == "on"
    t[:] = 7
    view = t[mmap.PAGESIZE:2 * mmap.PAGESIZE]
    del t
    gc.collect()
    assert runtime.live == {address: size} and len(runtime.calls) == 1  # a view still reaches it
    assert bool((view == 7).all())
    del view
    gc.collect()
    assert runtime.calls[1] == ("unregister", address) and not runtime.live and len(runtime.calls) == 2
    assert pinned.registered_bytes() == 0 and not _mapped(address)  # unmapped too


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def _in_child(address, t, size, rt, parent, queue):
    """In a forked child: whether the parent's buffer is mapped here, holding what the parent wrote; the child's
    write to it; then the release its finalizer runs when the child lets go of the buffer: no call to the CUDA
    runtime (the child registered nothing), its own view unmapped."""
    seen = _mapped(address) and int(t[0]) == 5
    t[1] = 6  # shared: the parent sees it, as it would see a child's write to torch's pinned memory
    calls = len(rt.calls)
    pinned._release(rt, address, size, parent)
    queue.put((seen, len(rt.calls) - calls, _mapped(address), pinned.registered_bytes()))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: /proc/self/maps, fork")
def test_a_forked_child_shares_the_pages_and_releases_only_its_view(runtime):
    """A private page shared after a fork would be copied for the first process to write it, and on older kernels the
    parent's copy would no longer be the page pinned for the GPU: the buffer is a shared mapping (as torch's pinned
    memory is), so parent and child keep the same pages; a child's release unmaps its view and calls no CUDA."""
    n = 5 * mmap.PAGESIZE
    t = pinned.pinned(n)
    address = t.data_ptr()
    t[0] = 5
    seen, calls, still, live = in_forked_child(_in_child, address, t, n, runtime, os.getpid(),
                                               what="checking its mappings")
    assert seen and calls == 0 and not still and live == n
    assert int(t[1]) == 6 and _mapped(address)  # the same pages; the parent's mapping untouched by the child
    t[2:] = 3
    assert len(runtime.calls) == 1
    del t
    gc.collect()
    assert runtime.calls[-1][0] == "unregister" and not _mapped(address) and pinned.registered_bytes() == 0


def test_a_refusal_is_cleared_and_gives_registering_up(runtime, monkeypatch):
    runtime.refuse = 2  # cudaErrorMemoryAllocation
    made = []

    def torch_pinned(n, dtype=None, pin_memory=False):
        made.append((n, pin_memory))
        return torch.zeros(n, dtype=dtype)

    monkeypatch.setattr(pinned.torch, "empty", torch_pinned)
    a = pinned.pinned(100)
    assert [c[0] for c in runtime.calls] == ["register", "clear"]  # the runtime's error does not reach torch
    assert "error 2" in pinned.registration() and pinned.registered_bytes() == 0
    b = pinned.pinned(200)  # no second try
    assert len(runtime.calls) == 2 and made == [(100, True), (200, True)] and a.numel() == 100 and b.numel() == 200


def test_a_pool_pins_what_it_counts_and_lets_evicted_buffers_go(runtime):
    pool = pinned.PinnedPool(max_cached_bytes=3 << 20, pin=True)
    a, b = pool.take(1 << 20), pool.take(1 << 20)  # 1 MiB + 25%, rounded to whole MiB: 2 MiB each
    assert pinned.registered_bytes() == a.numel() + b.numel() == 4 << 20  # what it counts is what is pinned
    pool.give(a)
    pool.give(b)  # over the bound: the oldest is dropped, and with it its registration
    del a, b
    gc.collect()
    assert pool.cached_bytes <= 3 << 20 and pinned.registered_bytes() == pool.cached_bytes == 2 << 20
    assert [c[0] for c in runtime.calls] == ["register", "register", "unregister"]


def test_registering_off_uses_torchs_allocator(runtime, monkeypatch):
    monkeypatch.setattr(pinned, "REGISTER", False)
    monkeypatch.setattr(pinned.torch, "empty", lambda n, dtype=None, pin_memory=False: torch.zeros(n, dtype=dtype))
    assert pinned.pinned(10).numel() == 10 and not runtime.calls and pinned.registration().startswith("off")


@pytest.mark.cuda
def test_registered_buffers_copy_asynchronously_both_ways_and_are_released():
    gc.collect()
    before = pinned.registered_bytes()
    pool = pinned.PinnedPool(max_cached_bytes=8 << 20)
    h = pool.take(3 << 20)
    assert pinned.registration() == "on" and h.is_pinned()
    assert pinned.registered_bytes() - before == h.numel()  # exactly what the pool counts
    src = torch.randint(0, 255, (h.numel(),), dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        s.wait_stream(torch.cuda.current_stream())
        h.copy_(src, non_blocking=True)
        back = torch.empty_like(src)
        back.copy_(h, non_blocking=True)
    s.synchronize()
    assert torch.equal(back, src) and torch.equal(h, src.cpu())
    pool.give(h)
    del h, pool
    gc.collect()
    assert pinned.registered_bytes() == before


@pytest.mark.cuda
def test_a_real_refusal_leaves_no_error_for_torchs_next_call(monkeypatch):
    """The driver refusing (here: the range is registered already) sets the runtime's last error; it is cleared,
    so the caller's next kernel launch, which checks that error, does not fail because of it."""
    rt = pinned.cudart()
    keep = torch.zeros(1 << 20, dtype=torch.uint8)
    address = keep.data_ptr() - keep.data_ptr() % mmap.PAGESIZE + mmap.PAGESIZE
    assert rt.cudaHostRegister(address, 1 << 16, 0) == 0

    class Twice:  # registers the same range again: a real refusal from the driver
        def __getattr__(self, name):
            return getattr(rt, name)

        def cudaHostRegister(self, a, size, flags):
            return rt.cudaHostRegister(address, 1 << 16, 0)

    monkeypatch.setattr(pinned, "_rt", [Twice()])
    monkeypatch.setattr(pinned, "_reg", {"live": 0, "why": None})
    try:
        t = pinned.pinned(1 << 20)
        assert "CUDA error" in pinned.registration() and t.is_pinned()  # torch's allocator instead
        x = torch.ones(1000, device="cuda") * 2  # a kernel launch checks the runtime's last error
        torch.cuda.synchronize()
        assert float(x.sum()) == 2000.0
    finally:
        rt.cudaHostUnregister(address)
