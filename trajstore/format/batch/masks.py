"""Mask groups and the geometry of token masks, shared by the encoder, the decoder, the shard join,
the recorder and the inspection tools: a mask group (``MaskGroup``: the columns of a mask field a set
of fields follows) and the names of its columns (``len_col``, ``start_col``); the ``[B, T]`` bool mask
of an attention mask (``token_mask``), a mask's side (``classify``: right, left, one span, or holes),
the run from each row's first to last valid token (``extent``), the ``[B, W]`` masks of given row
lengths and starts (``padded_mask``, ``span_mask``), the channel-major order of a field whose token
axis is last (``channel_major``), a plain batch's valid token count (``count_tokens``), and a mask group's
positions found once per step for the fields that follow it (``Selection``). No batch structure is decided
here (``layout``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...base.threads import run_parallel
from ..numpy_view import empty
from ..spec import LEN_PREFIX, START_PREFIX
from ..values import bits

__all__ = ["MaskGroup", "Selection", "start_col", "len_col", "token_mask", "classify", "extent", "span_mask",
           "padded_mask", "channel_major", "count_tokens", "row_counts", "host_empty"]


@dataclass
class MaskGroup:
    """Columns ``lo:lo+W`` of the mask field ``src``: the token mask a set of ``[B, W, ...]`` fields
    follows (docs/FORMAT.md section 3.4). ``key`` names its ``<key>_cu_seqlens`` in packed output
    ("" for the attention mask: plain ``cu_seqlens``); ``inferred`` groups whose mask is not 0/1
    store their fields whole instead of failing."""

    key: str
    src: str
    lo: int
    W: int
    part: bool = False  # a part of the mask field (verl's prompt / response columns of attention_mask)
    inferred: bool = True
    side: str | None = None  # once read: "right", "left", "span", or None (holes: stored whole)
    mask: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    starts: torch.Tensor | None = None  # side "span": first valid position per row
    holes: bool = False  # a declared mask with holes: each row's run spans its first to last valid token

    def node(self) -> dict:
        """The group's spec node (docs/FORMAT.md section 3.7)."""
        d = {"key": self.key, "src": self.src, "lo": self.lo, "W": self.W, "side": self.side}
        if self.side == "span":
            d["start_col"] = start_col(self)
        if self.holes:
            d["holes"] = True
        return d


def start_col(g: MaskGroup) -> str:
    """The column of a span group's per-row starts."""
    return START_PREFIX + g.src + (f"__{g.key}" if g.part else "")


def len_col(g: MaskGroup) -> str:
    """The column of a mask group's per-row valid token counts (docs/FORMAT.md 3.4)."""
    return LEN_PREFIX + g.src + (f"__{g.key}" if g.part else "")


def host_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
               like: torch.Tensor | None = None) -> torch.Tensor:
    """An uninitialized tensor on ``like``'s device (CPU by default); on the CPU, in memory from Arrow's
    allocator (``numpy_view.empty``), for the encoder's step-sized temporaries and outputs: Arrow's allocator
    keeps the pages it freed mapped for the next step, where torch's (the C library's) maps and unmaps a
    large block every time, and every first touch of a page is a fault; with several writer workers
    those faults queue on the process's memory map (benchmarks/RESULTS.md)."""
    if like is not None and like.device.type != "cpu":
        return torch.empty(tuple(shape), dtype=dtype, device=like.device)
    n = math.prod(int(d) for d in shape) * dtype.itemsize
    return torch.from_numpy(empty(n, np.uint8)[:n]).view(dtype).reshape(tuple(shape))


def token_mask(m: torch.Tensor | np.ndarray) -> torch.Tensor:
    """The ``[B, T]`` bool mask of an attention mask of shape ``[B, T, ...]``: a token is valid where
    every one of its entries is non-zero (the one rule the encoder, the recorder and the
    inspection tools share)."""
    t = torch.as_tensor(m)
    if t.dtype != torch.bool:  # (a bool mask is its own token mask: ``!= 0`` would widen it to int64)
        t = _ne(t, 0)
    while t.ndim > 2:
        t = t.all(dim=-1)
    return t


def channel_major(lengths: Any, w: int) -> np.ndarray:
    """For rows of ``lengths`` tokens of ``w`` channels each, laid out one after another: where each
    value of the token-major order (row by row, token by token, channel by channel) goes in the
    channel-major order (row by row, channel by channel, token by token), the order a field whose
    token axis is last stores each row's ``[C..., n]`` block in (docs/FORMAT.md 3.4)."""
    ln = np.asarray(lengths, dtype=np.int64).reshape(-1)
    o = np.zeros(len(ln), dtype=np.int64)
    np.cumsum(ln[:-1], out=o[1:])
    r = np.repeat(np.arange(len(ln)), ln)
    j = np.arange(int(ln.sum()), dtype=np.int64) - o[r]
    return ((o[r] * w + j)[:, None] + np.arange(w, dtype=np.int64)[None, :] * ln[r][:, None]).reshape(-1)


_BYTES = 0x0101010101010101  # a 64-bit word times this holds the sum of its 8 bytes in its top byte


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """A bool tensor's bytes as 64-bit words, 8 positions each, along its last dimension (no copy);
    None where its rows are not whole aligned words."""
    if t.numel() and t.shape[-1] % 8 == 0 and t.is_contiguous() and t.storage_offset() % 8 == 0:
        return t.view(torch.uint8).view(torch.int64)
    return None


def row_counts(mask: torch.Tensor) -> torch.Tensor:
    """The int64 count of True per row of a ``[B, W]`` bool mask: 8 positions at a time where the rows are
    whole 64-bit words (on the CPU with numpy >= 2, a popcount of each word; else their bytes summed by one
    multiply), else its bytes summed into int32 (bool sums widen every element to int64)."""
    w = _words(mask)
    if w is not None and w.device.type == "cpu" and hasattr(np, "bitwise_count"):  # numpy >= 2: 3x the sum
        return torch.from_numpy(np.bitwise_count(w.numpy()).sum(1, dtype=np.int64))
    if w is not None:
        return ((w * _BYTES) >> 56).bitwise_and_(0xFF).sum(1)
    return mask.view(torch.uint8).sum(1, dtype=torch.int32).to(torch.int64) if mask.shape[1] < 2**31 else mask.sum(1)


def classify(mask: torch.Tensor) -> tuple[str | None, torch.Tensor, torch.Tensor | None]:
    """``(side, lengths, starts)`` of a ``[B, W]`` token mask: right when every row's tokens are a
    prefix, left when a suffix, span when one contiguous run anywhere (``starts`` its first
    positions), None for holes."""
    W = mask.shape[1]
    lengths = row_counts(mask)
    if mask.shape[0] == 0:  # no rows: every side fits (and no [W] positions are built for a wide empty batch)
        return "right", lengths, None
    ar = torch.arange(W)
    want = host_empty(mask.shape, torch.bool, mask)
    if _same(mask, _aligned(ar, lengths, "right", want)):
        return "right", lengths, None
    if _same(mask, _aligned(ar, lengths, "left", want)):
        return "left", lengths, None
    starts = torch.where(lengths > 0, mask.to(torch.uint8).argmax(1), 0)
    if _same(mask, (ar[None, :] >= starts[:, None]) & (ar[None, :] < (starts + lengths)[:, None])):
        return "span", lengths, starts
    return None, lengths, None


def _cpu_numpy(t: torch.Tensor) -> bool:
    """Whether ``t`` is a CPU tensor numpy can view as it is: strided, no autograd, no lazy negation, and
    a dtype numpy has (every one but bfloat16 and complex)."""
    return (t.device.type == "cpu" and t.layout == torch.strided and t.dtype != torch.bfloat16
            and not t.is_complex() and not t.requires_grad and not t.is_neg())


def _ne(t: torch.Tensor, p: Any) -> torch.Tensor:
    """``t != p`` as a new bool tensor; on the CPU by numpy's comparison, which runs 2-3x torch's on a
    step-sized tensor (both give up the GIL: several writer workers compare at once)."""
    out = host_empty(t.shape, torch.bool, t)
    if _cpu_numpy(t):
        np.not_equal(t.numpy(), p.item() if isinstance(p, torch.Tensor) else p, out=out.numpy())
        return out
    return torch.ne(t, p, out=out)


def _aligned(ar: torch.Tensor, lengths: torch.Tensor, side: str, out: torch.Tensor) -> torch.Tensor:
    """``out``, the ``[B, W]`` mask of rows of ``lengths`` tokens right- or left-aligned (``ar``: ``arange(W)``);
    on the CPU by numpy's comparison (as ``_ne``)."""
    W = out.shape[1]
    if out.device.type == "cpu":
        a, n = ar.numpy()[None, :], lengths.numpy()[:, None]
        if side == "right":
            np.less(a, n, out=out.numpy())
        else:
            np.greater_equal(a, W - n, out=out.numpy())
        return out
    if side == "right":
        return torch.lt(ar[None, :], lengths[:, None], out=out)
    return torch.ge(ar[None, :], (W - lengths)[:, None], out=out)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` of two bool masks of one shape, on the CPU 8 positions at a time where both are
    contiguous whole words (torch compares bools one by one, ~7x slower on a step's mask)."""
    if a.device.type == "cpu" and a.is_contiguous() and b.is_contiguous() and a.shape == b.shape:
        wa, wb = _words(a.reshape(-1)), _words(b.reshape(-1))
        if wa is not None and wb is not None:
            return torch.equal(wa, wb)
    return torch.equal(a, b)


def extent(mask: torch.Tensor) -> torch.Tensor:
    """The ``[B, W]`` mask of each row's positions from its first valid token to its last (holes
    filled; an empty row stays empty): the run a mask with holes stores per row (docs/FORMAT.md 3.4)."""
    W = mask.shape[1]
    if not W:
        return mask.clone()
    m8 = mask.to(torch.uint8)
    first = m8.argmax(1)
    last = W - 1 - m8.flip(1).argmax(1)
    ar = torch.arange(W)[None, :]
    return (ar >= first[:, None]) & (ar <= last[:, None]) & mask.any(1, keepdim=True)


def span_mask(starts: np.ndarray, lengths: np.ndarray, W: int) -> torch.Tensor:
    """The [B, W] bool mask of rows holding ``lengths`` tokens from ``starts``."""
    if len(lengths) == 0:  # no rows: no [W] positions (a wide empty batch)
        return torch.zeros((0, W), dtype=torch.bool)
    ar = np.arange(W)
    s = np.asarray(starts, dtype=np.int64)[:, None]
    return torch.from_numpy((ar[None, :] >= s) & (ar[None, :] < s + np.asarray(lengths, np.int64)[:, None]))


def padded_mask(lengths: np.ndarray, T: int, side: str) -> torch.Tensor:
    """The [B, T] bool mask of ``lengths`` right- or left-aligned, built by row ranges in parallel."""
    L = np.asarray(lengths, dtype=np.int64).reshape(-1)
    out = np.empty((len(L), T), np.bool_)
    if not len(L):  # no rows: no [T] positions (a wide empty batch)
        return torch.from_numpy(out)
    ar = np.arange(T)

    def rows(ab: tuple[int, int]) -> None:
        a, b = ab
        if side == "right":
            np.less(ar[None, :], L[a:b, None], out=out[a:b])
        else:
            np.greater_equal(ar[None, :], (T - L[a:b])[:, None], out=out[a:b])

    bounds = np.linspace(0, len(L), max(1, min(len(L), out.nbytes // (1 << 20))) + 1).astype(np.int64)
    run_parallel(rows, [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a], out.nbytes)
    return torch.from_numpy(out)


def count_tokens(plain: Any) -> torch.Tensor | int | None:
    """The valid tokens of a plain batch, without reading GPU memory: a (possibly CUDA) 0-d tensor or
    an int; None where the batch does not say. A dict batch counts ``cu_seqlens[-1]`` or its
    ``attention_mask``; a list batch each element's ``attention_mask`` (``[T]``, ``[1, T]`` or a
    group's ``[g, T]``), else every ``input_ids`` entry."""
    if isinstance(plain, Mapping):
        cu, m = plain.get("cu_seqlens"), plain.get("attention_mask")
        if isinstance(cu, torch.Tensor) and cu.ndim == 1 and cu.numel():
            return cu[-1]
        if isinstance(m, torch.Tensor) and m.ndim >= 2:
            return token_mask(m).sum()
        return None
    if not isinstance(plain, list | tuple):
        return None
    n: torch.Tensor | int = 0
    for e in plain:
        if isinstance(e, Mapping):
            m, ids = e.get("attention_mask"), e.get("input_ids")
            if isinstance(m, torch.Tensor | np.ndarray):
                n = n + token_mask(m).sum()
            elif isinstance(ids, torch.Tensor | np.ndarray):  # no mask: every token counts
                n = n + (ids.size if isinstance(ids, np.ndarray) else ids.numel())
            else:
                return None
    return n


class Selection:
    """A mask group's positions, found once per step and shared by the fields that follow the group:
    ``padded`` (None where every position is a token), the ``first`` padded position, and ``index``,
    the flat positions of its tokens in row-major order (what ``x[mask]`` selects). A group whose rows
    each hold one run (``side`` right, left or span, with its rows' ``lengths`` and ``starts``) finds
    them from its lengths, without a pass over the mask."""

    def __init__(self, mask: torch.Tensor, side: str | None = None, lengths: torch.Tensor | None = None,
                 starts: torch.Tensor | None = None) -> None:
        W = mask.shape[1]
        if side in ("right", "left", "span") and lengths is not None:
            short = (lengths < W).nonzero()
            self.padded, self.first = None, 0
            if len(short):  # the first padded position: in the first row with padding
                r = int(short[0, 0])
                s0 = int(starts[r]) if side == "span" else 0
                pos = int(lengths[r]) if side == "right" else (0 if side == "left" or s0 > 0 else s0 + int(lengths[r]))
                self.padded = torch.bitwise_not(mask, out=host_empty(mask.shape, torch.bool, mask))
                self.first = r * W + pos
            self.index = torch.from_numpy(_run_positions(lengths, starts, side, W))
        else:
            self.padded = None if bool(mask.all()) else ~mask
            self.first = int(torch.argmax(self.padded.reshape(-1).view(torch.uint8))) if self.padded is not None else 0
            self.index = mask.reshape(-1).nonzero().squeeze(1)
        self._words: torch.Tensor | None = None

    def any_padded(self, differ: torch.Tensor) -> bool:
        """Whether the ``[B, W, ...]`` bool tensor ``differ`` (a scratch tensor: it is overwritten) is
        True at a padded position. A ``[B, W]`` one is tested as 64-bit words of 8 positions each."""
        p = self.padded
        assert p is not None
        if differ.ndim == 2:
            if self._words is None:
                self._words = _words(p.reshape(-1))
            d = _words(differ.reshape(-1))
            if d is not None and self._words is not None:
                return bool(d.bitwise_and_(self._words).any())
        return bool(differ.logical_and_(p.reshape(list(p.shape) + [1] * (differ.ndim - 2))).any())

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """``x[mask]`` of a ``[B, W, ...]`` tensor: its raw bits gathered (multi-threaded, one pass) into
        memory from Arrow's allocator (``host_empty``), viewed back as its dtype."""
        b = bits(x)
        src = b.reshape(b.shape[0] * b.shape[1], *b.shape[2:])
        out = host_empty((len(self.index), *src.shape[1:]), src.dtype, src)
        return torch.index_select(src, 0, self.index, out=out).view(x.dtype)

    def differ(self, b: torch.Tensor, p: Any) -> bool:
        """Whether the bits ``b`` (``[B, W, ...]``) differ from ``p`` at a padded position."""
        return self.any_padded(_ne(b, p))


def _run_positions(lengths: torch.Tensor, starts: torch.Tensor | None, side: str, W: int) -> np.ndarray:
    """The flat positions (row-major, in a ``[B, W]`` mask) of rows that each hold one run of
    ``lengths`` tokens, right or left aligned or from ``starts`` (side span): counted up by one within a
    run, the step between runs set at each run's first token, summed in place."""
    L = lengths.numpy().astype(np.int64, copy=False)
    B = len(L)
    firsts = np.arange(B, dtype=np.int64) * W
    if side == "left":
        firsts += W - L
    elif side == "span":
        firsts += starts.numpy().astype(np.int64, copy=False)
    off = np.zeros(B + 1, np.int64)
    np.cumsum(L, out=off[1:])
    out = empty(int(off[-1]), np.int64)
    if not len(out):
        return out
    out.fill(1)
    runs = L > 0
    at, first, n = off[:-1][runs], firsts[runs], L[runs]
    out[at[0]] = first[0]
    out[at[1:]] = first[1:] - (first[:-1] + n[:-1] - 1)  # from the last token of the run before
    torch.from_numpy(out).cumsum_(0)  # (numpy's cumsum holds the GIL throughout: ~5x longer, and every
    return out                        # other writer worker waits; torch's gives it up)
