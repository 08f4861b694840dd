"""Host <-> GPU data movement: reused pinned staging memory, side-stream copies ordered by events.

Rules kept everywhere in this module (so callers never need ``record_stream``):

* Device memory handed to a caller is allocated on the *caller's* stream. Before a side stream
  writes into it, the side stream waits on the caller's stream (the block may have been freed by
  work still queued there), and the caller's stream waits on an event recorded after the copy.
* A pinned staging buffer goes back to its pool together with the event of the last copy that
  reads or writes it; whoever takes it next synchronizes that event first. Pools cache a bounded
  number of bytes, so pinned memory does not grow without bound.

``snapshot_cuda`` (device -> pinned host, for the writer), ``to_device`` (one batch, for
``Reader.read``), and ``stage``/``launch`` (the two halves of a copy, which the reader's
prefetching replay in ``trajstore/read/prefetch.py`` overlaps with the caller's work) are the entry
points. ``map_tree`` is the one walk of a batch's dict/list/tuple structure.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from . import pad as device_pad
from ..errors import ConfigError
from ..format.batch import containers
from ..format.codec.decoder import fill

__all__ = ["PinnedPool", "Arena", "Staged", "snapshot_cuda", "host_arena", "stage", "launch", "to_device",
           "as_device", "on_device", "map_tree", "map_tensors"]

ALIGN = 256  # byte alignment of each tensor carved out of a staging buffer


def _round(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def map_tree(obj: Any, leaf: Callable[[Any, tuple | None], Any], path: tuple | None = None) -> Any:
    """Rebuild the dict/list/tuple structure of ``obj`` (one new container per container) with
    ``leaf(value, path)`` in place of every other value. ``path`` is the value's key/index path
    from ``obj`` when a starting path is given (``()``), else None (no tuples are built, and a
    tensor, the most common value, goes to ``leaf`` without a call of its own)."""
    if isinstance(obj, dict):
        if path is None:
            return {k: leaf(v, None) if isinstance(v, torch.Tensor) else map_tree(v, leaf) for k, v in obj.items()}
        return {k: map_tree(v, leaf, path + (k,)) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        if path is None:
            out = [leaf(v, None) if isinstance(v, torch.Tensor) else map_tree(v, leaf) for v in obj]
        else:
            out = [map_tree(v, leaf, path + (i,)) for i, v in enumerate(obj)]
        return out if isinstance(obj, list) else tuple(out)
    return leaf(obj, path)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Rebuild dict/list/tuple structure with ``fn`` applied to every torch tensor; a TensorDict or
    DataProto-like batch comes back as the same kind of container (``adapters``)."""
    return map_tree(obj, _TensorLeaf(fn))


class _TensorLeaf:
    """``map_tensors``' leaf: ``fn`` on a tensor, containers rebuilt around it. A class, not a
    closure that calls itself: such a closure is a reference cycle holding ``fn`` and all it holds
    (a step's tensors, its device batch) until Python's cycle collector runs, whose pauses then
    free whole steps with every thread stopped (``tests/test_torch_bridge.py``)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[torch.Tensor], Any]):
        self.fn = fn

    def __call__(self, x: Any, _path: tuple | None) -> Any:
        if isinstance(x, torch.Tensor):
            return self.fn(x)
        if x is None or isinstance(x, str | int | float | bool | np.ndarray | np.generic):
            return x
        plain, tag = containers.unwrap(x)
        if tag is not None:
            return containers.wrap(map_tree(plain, self), tag)
        if isinstance(x, Mapping):
            return {k: map_tree(v, self) for k, v in x.items()}
        return x


def _leaves(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    map_tensors(obj, lambda t: out.append(t) or t)
    return out


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
            buf = torch.empty(_round(max(nbytes + nbytes // 4, 1), 1 << 20), dtype=torch.uint8, pin_memory=pin)
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


_read_pool = PinnedPool()
_side: dict[int, torch.cuda.Stream] = {}
_side_lock = threading.Lock()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The module's copy stream for ``device`` (one per device, shared by all threads)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    with _side_lock:
        s = _side.get(idx)
        if s is None:
            s = _side[idx] = torch.cuda.Stream(device=idx)
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
        total = sum(_round(tensors[i].numel() * tensors[i].element_size()) for i in idx)
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
                off += _round(n)
            ev = torch.cuda.Event()
            ev.record(side)
        cur.wait_event(ev)
        snaps.append(CudaSnapshot(buf, pool, ev, [tensors[i] for i in idx]))
    return hosts, snaps  # type: ignore[return-value]


# ----------------------------------------------------------------------------- host -> GPU (reader)
class Staged:
    """A decoded batch whose torch tensors live in one pinned staging buffer (its padded fields to
    build on the device, ``plan``: ``meta`` tensors in ``obj``)."""

    def __init__(self, obj: Any, buf: torch.Tensor | None, total: int, pool: PinnedPool,
                 offsets: list[int] | None = None, plan: device_pad.Plan | None = None,
                 built: list[int] | None = None):
        self.obj, self.buf, self.total, self.pool = obj, buf, total, pool
        self.offsets = offsets or []  # byte offset of each staged tensor, in map_tensors order
        self.plan, self.built = plan, built or []  # the pad of each meta tensor, in map_tensors order

    def release(self, event=None) -> None:
        if self.buf is not None:
            self.pool.give(self.buf, event)
            self.buf = None
        if self.plan is not None and self.plan.buf is not None:
            if self.plan.inside < 0:  # else part of ``buf``
                self.pool.give(self.plan.buf, event)
            self.plan.buf = None


class Arena:
    """Pinned staging memory a step is decoded into: ``reserve(n)`` takes a buffer from the pool,
    ``alloc(n, dtype)`` carves numpy arrays out of it (``np.empty`` once it is full), so joining
    a column's row-group chunks is the only host copy on the way to the GPU (``stage`` finds the
    tensors already in place). ``defer``: padded fields are left for the device to build (their
    fill jobs collect in ``jobs``, handed to ``format.decoder.decode``; ``stage`` plans them).
    Each array carved out is followed by ``device_pad.SPARE`` unused bytes: room for the pad row
    of a padded field's table, next to its values (``device_pad.plan``)."""

    def __init__(self, pool: PinnedPool = _read_pool, defer: bool = False):
        self.pool, self.buf, self.used = pool, None, 0
        self.jobs: list | None = [] if defer else None

    def reserve(self, nbytes: int) -> None:
        if self.buf is None and nbytes > 0:
            self.buf = self.pool.take(nbytes)
            self._np = self.buf.numpy()

    def alloc(self, n: int, dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = n * dtype.itemsize
        if self.buf is None or self.used + nbytes + device_pad.SPARE > self.buf.numel():
            return np.empty(n, dtype)
        out = self._np[self.used:self.used + nbytes].view(dtype)
        self.used = _round(self.used + nbytes + device_pad.SPARE)
        return out

    def holds(self, t: torch.Tensor) -> bool:
        if self.buf is None or t.device.type != "cpu" or not t.is_contiguous():
            return False
        base, p = self.buf.data_ptr(), t.data_ptr()
        return base <= p and p + t.numel() * t.element_size() <= base + self.used

    def fill(self) -> None:  # the deferred padded fields, on the CPU (the batch stays on the host)
        fill(self.jobs or [])
        self.jobs = [] if self.jobs is not None else None

    def release(self) -> None:
        if self.buf is not None:
            self.pool.give(self.buf, None)
            self.buf = None
        if self.jobs is not None:
            self.jobs = []


def host_arena(device: Any) -> Arena | None:
    """An :class:`Arena` to decode into when ``device`` is a CUDA device (padded fields: built there)."""
    d = as_device(device)
    return Arena(defer=True) if d is not None and d.type == "cuda" else None


def stage(obj: Any, pool: PinnedPool = _read_pool, arena: Arena | None = None) -> Staged:
    """Gather every torch tensor of ``obj`` into one pinned buffer: tensors decoded into ``arena``
    stay where they are, the others are copied after them (CPU memcpy, off the GPU). Padded fields
    the arena deferred are planned for the device instead (``device_pad.plan``: their values used
    where the decode joined them in the arena, the rest of their tables in a second pinned buffer),
    a ``meta`` tensor in their place."""
    leaves = _leaves(obj)
    index: dict[int, int] = {}
    ks: list[int | None] = []
    plan = None
    home = 0  # bytes of the arena the plan's tables reach into (staged with the batch)
    if arena is not None and arena.jobs:
        a = arena

        def take(n: int) -> torch.Tensor:  # the plan's tables: after the values in the arena where they fit
            if a.buf is not None and a.used + n + device_pad.SPARE <= a.buf.numel():
                return torch.from_numpy(a.alloc(n, np.uint8))
            return pool.take(n)

        ks = [device_pad.key(t) for t in leaves]
        index, plan = device_pad.plan(arena.jobs, leaves, take, None if arena.buf is None else (arena.buf, arena.used), ks)
        arena.jobs = []
        if plan.buf is not None and arena.holds(plan.buf):  # one buffer, one copy to the device
            plan.inside = plan.buf.data_ptr() - arena.buf.data_ptr()  # type: ignore[union-attr]
        home = max(plan.home, plan.inside + plan.total)
    which = [index.get(k, -1) for k in ks] if index else [-1] * len(leaves)  # pad index, or -1
    views = [t for t, b in zip(leaves, which) if b < 0]
    size = [t.numel() * t.element_size() for t in views]
    held = [arena is not None and arena.holds(t) for t in views]
    old = None  # an arena given back once its tensors are copied out of it
    if not views and not home:
        if arena is not None:
            arena.release()
        if plan is None:
            return Staged(obj, None, 0, pool)
        buf, end = None, 0
    elif arena is not None and arena.buf is not None and \
            arena.used + sum(_round(n) for n, h in zip(size, held) if not h) <= arena.buf.numel():
        buf, end = arena.buf, arena.used
        arena.buf = None  # the Staged batch owns it now
    else:  # a new buffer: the arena's bytes the plan uses first, at the same offsets, then the tensors
        buf, end = pool.take(_round(home) + sum(_round(n) for n in size)), _round(home)
        if home:
            buf[:home].copy_(arena.buf[:home])  # type: ignore[union-attr]
        if arena is not None:
            old, arena.buf = arena.buf, None
        held = [False] * len(views)
    offsets: list[int] = []
    built: list[int] = []
    it, vit = iter(which), iter(zip(size, held))

    def put(t: torch.Tensor) -> torch.Tensor:
        nonlocal end
        b = next(it)
        if b >= 0:
            built.append(b)
            return torch.empty(t.shape, dtype=t.dtype, device="meta")
        n, h = next(vit)
        if h:
            offsets.append(t.data_ptr() - buf.data_ptr())
            return t
        dst = buf[end:end + n].view(t.dtype).view(t.shape)
        dst.copy_(t)
        offsets.append(end)
        end = _round(end + n)
        return dst

    out = map_tensors(obj, put)
    if old is not None:
        pool.give(old, None)
    total = max([o + n for o, n in zip(offsets, size)] + [home])
    return Staged(out, buf, total, pool, offsets, plan, built)


def launch(staged: Staged, device: torch.device, consumer: torch.cuda.Stream | None) -> tuple[Any, Any]:
    """Start copying a staged batch to ``device``: one H2D copy on the side stream into memory
    allocated on ``consumer``, and its padded fields built there (``device_pad.run``). Returns
    (device batch, event); ``consumer`` must wait on the event before it uses (or frees) the batch.
    The staging buffers go back to their pool with the event. On the CPU (tests): done at once."""
    p = staged.plan
    if staged.buf is None and p is None:
        return staged.obj, None
    side = side_stream(device) if device.type == "cuda" else None  # torch.cuda.stream(None): no-op
    with torch.cuda.stream(consumer):
        gbuf = None if staged.buf is None else torch.empty(staged.total, dtype=torch.uint8, device=device)
        outs, flat = ([], []) if p is None else device_pad.alloc(p, device)
    if side is not None:
        side.wait_stream(consumer)
    with torch.cuda.stream(side):
        if gbuf is not None:
            gbuf.copy_(staged.buf[:staged.total], non_blocking=True)
        if p is not None:
            device_pad.run(p, outs, flat, gbuf)
        ev = None if side is None else torch.cuda.Event()
        if ev is not None:
            ev.record(side)
    offsets, built = iter(staged.offsets), iter(staged.built)

    def view(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:
            return outs[next(built)]
        off = next(offsets)
        n = t.numel() * t.element_size()
        return gbuf[off:off + n].view(t.dtype).view(t.shape)  # type: ignore[index]

    out = map_tensors(staged.obj, view)
    staged.release(ev)
    return out, ev


def as_device(device: Any) -> torch.device | None:
    """``device`` as a ``torch.device`` (a CUDA one with its index), None for None; ConfigError if it is
    not one, or is CUDA where CUDA is not available."""
    if device is None:
        return None
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {device!r} is not a torch device ({e}); use e.g. 'cuda', 'cuda:1' or 'cpu'") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r}: CUDA is not available in this process; pass device=None")
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
    return d


def to_device(obj: Any, device: Any, arena: Arena | None = None) -> Any:
    """Move every torch tensor of a decoded batch to ``device`` (numpy arrays and Python values
    stay on the host). On CUDA the result is ordered on the caller's current stream; ``arena``
    is the pinned memory ``obj`` was decoded into, if any."""
    d = as_device(device)
    if d is None or d.type != "cuda":
        if arena is not None:
            arena.fill()
            arena.release()
        return obj if d is None or d.type == "cpu" else on_device(map_tensors(obj, lambda t: t.to(d)), d)
    cur = torch.cuda.current_stream(d)
    out, ev = launch(stage(obj, arena=arena), d, cur)
    if ev is not None:
        cur.wait_event(ev)
    return on_device(out, d)


def on_device(obj: Any, d: torch.device) -> Any:
    """A TensorDict (or a DataProto-like batch's) rebuilt from tensors moved to ``d`` reports
    ``d`` as its device, as ``TensorDict.to(d)`` would (its tensors are already there: no copy)."""
    if containers.is_tensordict(obj):
        return obj.to(d)
    if containers.is_dataproto(obj) and obj.batch is not None:
        obj.batch = obj.batch.to(d)
    return obj
