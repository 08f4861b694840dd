"""The index tensors ``device_pad.build`` gathers and scatters with, computed on the device from
the few integers per row ``plan.plan`` staged (torch ops only: on CPU tensors too, where the
tests compare them with the CPU decode)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["dest", "index", "lines"]


def lines(src: torch.Tensor, f: Any) -> torch.Tensor:
    """The table row (in rows of ``f.w`` elements of the whole buffer) of every position of a flat buffer (``device_pad.Flat``)."""
    ix = torch.int32 if src.numel() < 2 ** 31 and f.P < 2 ** 31 else torch.int64
    meta = src[f.at:f.at + 64 * f.L].view(torch.int64).view(8, f.L)
    first, width, start, length, vb, vstep, pb, pstep = meta.to(ix)
    line = torch.repeat_interleave(torch.arange(f.L, device=src.device, dtype=ix), meta[1], output_size=f.P)
    q = torch.arange(f.P, device=src.device, dtype=ix) - first[line]  # the position in its row
    rel = q - start[line]
    n = length[line]
    valid = (rel >= 0) & (rel < n)
    k = torch.where(rel < 0, q, q - n)  # the padded position's rank in its row
    return torch.where(valid, vb[line] + vstep[line] * rel, pb[line] + pstep[line] * k)


def dest(src: torch.Tensor, g: tuple[int, int, int], N: int) -> torch.Tensor:
    """The ``[N]`` position in its ``[B * T]`` output of each of a group's ``N`` tokens (int64)."""
    at, n, _ = g
    base = src[at + 16 * n:at + 24 * n].view(torch.int64)
    lens = src[at + 8 * n:at + 16 * n].view(torch.int64)
    d = torch.repeat_interleave(base, lens, output_size=N)
    return d.add_(torch.arange(N, device=src.device, dtype=torch.int64))


def index(src: torch.Tensor, g: tuple[int, int, int], mode: str, nvals: int) -> torch.Tensor:
    """The ``[B * T]`` table row of every position of a group's rows (on ``src``'s device)."""
    at, n, T = g
    rows = src[at:at + 16 * n].view(torch.int64).view(2, n)
    ix = torch.int32 if n * T + nvals < 2 ** 31 else torch.int64  # half the memory where it fits
    starts, lens = rows[0].to(ix), rows[1].to(ix)
    ar = torch.arange(T, device=src.device, dtype=ix)
    rel = ar[None, :] - starts[:, None]
    valid = (rel >= 0) & (rel < lens[:, None])
    if mode == "const":  # row 0: the value, row 1: the pad
        return (~valid).to(ix).reshape(-1)
    vbase = torch.cumsum(lens, 0, dtype=ix) - lens
    if mode == "pad":  # the values, then one pad row
        return torch.where(valid, vbase[:, None] + rel, nvals).reshape(-1)
    # the values, then the recorded padded values row by row in position order
    pbase = torch.cumsum(T - lens, 0, dtype=ix) - (T - lens)
    k = torch.where(rel < 0, ar[None, :], ar[None, :] - lens[:, None])
    return torch.where(valid, vbase[:, None] + rel, nvals + pbase[:, None] + k).reshape(-1)
