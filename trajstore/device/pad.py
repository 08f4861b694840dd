"""Padded fields built on the device (``Reader.read`` / ``Reader.iter`` with ``device="cuda"``): the
outputs of a padded step (``Pad``, ``Flat``, ``Plan``: what ``plan.py`` staged for them) and the
torch ops that build them.

``build`` writes an output padded with one value (or holding one repeated value) by filling
it with its pad value and scattering its tokens to their positions (``index_copy_``), from one
``[N]`` index of the group's ``N`` tokens (each row's base repeated over its tokens, plus the
token's index: a few kernels per group, on the tokens only); the others (the recorded padded
values, a token axis last) with one gather per field from an index of ``[B, T]`` table
rows, computed on the device from the starts and lengths: the tokens of row ``b`` at positions
``start_b ..`` and the pad rows elsewhere, in the padded values' position order. Outputs up to
``plan.FLAT_BYTES`` (a list batch's groups, a small step) are built together instead, one gather per
dtype and width into one buffer they are views of, from a table of their rows (``Flat``), so a
batch of many groups costs a few kernels, not a few per group. Only the unpadded
values cross PCIe; the result is the CPU decode's bit for bit (the gather moves raw bits). Torch ops
only, on any device: on the CPU it is what the tests compare with the plain decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import index as device_index
from ..format import dtypes as dt

__all__ = ["Pad", "Flat", "Plan", "alloc", "run", "build", "unpack"]

SCATTER = True  # an output with one pad value: filled, its tokens scattered (False: gathered, as a pv output)


@dataclass
class Pad:
    """One padded output built on the device: ``shape``/``dtype`` of the tensor, ``w`` elements per
    token, ``last`` (token axis last: ``[B, *trail, T]``), its mask ``group``, and its table of rows
    in the staged buffer at byte ``at``: ``rows`` value rows (1: one repeated value) then the pad
    row(s) (``pv``: the recorded padded values, else one pad row)."""

    shape: tuple
    dtype: torch.dtype
    w: int
    last: bool
    group: int
    at: int
    rows: int
    const: bool
    pv: bool
    flat: int = -1  # small outputs: built together, a view at position ``pos`` of flat buffer ``flat``
    pos: int = 0
    home: bool = False  # its table in the arena the values were decoded into (``plan``'s ``home``)
    fillv: int = 0  # its pad value (its only one: ``pv`` False), then its one value (``const``), as its bits
    cval: int = 0
    narrow: bool = False  # its values int32 as stored, of an int64 output (``format/codec/late.py``): widened here
    bits: int = -1  # >= 0: its values a bool column's bitmap, from this bit of its first byte: unpacked here


@dataclass
class Flat:
    """Small outputs of one bits ``dtype`` and ``w`` (a list batch's groups, a small step), built by
    one gather into one buffer of ``P`` positions, from the line table at byte ``at``: per row of
    each output ([8, L] int64) its first position, width, first token, length, first value row,
    value step (0: one repeated value), first pad row, pad step (0: one pad row)."""

    dtype: torch.dtype
    w: int
    P: int
    L: int
    at: int


@dataclass
class Plan:
    """What ``build`` needs: the outputs, per mask group ``(byte offset of its [2, B] int64
    starts and lengths, B, T)`` in the staged buffer of ``total`` bytes, the flat buffers, and how
    much of the arena the values were decoded into the device needs too."""

    pads: list[Pad]
    groups: list[tuple[int, int, int]]
    buf: torch.Tensor | None
    total: int
    flats: list[Flat] = field(default_factory=list)
    home: int = 0  # bytes of the arena (``plan``'s ``home``) the tables of ``Pad.home`` outputs reach
    tokens: list[int] = field(default_factory=list)  # per mask group, its rows' tokens in all
    inside: int = -1  # ``buf`` is this byte offset of the arena (staged with it), not a buffer of its own
    sent: list[tuple[int, int]] = field(default_factory=list)  # (offset, bytes) of the arena's values used there


def alloc(p: Plan, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Uninitialized outputs of ``p`` on ``device`` (on the current stream), and the flat buffers
    its small outputs are views of."""
    flat = [torch.empty(f.P * f.w, dtype=f.dtype, device=device) for f in p.flats]
    outs = [torch.empty(x.shape, dtype=x.dtype, device=device) if x.flat < 0 else
            flat[x.flat][x.pos * x.w:(x.pos + math.prod(x.shape) // x.w) * x.w].view(x.dtype).view(x.shape)
            for x in p.pads]
    return outs, flat


_BITS: dict[torch.device, torch.Tensor] = {}  # per device: [1, 2, 4, .. 128] uint8, a bitmap byte's bit masks


def unpack(src: torch.Tensor, shift: int, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``n`` bools of an Arrow bitmap's bytes ``src`` (on its device), from bit ``shift`` of its first byte, least
    significant bit first as Arrow packs them (into ``out``): two kernels, its bits masked, then compared."""
    bits = _BITS.get(src.device)
    if bits is None:
        bits = _BITS[src.device] = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=src.device)
    masked = torch.bitwise_and(src[:(shift + n + 7) // 8, None], bits)
    return torch.ne(masked.view(-1)[shift:shift + n], 0, out=out)


def _values(buf: torch.Tensor, pad: Pad, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` values of ``pad``'s table at byte ``pad.at`` of ``buf``, as ``dtype``: its int32 values as
    stored, widened here, where ``pad.narrow``; its bitmap unpacked here (least significant bit first, as
    Arrow packs them), its pad row after them, where ``pad.bits`` >= 0 (``format/codec/late.py``)."""
    if pad.bits >= 0:
        n = min(count, pad.rows)
        v = unpack(buf[pad.at:], pad.bits, n).view(torch.uint8)
        return v if count == n else torch.cat([v, v.new_full((count - n,), pad.fillv)])
    if pad.narrow:
        return buf[pad.at:pad.at + 4 * count].view(torch.int32).to(dtype)
    return buf[pad.at:pad.at + count * dtype.itemsize].view(dtype)


def build(p: Plan, src: torch.Tensor, outs: list[torch.Tensor], flat: list[torch.Tensor],
          home: torch.Tensor | None = None) -> None:
    """Write every output of ``p`` (``outs``, ``flat``: from ``alloc``, on ``src``'s device) from
    ``src``, the staged buffer on the device, and ``home``, the arena's bytes there (the tables of
    ``Pad.home`` outputs). Temporaries are allocated on the current stream."""
    cache: dict[tuple[int, str], torch.Tensor] = {}
    dests: dict[int, torch.Tensor] = {}
    for f, buf in zip(p.flats, flat):
        esize = buf.element_size()
        table = src[:src.numel() // (f.w * esize) * f.w * esize].view(f.dtype).view(-1, f.w)
        torch.index_select(table, 0, device_index.lines(src, f), out=buf.view(f.P, f.w))
    for pad, out in zip(p.pads, outs):
        if pad.flat >= 0:
            continue
        g = p.groups[pad.group]
        if SCATTER and not pad.pv and not pad.last and p.tokens:  # pad value, then the values scattered to their positions
            d = dests.get(pad.group)
            if d is None:
                d = dests[pad.group] = device_index.dest(src, g, p.tokens[pad.group])
            o = dt.bits_view(out).view(-1) if pad.w == 1 else dt.bits_view(out).view(-1, pad.w)
            o.fill_(pad.fillv)
            if pad.const:  # w == 1
                o.index_fill_(0, d, pad.cval)
            else:
                v = _values(home if pad.home else src, pad, p.tokens[pad.group] * pad.w, o.dtype)
                o.index_copy_(0, d, v if pad.w == 1 else v.view(-1, pad.w))
            continue
        mode = "const" if pad.const else "pv" if pad.pv else "pad"
        key = (pad.group, mode) if mode == "const" else (pad.group, mode, pad.rows)
        idx = cache.get(key)
        if idx is None and mode == "const" and p.tokens:  # from the group's "pad" index: its pad rows are N
            N = p.tokens[pad.group]
            base = cache.get((pad.group, "pad", N))
            if base is None:
                base = cache[(pad.group, "pad", N)] = device_index.index(src, g, "pad", N)
            idx = cache[key] = (base == N).to(base.dtype)
        if idx is None:
            idx = cache[key] = device_index.index(src, g, mode, pad.rows)
        o = dt.bits_view(out)
        nrows = pad.rows + (g[1] * g[2] - pad.rows if pad.pv else 1)  # pv: the positions the mask leaves out
        table = _values(home if pad.home else src, pad, nrows * pad.w, o.dtype).view(nrows, pad.w)
        n, T = g[1], g[2]
        if pad.last:  # [B, *trail, T]: gathered token-major, then transposed into place
            tmp = torch.index_select(table, 0, idx)
            o.view(n, pad.w, T).copy_(tmp.view(n, T, pad.w).transpose(1, 2))
        else:
            torch.index_select(table, 0, idx, out=o.view(n * T, pad.w))


def run(p: Plan, outs: list[torch.Tensor], flat: list[torch.Tensor], home: torch.Tensor | None = None) -> None:
    """Copy the staged buffer to the outputs' device and build them, on the current stream; its
    device copy is allocated on that stream too, so it is freed in that stream's order. ``home``:
    the arena's bytes on the device (at least ``p.home`` of them), copied there by the caller."""
    if p.buf is None or not outs:
        return
    if p.inside >= 0 and home is not None:  # copied with the arena
        src = home[p.inside:p.inside + p.total]
    else:
        src = torch.empty(p.total, dtype=torch.uint8, device=outs[0].device)
        src.copy_(p.buf[:p.total], non_blocking=True)
    build(p, src, outs, flat, home)
