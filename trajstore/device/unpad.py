"""A padded CUDA batch leaves the GPU unpadded, the mirror of replay (``start``, ``Pending``).

At ``Writer.append`` of a dict batch whose token fields and masks are CUDA tensors, only the tokens
cross to pinned host memory, not the padding (often most of a right-padded long-tail batch). On the
calling thread ``append`` enqueues one device copy per field and mask on the module's side stream,
after the caller's stream (the rule of ``pinned.snapshot_cuda``); the caller's stream waits for those
copies only (on the GPU: the calling thread never blocks), then may reuse or change the fields.

Everything else runs on one copier thread, on a stream of its own (``_collect``), right away: per mask
group, the token mask orders the copies' fields, each written into a new device buffer as a
permutation of its positions, tokens first (row-major, what ``x[mask]`` selects), padded positions
after; device-side reductions find the group's token count, whether the mask is 0/1, and whether every
padded element holds the first one's bits. Then those few numbers and the ``[B, T]`` bool masks come to
the host, each field's tokens (and its padded values only where they are not one value) are copied
into a pooled pinned buffer, and the device buffers are freed. The encoder stores the result exactly as
it stores ``x[mask]`` of the whole tensor (``format/codec/unpadded.py``): the file is byte-identical.

Costs and limits: device memory of the fields' copies and, during the pass, their permuted buffers (about
twice the padded size of the selected fields, for milliseconds after ``append``); where the copies cannot
be allocated the fields take the whole-tensor path (``pinned.snapshot_cuda``), where the pass cannot, the
copies go to the host whole (``Pending.whole``): never an error. Top-level ``[B, W, ...]`` fields following
a mask group (format/batch/layout.py) only; a field whose token axis is last, an empty one, a mask or
field on another device, a batch of less than ``MIN_BYTES`` of such fields: the whole-tensor path.
"""

from __future__ import annotations

import contextlib
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import BatchError
from ..format import dtypes as dt
from ..format.batch.check import TOKENS
from ..format.batch.layout import structure
from ..format.batch.masks import token_mask
from ..format.codec.unpadded import Unpadded, Unpadding
from .pinned import PinnedPool, aligned, side_stream

__all__ = ["start", "Pending", "DEVICES", "MIN_BYTES"]

DEVICES = ("cuda",)  # device types whose batches are unpadded here (the CPU tests add "cpu": the same steps)
MIN_BYTES = 1 << 20  # a batch with fewer bytes of padded token fields is copied whole
_BITS = (1, 2, 4, 8)  # element sizes with a same-width integer view (dtypes.bits_view)


def _usable(x: Any) -> bool:
    return (isinstance(x, torch.Tensor) and x.device.type in DEVICES and x.layout == torch.strided
            and not x.is_quantized and not x.is_nested and not x.is_conj() and not x.is_neg()
            and x.ndim >= 2 and x.numel() > 0 and x.element_size() in _BITS and x.dtype in dt.TORCH_NAMES)


def _plan(plain: Mapping, masks: Mapping | None) -> tuple[dict[tuple[str, int, int], list[str]], list[str]] | None:
    """The fields to unpad, by the mask group ``(src, lo, W)`` they follow, and every mask field on their
    device (the encoder reads each one's token mask: a mask field may itself be unpadded by another
    group); None where there is nothing (or too few bytes) to unpad."""
    try:
        lay = structure(plain, masks, read=False)
    except BatchError:  # append's check raised it already; here only to be safe
        return None
    if lay.form not in ("padded", "masked"):
        return None
    out: dict[tuple[str, int, int], list[str]] = {}
    device, nbytes = None, 0
    for path, f in lay.follows.items():
        if f.role != TOKENS or f.last or len(path) != 1 or f.group is None:
            continue
        g = lay.groups[f.group]
        x, m = plain[path[0]], plain.get(g.src)
        if not (_usable(x) and _usable(m)) or x.device != m.device or (device is not None and x.device != device):
            continue
        if list(x.shape[:2]) != [lay.B, g.W] or int(m.shape[1]) < g.lo + g.W:
            continue
        device = x.device
        out.setdefault((g.src, g.lo, g.W), []).append(path[0])
        nbytes += x.numel() * x.element_size()
    if not out or nbytes < MIN_BYTES:
        return None
    srcs = [g.src for g in lay.groups if _usable(plain.get(g.src)) and plain[g.src].device == device]
    return out, list(dict.fromkeys(srcs))


def _is01(m: torch.Tensor) -> torch.Tensor:
    """A 0-d bool device tensor: whether mask ``m`` holds only 0 and 1 (``layout._mask01``'s rule)."""
    if m.dtype == torch.bool:
        return torch.ones((), dtype=torch.bool, device=m.device)
    if m.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        lo, hi = torch.aminmax(m)
        return (lo >= 0) & (hi <= 1)
    return ((m == 0) | (m == 1)).all()


class _Field:
    """One field's permuted device buffer and what the background needs of it."""

    def __init__(self, key: str, x: torch.Tensor, out: torch.Tensor, group: int):
        self.key, self.shape, self.dtype, self.out, self.group = key, tuple(x.shape), x.dtype, out, group
        self.w = math.prod(self.shape[2:])


class Pending:
    """One batch's unpadding, begun by ``start`` (the device copies) and run by the copier thread;
    ``finish()`` (the writer's thread) returns the host ``Unpadding``, ``release()`` gives its pinned
    buffers back."""

    def __init__(self, pool: PinnedPool, plan: dict[tuple[str, int, int], list[str]], srcs: list[str]):
        self.pool, self.plan, self.srcs = pool, plan, list(srcs)
        self.keys: set[str] = {k for ks in plan.values() for k in ks}
        self.clones: dict[str, torch.Tensor] = {}  # device copies made at append (fields and masks)
        self.whole: dict[str, torch.Tensor] = {}  # host copies of the fields where unpadding ran out of memory
        self.groups: list[tuple[str, int, int]] = []
        self.fields: list[_Field] = []
        self.event: Any = None
        self._small: list[torch.Tensor] = []  # on the device: the stats, then each mask's [B, T] bools
        self._masks: list[torch.Tensor] = []  # those masks on the host
        self._order: list[int] = []  # the fields in the order of their first padded values in the stats
        self._bufs: list[torch.Tensor] = []
        self._future: Future | None = None

    def finish(self) -> Unpadding | None:
        """The fields' tokens in pinned memory, described (waits for the copier thread's ``_collect``);
        None where the device pass ran out of memory: ``whole`` holds the fields' host copies."""
        if self._future is None:  # not submitted (the interpreter is exiting): collected here, once
            self._future = Future()
            try:
                self._future.set_result(self._collect())
            except BaseException as e:  # noqa: BLE001 - raised below, as the copier's would be
                self._future.set_exception(e)
        return self._future.result()

    def _collect(self) -> Unpadding | None:
        """On the copier thread, right after ``append`` (not when a writer worker takes the step: the
        device copies are freed within milliseconds, whatever the writer's backlog): the device pass on
        the copies, on the copier's own stream, then the fields' tokens copied to pinned memory."""
        dev = next(iter(self.clones.values())).device
        cuda = dev.type == "cuda"
        with torch.cuda.stream(_copy_stream(dev)) if cuda else contextlib.nullcontext():
            if cuda:
                torch.cuda.current_stream(dev).wait_event(self.event)
            try:
                _compact(self.clones, self.plan, self.srcs, self)
            except torch.OutOfMemoryError:  # the fields go whole, as the copies hold them
                self.fields, self.groups, self._small = [], [], []
                keys = list(self.keys)
                hosts = _copy_out([(self.clones[k], self.clones[k].shape[0]) for k in keys], self.pool,
                                  sum(aligned(self.clones[k].nbytes) for k in keys), self._bufs)
                self.whole, self.clones = dict(zip(keys, hosts)), {}
                return None
        small = _copy_out([(t, t.shape[0]) for t in self._small], self.pool,
                          sum(aligned(t.numel() * t.element_size()) for t in self._small), self._bufs)
        self._small, self.clones = [], {}  # the pass is done (its stream synchronized by the copy)
        st, self._masks = small[0].tolist(), small[1:]
        nG, nS = len(self.groups), len(self.srcs)
        nF = len(self.fields)
        counts, ok, differs = st[:nG], st[nG:nG + nS], st[nG + nS:nG + nS + nF]
        firsts = [0] * nF
        for j, v in zip(self._order, st[nG + nS + nF:]):
            firsts[j] = v
        masks = {s: (self._masks[i] if ok[i] else None) for i, s in enumerate(self.srcs)}
        # what each field sends: its tokens, or every position where the padded values differ
        sends = []
        for j, f in enumerate(self.fields):
            n = f.shape[0] * f.shape[1]
            differ, first = differs[j], firsts[j]
            count = counts[f.group]
            k = n if differ else count
            sends.append((f, count, n, bool(differ), first, k))
        total = sum(aligned(k * f.w * f.out.element_size()) for f, _, _, _, _, k in sends)
        hosts = _copy_out([(f.out, k) for f, _, _, _, _, k in sends], self.pool, total, self._bufs)
        fields = {}
        for (f, count, n, differ, first, _k), h in zip(sends, hosts):
            src, lo, W = self.groups[f.group]
            m = self._masks[self.srcs.index(src)][:, lo:lo + W]
            fields[f.key] = Unpadded(src, lo, W, f.shape, f.dtype, m, h[:count], h[count:] if differ else None,
                                     None if (differ or count == n) else int(first))
            f.out = None  # the device buffer may go
        return Unpadding(fields, masks)

    def release(self) -> None:
        """Give the pinned buffers back (after the copier thread is done with them)."""
        if self._future is not None:
            try:
                self._future.result()
            except Exception:  # noqa: BLE001 - raised to the step by finish(); here only its buffers go back
                pass
        for b in self._bufs:
            self.pool.give(b, None)
        self._bufs = []
        self.fields, self._masks, self._small, self.clones, self.whole = [], [], [], {}, {}


def _copy_out(parts: list[tuple[torch.Tensor, int]], pool: PinnedPool, total: int,
              bufs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The first ``k`` rows of each device tensor, copied into one pooled pinned buffer (appended to
    ``bufs``); waits for the copies."""
    if not parts:
        return []
    dev = parts[0][0].device
    buf = pool.take(max(total, 1)) if dev.type == "cuda" else torch.empty(max(total, 1), dtype=torch.uint8)
    if dev.type == "cuda":
        bufs.append(buf)
    out, off = [], 0
    # the pass that wrote the buffers is done (its event was synchronized); the buffers are freed only after
    # this copy's event is synchronized below, so their memory is not reused under it
    ctx = torch.cuda.stream(_copy_stream(dev)) if dev.type == "cuda" else contextlib.nullcontext()
    with ctx:
        for t, k in parts:
            rows = t[:k]
            nb = rows.numel() * rows.element_size()
            dst = buf[off:off + nb].view(t.dtype).view(rows.shape)
            dst.copy_(rows, non_blocking=True)
            out.append(dst)
            off += aligned(nb)
        if dev.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(_copy_stream(dev))
            ev.synchronize()
    return out


def start(plain: Any, masks: Mapping | None, pool: PinnedPool) -> Pending | None:
    """Begin unpadding ``plain``'s padded CUDA token fields on their device; None where there is
    nothing to unpad, or the device memory for it could not be allocated (the caller copies the
    fields whole)."""
    if not isinstance(plain, dict) or not all(type(k) is str for k in plain):
        return None
    planned = _plan(plain, masks)
    if planned is None:
        return None
    groups, srcs = planned
    dev = plain[srcs[0]].device
    p = Pending(pool, groups, srcs)
    cuda = dev.type == "cuda"
    cur = torch.cuda.current_stream(dev) if cuda else None
    side = side_stream(dev) if cuda else None
    if cuda:
        side.wait_stream(cur)
    try:
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            p.clones = {k: _snapshot(plain[k]) for k in dict.fromkeys([*srcs, *p.keys])}
            if cuda:
                ev = torch.cuda.Event()
                ev.record(side)
                p.event = ev
    except torch.OutOfMemoryError:
        p.clones = {}
        if cuda:
            cur.wait_stream(side)
        return None
    if cuda:
        cur.wait_event(p.event)  # the caller may change or free the fields once they are copied
    try:
        p._future = _copier().submit(p._collect)
    except RuntimeError:  # the interpreter is exiting: finish() collects on the writer's thread
        pass
    return p


def _snapshot(x: torch.Tensor) -> torch.Tensor:
    """A device copy of ``x`` (one kernel on the current stream), contiguous."""
    return x.detach().clone(memory_format=torch.contiguous_format)


_pool_lock = threading.Lock()
_executor: list[ThreadPoolExecutor] = []


def _copier() -> ThreadPoolExecutor:
    """The process's one copier thread (the copies are PCIe-bound: one at a time is enough)."""
    with _pool_lock:
        if not _executor:
            _executor.append(ThreadPoolExecutor(1, thread_name_prefix="trajstore-unpad"))
        return _executor[0]


def _copy_stream(dev: torch.device) -> Any:
    """The copier's own stream on ``dev``: its copies never queue behind a later pass on the side stream
    (which waits for the caller's stream)."""
    return side_stream(dev, "unpad")


def _compact(plain: Mapping, groups: dict[tuple[str, int, int], list[str]], srcs: list[str], p: Pending) -> None:
    """The device pass over the copies ``plain`` (on the current stream): each group's fields permuted
    (tokens first), the stats and the masks, for ``_collect`` to copy to the host."""
    tms = {src: token_mask(plain[src]).contiguous() for src in srcs}
    oks = [_is01(plain[src]) for src in srcs]
    stats: list[torch.Tensor] = []
    differs: list[torch.Tensor] = []
    firsts: list[torch.Tensor] = []
    for (src, lo, W), keys in groups.items():
        m = tms[src][:, lo:lo + W].reshape(-1)
        n = m.numel()
        cum = torch.cumsum(m, 0)
        count = cum[-1:]
        ar = torch.arange(n, device=m.device)
        dest = torch.where(m, cum - 1, count + ar - cum)
        gi = len(p.groups)
        p.groups.append((src, lo, W))
        stats.append(count)
        after = (ar >= count).view(n, 1)  # the padded positions, in the permuted order
        at = count.clamp(max=n - 1)  # the first padded position, in the permuted order
        for k in keys:
            x = plain[k].detach()
            xs = x.reshape(n, *x.shape[2:])
            out = torch.empty_like(xs, memory_format=torch.contiguous_format)
            out.index_copy_(0, dest, xs)
            b = dt.bits_view(out).reshape(n, -1)
            first = b.index_select(0, at)[:, :1]
            differs.append(torch.ne(b, first).logical_and_(after).any())
            firsts.append(first.reshape(1))
            p.fields.append(_Field(k, x, out, gi))
    # the first padded values, one cat per bits dtype (fewer kernels than one conversion per field)
    by: dict[torch.dtype, list[int]] = {}
    for j, f in enumerate(firsts):
        by.setdefault(f.dtype, []).append(j)
    p._order = [j for js in by.values() for j in js]
    vals = torch.cat([*stats, torch.stack(oks).to(torch.int64), torch.stack(differs).to(torch.int64),
                      *(torch.cat([firsts[j] for j in js]).to(torch.int64) for js in by.values())])
    # copied to the host by the copier thread (no pinned buffer taken on the caller's thread)
    p._small = [vals, *tms.values()]
