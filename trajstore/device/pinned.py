"""Reused page-locked host memory (``PinnedPool``), the per-device copy stream (``side_stream``),
and the writer's device -> host copies (``snapshot_cuda``).

Rules kept here and in ``bridge.py`` (the reader's host -> device copies), so callers never need
``record_stream``:

* Device memory handed to a caller is allocated on the *caller's* stream. Before a side stream
  writes into it, the side stream waits on the caller's stream (the block may have been freed by
  work still queued there), and the caller's stream waits on an event recorded after the copy.
* A pinned staging buffer goes back to its pool together with the event of the last copy that
  reads or writes it; whoever takes it next synchronizes that event first. Pools cache a bounded
  number of bytes, so pinned memory does not grow without bound.

A pool's page-locked buffers are plain host memory registered with the CUDA driver (``pinned``:
``cudaHostRegister`` of the CUDA runtime torch loaded), not torch's pinned allocator: that one pins the size
rounded up to a power of two and keeps what is freed in its own cache, so a pool bounded at N bytes could hold
up to twice that pinned, and more after evicting (and it pins a fresh buffer no faster: 1.0-1.35x the time on an
H200; benchmarks/RESULTS.md, issue 23, nineteenth and twentieth rounds). A registered buffer pins exactly its size
(a shared mapping of its own, which a forked child inherits as it inherits torch's pinned memory: the same pages) and
is unregistered and unmapped when its last view is gone. Where registering fails, buffers come from torch's
allocator as before (``registration()`` says why).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import threading
import weakref
from typing import Any

import numpy as np
import torch

__all__ = ["ALIGN", "aligned", "PinnedPool", "side_stream", "CudaSnapshot", "snapshot_cuda", "pinned", "cudart",
           "registration", "registered_bytes", "REGISTER"]

ALIGN = 256  # byte alignment of each tensor carved out of a staging buffer
REGISTER = True  # page-locked buffers are registered plain memory (module doc); False: torch's pinned allocator

_reg: dict[str, Any] = {"live": 0, "why": None}  # registered bytes alive; why registering was given up
_reg_lock = threading.Lock()
_rt: list = []


def cudart() -> ctypes.CDLL:
    """The CUDA runtime library torch loaded (the one whose context torch's tensors live in)."""
    if not _rt:
        torch.cuda.init()
        with open("/proc/self/maps") as f:
            loaded = sorted({ln.split()[-1] for ln in f if "libcudart.so" in ln})
        rt = ctypes.CDLL(loaded[0] if loaded else "libcudart.so")
        rt.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        rt.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        _rt.append(rt)
    return _rt[0]


def registration() -> str:
    """In words: whether page-locked buffers are registered plain memory, and why not where they are not."""
    if not REGISTER:
        return "off (torch's pinned allocator: REGISTER = False)"
    return "on" if _reg["why"] is None else f"given up: {_reg['why']} (torch's pinned allocator instead)"


def registered_bytes() -> int:
    """Bytes of host memory this process has registered with the CUDA driver and not yet released."""
    return _reg["live"]


def pinned(nbytes: int) -> torch.Tensor:
    """A ``uint8`` tensor of ``nbytes`` of page-locked host memory: registered plain memory (the module doc),
    else torch's pinned allocator."""
    t = _registered(nbytes) if REGISTER and _reg["why"] is None else None
    return t if t is not None else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


_MAP = 0x01 | 0x20 | 0x8000  # MAP_SHARED | MAP_ANONYMOUS | MAP_POPULATE (Linux)


@functools.cache
def _native() -> tuple[ctypes.CDLL, Any]:
    """libc (``mmap``, ``munmap``) and CPython's ``PyMemoryView_FromMemory``, their prototypes set once: the latter
    as a function pointer of its own, not by changing ``ctypes.pythonapi``'s shared one."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    proto = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
    return libc, proto(("PyMemoryView_FromMemory", ctypes.pythonapi))


def _mapping(size: int) -> int:
    """The address of ``size`` bytes of fresh shared anonymous memory, populated (the kernel provides its pages now,
    faster than faulting them in one by one). Shared, as torch's pinned memory is (a shared mapping of
    ``/dev/zero``): a forked child (a DataLoader worker) inherits the same pages, not copies of them; a private
    page shared after a fork would be copied for whichever process writes it first, and on older kernels the
    parent's copy would no longer be the page pinned for the GPU."""
    address = _native()[0].mmap(None, size, 0x1 | 0x2, _MAP, -1, 0)  # PROT_READ | PROT_WRITE
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of {size} bytes failed")
    return address


def _view(address: int, size: int) -> memoryview:
    """A writable memoryview of ``size`` bytes at ``address`` that owns nothing (the finalizer frees them)."""
    return _native()[1](address, size, 0x200)  # PyBUF_WRITE


def _registered(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of fresh host memory (``_mapping``) registered (portable: pinned for every device's context); its
    registration ends and the memory is unmapped when the array over it is freed (a finalizer on that array), so
    after its last view is gone. None where the driver refuses: registering is then given up for the process, its
    error cleared so no later CUDA call reports it."""
    size = max(mmap.PAGESIZE, aligned(nbytes, mmap.PAGESIZE))
    try:
        rt = cudart()
        address = _mapping(size)
        rc = rt.cudaHostRegister(address, size, 1)  # cudaHostRegisterPortable
        if rc != 0:
            rt.cudaGetLastError()
            _native()[0].munmap(address, size)
            raise OSError(f"cudaHostRegister returned CUDA error {rc}")
    except Exception as e:  # noqa: BLE001 - torch's pinned allocator instead, for the rest of the process
        with _reg_lock:
            _reg["why"] = _reg["why"] or f"{type(e).__name__}: {e}"
        return None
    with _reg_lock:
        _reg["live"] += size
    arr = np.frombuffer(_view(address, size), dtype=np.uint8)  # (a memoryview: no ctypes array type per size)
    fin = weakref.finalize(arr, _release, rt, address, size, os.getpid())
    fin.atexit = False  # the process's memory goes with it
    return torch.from_numpy(arr)[:nbytes]


def _release(rt: Any, address: int, size: int, pid: int) -> None:
    """Unregister and unmap a buffer of ``_registered``; in a forked child, which registered nothing (and has no CUDA
    context), unmap its view alone."""
    if os.getpid() == pid:
        if rt.cudaHostUnregister(address) != 0:
            rt.cudaGetLastError()  # (a context already torn down): cleared, not left for a later CUDA call
        with _reg_lock:
            _reg["live"] -= size
    _native()[0].munmap(address, size)


def aligned(n: int, a: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return (n + a - 1) // a * a


class PinnedPool:
    """Reused page-locked host buffers (``uint8`` tensors).

    ``take(n)`` returns a buffer of at least ``n`` bytes, reusing a cached one when one fits
    (after synchronizing the event it was given back with); ``give(buf, event)`` returns it.
    At most ``max_cached_bytes`` are kept cached; the rest is released.
    """

    def __init__(self, max_cached_bytes: int = 4 << 30, pin: bool | None = None):
        self.max_cached_bytes = max_cached_bytes
        self.pin = pin  # None: page-locked where CUDA is present (False: plain host memory, the writer's CPU copies)
        self._lock = threading.Lock()
        self._free: list[tuple[torch.Tensor, Any]] = []
        self.in_use = 0       # buffers handed out and not given back
        self.allocated = 0    # buffers ever allocated (a reuse does not count)

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b, _ in self._free)

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            best = None
            for i, (b, _) in enumerate(self._free):
                if nbytes <= b.numel() <= 2 * nbytes + (2 << 20) and (
                        best is None or b.numel() < self._free[best][0].numel()):
                    best = i
            if best is not None:
                buf, ev = self._free.pop(best)
            else:
                buf, ev = None, None
            self.in_use += 1
        if ev is not None:
            ev.synchronize()
        if buf is None:
            pin = torch.cuda.is_available() if self.pin is None else self.pin
            # 25% headroom: step sizes vary with the sampled lengths, so the next step can reuse it
            n = aligned(max(nbytes + nbytes // 4, 1), 1 << 20)
            buf = pinned(n) if pin else torch.empty(n, dtype=torch.uint8)
            with self._lock:
                self.allocated += 1
        return buf

    def give(self, buf: torch.Tensor, event: Any = None) -> None:
        with self._lock:
            self.in_use -= 1
            self._free.append((buf, event))
            total = sum(b.numel() for b, _ in self._free)
            while total > self.max_cached_bytes and self._free:
                b, ev = self._free.pop(0)
                if ev is not None:
                    ev.synchronize()
                total -= b.numel()


_side: dict[tuple[str, int], torch.cuda.Stream] = {}
_side_lock = threading.Lock()


def side_stream(device: torch.device, name: str = "copy") -> torch.cuda.Stream:
    """The module's copy stream for ``device`` (one per device, shared by all threads); another ``name``,
    another stream (``unpad.py``'s copier has its own)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    with _side_lock:
        s = _side.get((name, idx))
        if s is None:
            s = _side[(name, idx)] = torch.cuda.Stream(device=idx)
        return s


# ----------------------------------------------------------------------------- GPU -> host (writer)
class CudaSnapshot:
    """Pinned host copies of CUDA tensors, valid once ``wait()`` returns."""

    def __init__(self, buf: torch.Tensor, pool: PinnedPool, event, sources: list):
        self.buf, self.pool, self.event, self._sources = buf, pool, event, sources

    def wait(self) -> None:
        self.event.synchronize()
        self._sources = []  # the device tensors may be freed now

    def release(self) -> None:
        if self.buf is not None:
            self.pool.give(self.buf, None)
            self.buf = None


def snapshot_cuda(tensors: list[torch.Tensor], pool: PinnedPool) -> tuple[list[torch.Tensor], list[CudaSnapshot]]:
    """Start copying CUDA ``tensors`` into pinned host memory; returns the host tensors (valid
    after each snapshot's ``wait()``) and the snapshots (one per device).

    The copies run on a side stream that first waits on the caller's current stream, so they see
    every write queued before ``append``. The caller's stream then waits on the copies' event,
    so a later in-place update or a reuse of freed memory on that stream cannot race them; the
    calling thread itself never blocks.
    """
    hosts: list[torch.Tensor | None] = [None] * len(tensors)
    snaps = []
    by_dev: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dev.setdefault(t.device, []).append(i)
    for dev, idx in by_dev.items():
        total = sum(aligned(tensors[i].numel() * tensors[i].element_size()) for i in idx)
        buf = pool.take(total)
        cur = torch.cuda.current_stream(dev)
        side = side_stream(dev)
        side.wait_stream(cur)
        off = 0
        with torch.cuda.stream(side):
            for i in idx:
                t = tensors[i]
                n = t.numel() * t.element_size()
                dst = buf[off:off + n].view(t.dtype).view(t.shape)
                dst.copy_(t.detach(), non_blocking=True)
                hosts[i] = dst
                off += aligned(n)
            ev = torch.cuda.Event()
            ev.record(side)
        cur.wait_event(ev)
        snaps.append(CudaSnapshot(buf, pool, ev, [tensors[i] for i in idx]))
    return hosts, snaps  # type: ignore[return-value]
