"""A step's values that go to the GPU from where Arrow decoded them (``decode_pool.py``: Arrow's large buffers
pinned), instead of being joined into the pinned staging arena first (``bridge.Arena``): one host copy a value fewer.

The decode's joins (``format/arrow.py`` ``Columns``) hand each chunk to ``Sends.send`` with its place in the arena;
taken, it is not copied there, and that place holds nothing until ``ready`` copies it. Whatever reads joined
values on the host asks for them first (``ready_for``: ``Columns.list_parts``, the late conversions filled on the
host, ``stage`` for every value it does not send from the arena as it is, all of a padded step, whose pad plan
reads values). ``stage`` hands the rest over (``keep_within``) and ``launch`` copies each after the arena's copy,
to its place in the device buffer; Arrow's memory is then kept (``hold``) until the copies' event has passed,
since its pool reuses what Arrow frees."""

from __future__ import annotations

import bisect
import threading
from collections import deque
from typing import Any

import numpy as np
import torch

__all__ = ["Sends", "hold", "SEND_BYTES", "PEEK_BYTES", "POISON"]

SEND_BYTES = 64 << 10  # a chunk's values smaller than this are copied into the arena: one copy fewer to launch
PEEK_BYTES = 4 << 10  # a host read of at most this many bytes copies them alone (``Sends.ready_for``)
POISON = False  # tests: the arena's place of each value taken is overwritten, so a host read of it shows

_held: deque = deque()  # (event, Arrow's values): kept alive until the copies reading them are done
_held_lock = threading.Lock()


class Sends:
    """The values of ``arena`` (a ``bridge.Arena``: ``buf``, ``used``) taken to copy to the device from Arrow's
    memory: ``items``, (offset in the arena, values); ``owns(address, nbytes)``: whether memory lies in the pinned
    pool (``decode_pool.Pool.owns``)."""

    def __init__(self, arena: Any, owns: Any) -> None:
        self.arena, self.owns = arena, owns
        self.items: list[tuple[int, np.ndarray]] = []

    def send(self, dst: np.ndarray, src: np.ndarray) -> bool:
        """Take ``src`` (a chunk's values in Arrow's memory) to be copied to the device at ``dst``'s place in the
        arena (True), or leave it to the caller to copy (False: ``dst`` not in the arena, a small chunk, a conversion
        between them, or ``src`` not in the pinned pool: a copy of it to the device would wait on the host)."""
        buf = self.arena.buf
        if buf is None or dst.nbytes < SEND_BYTES or dst.dtype != src.dtype or dst.shape != src.shape \
                or not (dst.flags.c_contiguous and src.flags.c_contiguous):
            return False
        off = dst.ctypes.data - buf.data_ptr()
        if off < 0 or off + dst.nbytes > self.arena.used or not self.owns(src.ctypes.data, src.nbytes):
            return False
        self.items.append((off, src))
        if POISON:
            dst.view(np.uint8)[...] = 0xA5
        return True

    def ready(self, lo: int = 0, hi: int | None = None, peek: bool = False) -> None:
        """Copy into the arena the values taken whose bytes meet ``[lo, hi)`` (offsets in it; all by default).
        ``peek``: those bytes alone, the values staying taken (the device's copy of them writes the same bytes)."""
        hi = self.arena.used if hi is None else hi
        keep, host = [], None
        for off, src in self.items:
            if off < hi and off + src.nbytes > lo:
                host = self.arena.buf.numpy() if host is None else host
                if peek:
                    a, b = max(lo, off), min(hi, off + src.nbytes)
                    host[a:b] = src.reshape(-1).view(np.uint8)[a - off:b - off]
                    keep.append((off, src))
                    continue
                host[off:off + src.nbytes] = src.reshape(-1).view(np.uint8)
            else:
                keep.append((off, src))
        self.items = keep

    def ready_for(self, a: Any, peek: bool = False) -> None:
        """``ready`` for the bytes of ``a`` (a numpy array or a CPU tensor) where they lie in the arena: those bytes
        alone where they are at most ``PEEK_BYTES`` or ``peek`` (the pad plan's probes of a field's values, which
        leave them to be sent), else the whole of each value they meet."""
        at = self._at(a)
        if at is not None and at[0] < self.arena.used and at[0] + at[1] > 0:
            self.ready(max(0, at[0]), at[0] + at[1], peek or at[1] <= PEEK_BYTES)

    def taken(self, a: Any) -> bool:
        """Whether any byte of ``a`` (a numpy array or a CPU tensor) lies in a value taken to send."""
        at = self._at(a)
        return at is not None and any(off < at[0] + at[1] and off + src.nbytes > at[0] for off, src in self.items)

    def _at(self, a: Any) -> tuple[int, int] | None:
        """(offset in the arena, bytes) of the memory ``a`` may reach, or None where nothing is taken (or ``a`` is
        not on the host)."""
        if not self.items or self.arena.buf is None:
            return None
        if isinstance(a, torch.Tensor):
            if a.device.type != "cpu":
                return None
            s = a.untyped_storage()  # the bytes it may reach, whatever its strides
            p, n = s.data_ptr(), s.nbytes()
        else:
            p, n = _span(a)
        return p - self.arena.buf.data_ptr(), n

    def keep_within(self, sent: list[tuple[int, int]]) -> list[tuple[int, np.ndarray]]:
        """The values taken that lie inside one of the ranges ``sent`` (offset, bytes) of the arena, which go to the
        device as they are, handed over; the others are copied into the arena (``ready``)."""
        spans = sorted(sent)
        starts = [o for o, _ in spans]
        keep, rest = [], []
        for off, src in self.items:
            i = bisect.bisect_right(starts, off) - 1
            inside = i >= 0 and off + src.nbytes <= spans[i][0] + spans[i][1]
            (keep if inside else rest).append((off, src))
        self.items = rest
        self.ready()
        return keep


def _span(a: np.ndarray) -> tuple[int, int]:
    """(first byte's address, bytes) of the memory numpy array ``a`` reaches through its strides."""
    if not a.size:
        return a.ctypes.data, 0
    lo = sum(min(0, (k - 1) * s) for k, s in zip(a.shape, a.strides))
    hi = sum(max(0, (k - 1) * s) for k, s in zip(a.shape, a.strides)) + a.itemsize
    return a.ctypes.data + lo, hi - lo


def hold(items: list, event: Any) -> None:
    """Keep ``items``' values (Arrow's memory, which its pool reuses once freed) until ``event`` has passed (None:
    the copies are done)."""
    with _held_lock:
        if event is not None:
            _held.append((event, items))
        while _held and _held[0][0].query():
            _held.popleft()
