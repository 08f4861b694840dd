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
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["ALIGN", "aligned", "PinnedPool", "side_stream", "CudaSnapshot", "snapshot_cuda"]

ALIGN = 256  # byte alignment of each tensor carved out of a staging buffer


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
            buf = torch.empty(aligned(max(nbytes + nbytes // 4, 1), 1 << 20), dtype=torch.uint8, pin_memory=pin)
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
