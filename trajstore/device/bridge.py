"""Host -> GPU data movement for the reader: pinned staging arenas a step is decoded into, one
side-stream copy of a staged batch ordered by events, its padded fields built on the device.

``to_device`` (one batch, for ``Reader.read``) and ``stage``/``launch`` (the two halves of a copy,
which the reader's prefetching replay in ``trajstore/read/prefetch.py`` overlaps with the caller's
work) are the entry points; they keep the rules of ``pinned.py`` (device memory allocated on the
caller's stream, staging buffers given back with the event of their last copy). The front door
``trajstore.torch_bridge`` names these with the pinned pools and the writer's ``snapshot_cuda``
(``pinned.py``) and the tree walker (``tree.py``).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from . import decode_pool, sends as direct_sends
from . import pad as device_pad
from . import plan as pad_plan
from ..errors import ConfigError
from ..format.codec.decoder import fill
from ..format.codec.late import Late
from .pinned import PinnedPool, aligned, side_stream
from .tree import leaves as _leaves, map_tensors
from ..format.batch import containers

__all__ = ["Arena", "Staged", "host_arena", "stage", "launch", "to_device", "as_device", "on_device"]

_read_pool = PinnedPool()  # the reader's staging memory


class Staged:
    """A decoded batch whose torch tensors live in one pinned staging buffer (its padded fields to
    build on the device, ``plan``: ``meta`` tensors in ``obj``)."""

    def __init__(self, obj: Any, buf: torch.Tensor | None, total: int, pool: PinnedPool,
                 offsets: list[int] | None = None, plan: device_pad.Plan | None = None,
                 built: list[int] | None = None, late: list[Late | None] | None = None,
                 sends: list[tuple[int, np.ndarray]] | None = None):
        self.obj, self.buf, self.total, self.pool = obj, buf, total, pool
        self.offsets = offsets or []  # byte offset of each staged tensor, in map_tensors order
        self.late = late or [None] * len(self.offsets)  # per staged tensor: its values as stored, or None
        self.plan, self.built = plan, built or []  # the pad of each meta tensor, in map_tensors order
        self.sends = sends or []  # (offset in buf, Arrow's values): copied to the device from where they are

    def release(self, event=None) -> None:
        if self.sends:
            direct_sends.hold(self.sends, event)
            self.sends = []
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
    fill jobs collect in ``jobs``, handed to ``format.decoder.decode``; ``stage`` plans them), and
    packed int64-as-int32 and bool token fields for it to convert (their ``Late`` records collect in
    ``late``: ``format/codec/late.py``; ``stage`` stages their values as stored).
    Each array carved out is followed by ``pad_plan.SPARE`` unused bytes: room for the pad row
    of a padded field's table, next to its values (``plan.plan``).

    ``direct``: the pinned pool Arrow decodes the step into (``decode_pool.pinned``), or None; with it, ``sends``
    (``sends.py``) takes the chunks the joins would copy into the arena, for ``launch`` to copy to the device from
    Arrow's memory."""

    def __init__(self, pool: PinnedPool = _read_pool, defer: bool = False, direct: Any = None):
        self.pool, self.buf, self.used = pool, None, 0
        self.jobs: list | None = [] if defer else None
        self.late: list[Late] | None = [] if defer else None
        self.arrow_pool = None if direct is None else direct.pool  # the pyarrow.MemoryPool Arrow decodes into
        self.sends = direct_sends.Sends(self, direct.owns) if direct is not None else None

    def reserve(self, nbytes: int) -> None:
        if self.buf is None and nbytes > 0:
            self.buf = self.pool.take(nbytes)
            self._np = self.buf.numpy()

    def alloc(self, n: int, dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = n * dtype.itemsize
        if self.buf is None or self.used + nbytes + pad_plan.SPARE > self.buf.numel():
            return np.empty(n, dtype)
        out = self._np[self.used:self.used + nbytes].view(dtype)
        self.used = aligned(self.used + nbytes + pad_plan.SPARE)
        return out

    def holds(self, t: torch.Tensor) -> bool:
        if self.buf is None or t.device.type != "cpu" or not t.is_contiguous():
            return False
        base, p = self.buf.data_ptr(), t.data_ptr()
        return base <= p and p + t.numel() * t.element_size() <= base + self.used

    def fill(self) -> None:  # the deferred fields, on the CPU (the batch stays on the host)
        if self.sends is not None:
            self.sends.ready()
        fill(self.jobs or [])
        self.jobs = [] if self.jobs is not None else None
        for rec in self.late or []:
            rec.fill()
        self.late = [] if self.late is not None else None

    def release(self) -> None:
        if self.sends is not None:
            self.sends.items = []
        if self.buf is not None:
            self.pool.give(self.buf, None)
            self.buf = None
        if self.jobs is not None:
            self.jobs = []
        if self.late is not None:
            self.late = []


def host_arena(device: Any) -> Arena | None:
    """An :class:`Arena` to decode into when ``device`` is a CUDA device (padded fields: built there; Arrow decoding
    into pinned memory where ``decode_pool`` has it)."""
    d = as_device(device)
    return Arena(defer=True, direct=decode_pool.pinned()) if d is not None and d.type == "cuda" else None


def stage(obj: Any, pool: PinnedPool = _read_pool, arena: Arena | None = None) -> Staged:
    """Gather every torch tensor of ``obj`` into one pinned buffer: tensors decoded into ``arena``
    stay where they are, the others are copied after them (CPU memcpy, off the GPU). Padded fields
    the arena deferred are planned for the device instead (``plan.plan``: their values used
    where the decode joined them in the arena, the rest of their tables in a second pinned buffer),
    a ``meta`` tensor in their place. Values the arena took to send from Arrow's memory (``sends.py``) stay
    there only where they lie in a tensor sent from the arena as it is; all others are copied into it first."""
    leaves = _leaves(obj)
    direct = None if arena is None or arena.sends is None or not arena.sends.items else arena.sends
    index: dict[int, int] = {}
    ks: list[int | None] = []
    plan = None
    home = 0  # bytes of the arena the plan's tables reach into (staged with the batch)
    if arena is not None and arena.jobs:
        a = arena

        def take(n: int) -> torch.Tensor:  # the plan's tables: after the values in the arena where they fit
            if a.buf is not None and a.used + n + pad_plan.SPARE <= a.buf.numel():
                return torch.from_numpy(a.alloc(n, np.uint8))
            return pool.take(n)

        ks = [pad_plan.key(t) for t in leaves]
        index, plan = pad_plan.plan(arena.jobs, leaves, take, None if arena.buf is None else (arena.buf, arena.used), ks,
                                    None if direct is None else direct.ready_for,
                                    None if direct is None else direct.taken)
        arena.jobs = []
        if plan.buf is not None and arena.holds(plan.buf):  # one buffer, one copy to the device
            plan.inside = plan.buf.data_ptr() - arena.buf.data_ptr()  # type: ignore[union-attr]
        home = max(plan.home, plan.inside + plan.total)
    which = [index.get(k, -1) for k in ks] if index else [-1] * len(leaves)  # pad index, or -1
    views = [t for t, b in zip(leaves, which) if b < 0]
    late = _late(views, arena)
    src = [t if r is None else torch.from_numpy(r.stored) for t, r in zip(views, late)]  # what is sent
    size = [t.numel() * t.element_size() for t in src]
    held = [arena is not None and arena.holds(t) for t in src]
    old = None  # an arena given back once its tensors are copied out of it
    fits = arena is not None and arena.buf is not None and \
        arena.used + sum(aligned(n) for n, h in zip(size, held) if not h) <= arena.buf.numel()
    sends: list[tuple[int, np.ndarray]] = []
    if direct is not None:
        if fits and (views or home):  # the arena is staged as it is: what goes from it as it is may go from Arrow's
            base = arena.buf.data_ptr()  # type: ignore[union-attr]
            spans = [(x.data_ptr() - base, n) for x, n, h in zip(src, size, held) if h]
            sends = direct.keep_within(spans + ([] if plan is None else plan.sent))
        else:
            direct.ready()
    if not views and not home:
        if arena is not None:
            arena.release()
        if plan is None:
            return Staged(obj, None, 0, pool)
        buf, end = None, 0
    elif fits:
        buf, end = arena.buf, arena.used
        arena.buf = None  # the Staged batch owns it now
    else:  # a new buffer: the arena's bytes the plan uses first, at the same offsets, then the tensors
        buf, end = pool.take(aligned(home) + sum(aligned(n) for n in size)), aligned(home)
        if home:
            buf[:home].copy_(arena.buf[:home])  # type: ignore[union-attr]
        if arena is not None:
            old, arena.buf = arena.buf, None
        held = [False] * len(views)
    offsets: list[int] = []
    built: list[int] = []
    it, vit = iter(which), iter(zip(size, held, src, late))

    def put(t: torch.Tensor) -> torch.Tensor:
        nonlocal end
        b = next(it)
        if b >= 0:
            built.append(b)
            return torch.empty(t.shape, dtype=t.dtype, device="meta")
        n, h, x, r = next(vit)  # x: the values sent, as stored where r (their Late record) is not None
        if h:
            offsets.append(x.data_ptr() - buf.data_ptr())
            return t
        dst = buf[end:end + n].view(x.dtype).view(x.shape)
        dst.copy_(x)
        offsets.append(end)
        end = aligned(end + n)
        return dst if r is None else t  # (a placeholder: its shape and dtype)

    out = map_tensors(obj, put)
    if old is not None:
        pool.give(old, None)
    total = max([o + n for o, n in zip(offsets, size)] + [home])
    return Staged(out, buf, total, pool, offsets, plan, built, late, sends)


def _late(views: list[torch.Tensor], arena: Arena | None) -> list[Late | None]:
    """The ``Late`` record of each tensor to stage that is one of ``arena``'s placeholders (values joined
    as stored, converted on the device: ``format/codec/late.py``), else None; a placeholder not among
    them (a numpy field, say) is filled on the host here, before anything is copied."""
    if arena is None or not arena.late:
        return [None] * len(views)
    recs = {r.out.ctypes.data: r for r in arena.late}
    arena.late = []
    out: list[Late | None] = []
    for t in views:
        k = pad_plan.key(t)
        r = recs.get(k) if k is not None else None
        out.append(r if r is not None and t.numel() == len(r.out) else None)
    sent = {id(r) for r in out if r is not None}
    for r in recs.values():
        if id(r) not in sent:
            if arena.sends is not None:
                arena.sends.ready_for(r.stored)
            r.fill()
    return out


def _convert(r: Late, src: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (on the device) from the values ``r`` stands for, ``src`` their stored bytes there: one
    kernel for ids, two for a bitmap (``pad.unpack``: its bits masked, then compared). Launched on the
    consumer's thread (``launch``), so kept to as few torch calls as it takes."""
    n = out.numel()
    if r.kind == "int64":
        out.view(-1).copy_(src[:4 * n].view(torch.int32))
        return
    device_pad.unpack(src, r.shift, n, out=out.view(-1))


def launch(staged: Staged, device: torch.device, consumer: torch.cuda.Stream | None) -> tuple[Any, Any]:
    """Start copying a staged batch to ``device``: one H2D copy on the side stream into memory
    allocated on ``consumer``, and its padded fields built there (``pad.run``). Returns
    (device batch, event); ``consumer`` must wait on the event before it uses (or frees) the batch.
    The staging buffers go back to their pool with the event. On the CPU (tests): done at once."""
    p = staged.plan
    if staged.buf is None and p is None:
        return staged.obj, None
    side = side_stream(device) if device.type == "cuda" else None  # torch.cuda.stream(None): no-op
    with torch.cuda.stream(consumer):
        gbuf = None if staged.buf is None else torch.empty(staged.total, dtype=torch.uint8, device=device)
        outs, flat = ([], []) if p is None else device_pad.alloc(p, device)
        conv = [None if r is None else torch.empty(len(r.out), dtype=torch.int64 if r.kind == "int64" else torch.bool,
                                                   device=device) for r in staged.late]  # placeholders' values, converted there
    if side is not None:
        side.wait_stream(consumer)
    with torch.cuda.stream(side):
        if gbuf is not None:
            gbuf.copy_(staged.buf[:staged.total], non_blocking=True)
            if staged.sends:  # after it: their place in the arena holds nothing
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # Arrow's memory is read-only: only read here
                    for off, src in staged.sends:
                        gbuf[off:off + src.nbytes].copy_(torch.from_numpy(src.reshape(-1).view(np.uint8)),
                                                         non_blocking=True)
            for r, o, off in zip(staged.late, conv, staged.offsets):
                if r is not None:
                    _convert(r, gbuf[off:], o)
        if p is not None:
            device_pad.run(p, outs, flat, gbuf)
        ev = None if side is None else torch.cuda.Event()
        if ev is not None:
            ev.record(side)
    offsets, built, converted = iter(staged.offsets), iter(staged.built), iter(conv)

    def view(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:
            return outs[next(built)]
        off, c = next(offsets), next(converted)
        if c is not None:
            return c.view(t.shape)
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
