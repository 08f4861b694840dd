"""What a padded step stages for its ``[B, T]`` fields to be built on the device (``pad.py``), on the host.

The decoder leaves a padded token field's ``[B, T, ...]`` output (and each ``[g, T, ...]`` group
cell of an AReaL-style list batch, ``format/codec/grouped.py``) unfilled and hands over its fill jobs
(``format/codec/decoder.py`` ``defer``): each row group's values (the tokens, unpadded), their row
offsets, the ``[B, T]`` token mask of the rows, and the pad value or the recorded padded values
(``format/codec/tensors.py`` ``FillJob``; for a right or left padded mask each row's first token, and no
``[B, T]`` mask at all). ``plan`` stages what the device needs:

* per field, a table of rows of ``w`` elements (``w``: the elements per token): the values, then
  one row holding the pad value, or the recorded padded values; a field whose values all hold one
  value (an ``attention_mask`` of ones, which the reader does not even decode: ``tensors.mask_of_ones``)
  stores that one row instead of every token's. A large field padded with one value whose column the
  decode joined into the pinned arena (``torch_bridge.Arena``, copied to the device whole, as for a
  packed replay) keeps its values there: its pad row is written into the ``SPARE`` bytes after them,
  and only the other tables are written, after them in the arena too where they fit (else in a
  pinned buffer of their own). So a padded step stages the packed step's bytes, once (a large bool field
  joined as its bitmap's bytes, ``format/codec/late.py``, staged as those and unpacked on the device);
* per mask (shared by the fields that follow it), each row's first token position, length, and
  the position in the ``[B * T]`` output its tokens start from less their first index among all;
* per flat buffer (outputs up to ``FLAT_BYTES``, built together: ``pad.Flat``), a line table of
  their rows.

A job whose output is not a torch tensor of the batch (a numpy field: it stays on the host) is
filled on the CPU as before (``decoder.fill``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..base.threads import pieces, run_parallel
from ..format.codec.decoder import fill
from ..format.codec.fill_job import FillJob
from .pad import SCATTER, Flat, Pad, Plan
from .pinned import ALIGN, aligned

__all__ = ["plan", "key", "SPARE", "CONST_PROBE", "FLAT_BYTES"]

SPARE = 64  # unused bytes after each array of a torch_bridge.Arena: a pad row of up to this size fits there
CONST_PROBE = 64  # values looked at before a field is scanned whole for one repeated value
FLAT_BYTES = 4 << 20  # outputs up to this size are built together, one gather per dtype and width


def key(t: torch.Tensor) -> int | None:
    """The storage a whole contiguous tensor spans, or None (a view of part of one)."""
    if not t.numel() or not t.is_contiguous() or t.device.type != "cpu":
        return None
    s = t.untyped_storage()
    return s.data_ptr() if t.data_ptr() == s.data_ptr() and t.numel() * t.element_size() == s.nbytes() else None


def _whole(jobs: list[FillJob]) -> bool:
    """The jobs cover the output's rows in order, each from one chunk of its values."""
    n = jobs[0].out.shape[0]
    if len(jobs) == 1:  # the usual case: a joined column
        j = jobs[0]
        return j.r0 == 0 and j.r1 == n and (j.shift >= 0 or j.src.numel() == int(j.off[n]))
    return (jobs[0].r0 == 0 and jobs[-1].r1 == n and all(a.r1 == b.r0 for a, b in zip(jobs, jobs[1:]))
            and all(j.mask is jobs[0].mask and j.starts is jobs[0].starts for j in jobs)
            and all((j.pv is None) == (jobs[0].pv is None) for j in jobs)
            and sum(j.src.numel() for j in jobs) == int(jobs[0].off[n]))


def _const(srcs: list[torch.Tensor], w: int, ready: Callable[..., None]) -> np.ndarray | None:
    """The one token value every value repeats (an ``attention_mask`` of ones), as a numpy array of
    that one value, or None. Scanned in pieces of ``CONST_PROBE`` values and up, so a field of
    varied values stops early (``ready(piece, True)``: the bytes of each piece before it is read, the values
    still sent from where they are: a field of varied values is sent whole)."""
    if w != 1:
        return None
    arrays = [s.numpy() for s in srcs if s.numel()]
    if not arrays:
        return None
    ready(arrays[0][:1])
    v = arrays[0][0]
    if all(a.strides[0] == 0 for a in arrays):  # one value, repeated (format/codec/tensors.py mask_of_ones)
        return arrays[0][:1] if all(a[0] == v for a in arrays) else None
    for a in arrays:
        i, step = 0, CONST_PROBE
        while i < len(a):
            ready(a[i:i + step], True)
            if not (a[i:i + step] == v).all():
                return None
            i, step = i + step, min(step * 4, 1 << 20)
    return arrays[0][:1]


def plan(jobs: list[FillJob], leaves: list[torch.Tensor], take: Callable[[int], torch.Tensor],
         home: tuple[torch.Tensor, int] | None = None, ks: list[int | None] | None = None,
         ready: Callable[..., None] | None = None,
         taken: Callable[[Any], bool] | None = None) -> tuple[dict[int, int], Plan]:
    """Stage the padded outputs among ``leaves`` (the batch's torch tensors) for ``build``: returns
    ``{storage key: index into Plan.pads}`` and the plan, its buffer from ``take(nbytes)``. Jobs of
    other outputs (numpy fields) are filled here, on the CPU. ``home``: the pinned buffer the values
    were decoded into and its bytes used (``torch_bridge.Arena``, staged to the device as well): a
    large output padded with one value whose values lie there whole, with ``SPARE`` bytes after
    them, keeps them there (its pad row written after them), not copied (``Plan.sent``: where). ``ks``: ``key`` of
    each leaf, if the caller has them. ``ready(values)``: called before values are read here (the arena's values
    sent from Arrow's memory are copied into it then: ``sends.py``). ``taken(values)``: whether they go to the
    device from Arrow's memory: a field whose values do is not probed for one repeated value (``_const``), since
    sending its values costs the host nothing and reading them here would copy them first."""
    ks = [key(t) for t in leaves] if ks is None else ks
    keys = {k: i for i, k in enumerate(ks) if k is not None}
    rd = ready or _nothing
    jobs = [j if j.shift < 0 or _bits_home(j, home) else _unbits(j, rd) for j in jobs]  # bitmaps: unpacked there, or here
    by_out: dict[int, list[FillJob]] = {}
    rest: list[FillJob] = []
    for j in jobs:
        if not j.out.numel():
            continue
        k = j.out.untyped_storage().data_ptr()
        if k in keys and leaves[keys[k]].dtype == j.out.dtype:
            by_out.setdefault(k, []).append(j)
        else:
            rest.append(j)
    # a tensor of the batch that views part of an output would be staged as it is: fill those on the CPU
    part = {t.untyped_storage().data_ptr() for t, k in zip(leaves, ks) if k is None and t.numel() and t.device.type == "cpu"}
    for k, js in list(by_out.items()):
        if not _whole(js) or k in part:
            rest += by_out.pop(k)
    for j in rest:
        _ready_job(j, rd)
    fill(rest)
    # where the values of every output begin: a pad row written after one output's values must not
    # land on another's (AReaL group cells are slices of one joined column, one after the other)
    starts = sorted(j.src.data_ptr() for j in jobs if j.src.numel() and j.src.device.type == "cpu")
    # layout: per mask group its starts and lengths, then per output its table
    groups: dict[Any, int] = {}
    ginfo: list[tuple[np.ndarray, int, int, int]] = []
    items, size = [], 0
    for k, js in by_out.items():
        j0, t = js[0], leaves[keys[k]]
        n, T = j0.out.shape[0], j0.out.shape[1]
        w = math.prod(j0.out.shape[2:])
        off = np.asarray(j0.off, dtype=np.int64)
        off = off if w == 1 else off // w  # in tokens
        # a mask group: the same mask, or (no mask) the same starts and offsets (few numpy calls per
        # output: each may hand the GIL over, slow while other threads decode)
        gk = id(j0.mask) if j0.mask is not None else (T, j0.starts.tobytes(), off.tobytes())
        if gk not in groups:
            lens = np.diff(off)
            # each row's first token: as the decoder knows it (right or left side), else from the mask
            if j0.starts is None:
                rd(j0.mask)
            first = j0.starts if j0.starts is not None else j0.mask.numpy().argmax(axis=1)
            first = np.asarray(first, np.int64)
            # its tokens' positions in the [B * T] output: row b's token i (of all) goes to base_b + i
            rows = np.empty((3, n), np.int64)  # a row of no tokens: any start
            rows[0], rows[1] = first, lens
            base = rows[2]
            np.cumsum(lens, out=base)
            base -= lens
            np.subtract(np.arange(0, n * T, T, dtype=np.int64) + first, base, out=base)
            groups[gk] = len(ginfo)
            ginfo.append((rows, n, T, size))
            size += aligned(rows.nbytes)
        srcs = [j.src for j in js]
        probe = j0.pv is None and j0.shift < 0 and not (taken is not None and any(taken(x) for x in srcs))
        c = _const(srcs, w, rd) if probe else None
        esize = j0.src.element_size()
        at_home = j0.shift >= 0 or (c is None and j0.pv is None and not _small(j0, n, T, w)
                                    and _at_home(js, home, w * esize, starts))
        # int32 values of int64 ids (format/codec/late.py) are widened on the device where they are scattered
        # from home (pad.SCATTER) with a pad value int32 holds; any other output is widened here, on the host
        if esize != j0.out.element_size() and not (at_home and SCATTER and -(1 << 31) <= int(j0.pad) < (1 << 31)):
            for j in js:
                rd(j.src)
            js = by_out[k] = [j._replace(src=j.src.to(j.out.dtype)) for j in js]
            j0, srcs, at_home = js[0], [j.src for j in js], False
            c = None if c is None else c.astype(_npdt(j0.src.dtype))
            esize = j0.src.element_size()
        nvals = 1 if c is not None else int(off[n]) if j0.shift >= 0 else sum(s.numel() for s in srcs) // w
        npad = sum(j.pv[1].numel() for j in js) // w if j0.pv is not None else 1
        if at_home:
            items.append((k, js, t, n, T, w, c, nvals, npad, -1, groups[gk]))
            continue
        if _small(j0, n, T, w):  # its table at whole rows of the buffer: a flat gather reads them so
            size = -(-size // math.lcm(ALIGN, w * esize)) * math.lcm(ALIGN, w * esize)
        items.append((k, js, t, n, T, w, c, nvals, npad, size, groups[gk]))
        size += aligned((nvals + npad) * w * esize)
    flats, lines = _flats(items, ginfo)
    for (f, _), meta in zip(flats, lines):
        f.at = size
        size += aligned(meta.nbytes)
    buf = take(size) if size else None
    host = None if buf is None else buf.numpy()
    copies: list[tuple[np.ndarray, np.ndarray]] = []

    def put(at: int, a: torch.Tensor | np.ndarray) -> None:  # queued: copied in pieces on the shared pool below
        x = a if isinstance(a, np.ndarray) else a.numpy()
        dst = host[at:at + x.nbytes].view(x.dtype)  # type: ignore[index]
        copies.extend((dst[s], x[s]) for s in pieces(len(x), x.itemsize))

    for rows, n, T, at in ginfo:
        put(at, rows.reshape(-1))
    for (f, _), meta in zip(flats, lines):
        put(f.at, meta.reshape(-1))
    index: dict[int, int] = {}
    pads: list[Pad] = []
    sent: list[tuple[int, int]] = []  # (offset, bytes) of the arena's values used where they are
    hend = 0
    for k, js, t, n, T, w, c, nvals, npad, at, gi in items:
        j0 = js[0]
        bdt = j0.src.dtype
        if at < 0:  # at home: the pad row after the values, in the arena
            at = j0.src.data_ptr() - home[0].data_ptr()  # type: ignore[index]
            vend = at + j0.src.numel() * j0.src.element_size()
            row = _pad_row(j0.pad, bdt, w)[:0 if j0.shift >= 0 else w]  # (a bitmap's pad row: made there)
            home[0].numpy()[vend:vend + row.nbytes] = row.view(np.uint8)  # type: ignore[index]
            hend = max(hend, vend + row.nbytes)
            sent.append((at, vend - at))
            index[k] = len(pads)
            narrow = j0.src.element_size() != t.element_size()  # int32 values of int64 ids: widened on the device
            pads.append(Pad(tuple(t.shape), t.dtype, w, not j0.out.is_contiguous(), gi, at, nvals, False, False,
                            home=True, fillv=_bits(j0.pad, t.dtype if narrow else bdt, t), narrow=narrow,
                            bits=j0.shift))
            continue
        o = at
        for j in js:
            _ready_job(j, rd)
        for s in ([c] if c is not None else [j.src.numpy() for j in js]):
            put(o, s.reshape(-1))
            o += s.nbytes
        if j0.pv is None:
            put(o, _pad_row(j0.pad, bdt, w))
        else:
            for j in js:
                put(o, j.pv[1].reshape(-1))
                o += j.pv[1].numel() * j.pv[1].element_size()
        last = not j0.out.is_contiguous()  # the [B, T, *trail] view of a [B, *trail, T] output
        index[k] = len(pads)
        pads.append(Pad(tuple(t.shape), t.dtype, w, last, gi, at, nvals, c is not None,
                        j0.pv is not None, *_member(flats, k), fillv=_bits(j0.pad, bdt, t),
                        cval=0 if c is None else _bits(int(c[0]), bdt, t)))
    run_parallel(lambda c: np.copyto(c[0], c[1]), copies, size)
    return index, Plan(pads, [(at, n, T) for _, n, T, at in ginfo], buf, size, [f for f, _ in flats], hend,
                       [int(rows[1].sum()) for rows, _, _, _ in ginfo], sent=sent)


def _nothing(*_: Any) -> None:
    return None


def _ready_job(j: FillJob, ready: Callable[[Any], None]) -> None:
    """``ready`` for what filling job ``j`` on the host reads: its values, recorded padded values and mask."""
    ready(j.src)
    if j.pv is not None:
        ready(j.pv[1])
    if j.mask is not None:
        ready(j.mask)


def _unbits(j: FillJob, ready: Callable[[Any], None]) -> FillJob:
    ready(j.src)
    return j.unbits()


def _bits(v: int, bdt: torch.dtype, t: torch.Tensor) -> int:
    """The value ``v`` (raw bits in ``bdt``, the values' dtype) as a Python int of ``t``'s bits dtype."""
    k = (v, bdt, t.element_size())
    b = _BITS_OF.get(k)
    if b is None:
        b = int(np.full(1, v, dtype=_npdt(bdt)).view(_npdt(_BITS[k[2]]))[0])
        if len(_BITS_OF) < 1024:  # pad values repeat; a constant field's value may change every step
            _BITS_OF[k] = b
    return b


def _pad_row(v: int, bdt: torch.dtype, w: int) -> np.ndarray:
    """A row of ``w`` pad values ``v`` in ``bdt`` (cached: read only)."""
    k = (v, bdt, w)
    r = _PAD_ROWS.get(k)
    if r is None:
        r = np.full(w, v, dtype=_npdt(bdt))
        r.flags.writeable = False
        if len(_PAD_ROWS) < 1024:
            _PAD_ROWS[k] = r
    return r


_BITS_OF: dict[tuple, int] = {}
_PAD_ROWS: dict[tuple, np.ndarray] = {}


_NP: dict[torch.dtype, np.dtype] = {}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # dtypes.bits_view's


def _npdt(d: torch.dtype) -> np.dtype:
    """The numpy dtype of a torch dtype numpy has (cached: no torch call per use)."""
    n = _NP.get(d)
    if n is None:
        n = _NP[d] = torch.empty(0, dtype=d).numpy().dtype
    return n


def _at_home(js: list[FillJob], home: tuple[torch.Tensor, int] | None, rowbytes: int, starts: list[int]) -> bool:
    """The output's values are one array carved out of ``home`` (at a whole row), with room for a
    pad row of ``rowbytes`` after them: no other output's values (``starts``: where each output's
    values begin) lie in those bytes, as the next group's do where the values are one group cell's
    slice of a joined column."""
    if home is None or len(js) != 1 or rowbytes > SPARE:
        return False
    s = js[0].src
    base, p = home[0].data_ptr(), s.data_ptr()
    n = s.numel() * s.element_size()
    i = bisect.bisect_left(starts, p + n)
    if i < len(starts) and starts[i] < p + n + rowbytes:
        return False
    return (s.device.type == "cpu" and s.is_contiguous() and s.numel() > 0 and base <= p
            and p + n + SPARE <= base + home[1] and (p - base) % rowbytes == 0)


def _bits_home(j: FillJob, home: tuple[torch.Tensor, int] | None) -> bool:
    """A bool output's values as its bitmap's bytes (``format/codec/late.py``) are unpacked on the device:
    the one job of a whole ``[B, T]`` output padded with one value, too large to be built in a flat buffer,
    its bitmap carved out of ``home``."""
    n = j.out.shape[0]
    return (j.pv is None and j.out.dim() == 2 and j.out.is_contiguous() and j.r0 == 0 and j.r1 == n
            and not _small(j, n, j.out.shape[1], 1) and _at_home([j], home, 1, []))


def _small(j0: FillJob, n: int, T: int, w: int) -> bool:
    """An output built in a flat buffer (token-major, up to ``FLAT_BYTES``)."""
    return j0.out.is_contiguous() and n * T * w * j0.src.element_size() <= FLAT_BYTES


def _flats(items: list, ginfo: list) -> tuple[list[tuple[Flat, dict]], list[np.ndarray]]:
    """The flat buffers of the small outputs among ``items`` (laid out: their tables' byte offsets
    known), with ``{storage key: (flat, position)}`` each, and their line tables."""
    buckets: dict[tuple, list] = {}
    for it in items:
        k, js, t, n, T, w, c, nvals, npad, at, gi = it
        if _small(js[0], n, T, w):
            buckets.setdefault((js[0].src.dtype, w), []).append(it)
    out, tables = [], []
    for (bdt, w), members in buckets.items():
        where, cols, pos = {}, [], 0
        for k, js, t, n, T, _, c, nvals, npad, at, gi in members:
            rows = ginfo[gi][0]
            starts, lens = rows[0], rows[1]
            r0 = at // (w * js[0].src.element_size())  # the table's first row in the buffer's rows
            pv = js[0].pv is not None
            vb = r0 + (0 if c is not None else np.cumsum(lens) - lens)
            pb = r0 + nvals + (np.cumsum(T - lens) - (T - lens) if pv else 0)
            cols.append(np.stack(np.broadcast_arrays(
                pos + np.arange(n) * T, T, starts, lens, vb, int(c is None), pb, int(pv))).astype(np.int64))
            where[k] = pos
            pos += n * T
        meta = np.ascontiguousarray(np.concatenate(cols, axis=1))
        out.append((Flat(bdt, w, pos, meta.shape[1], 0), where))
        tables.append(meta)
    return out, tables


def _member(flats: list[tuple[Flat, dict]], k: int) -> tuple[int, int]:
    for i, (_, where) in enumerate(flats):
        if k in where:
            return i, where[k]
    return -1, 0
