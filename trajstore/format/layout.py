"""How the tokens of a dict batch are laid out (docs/FORMAT.md section 3.4): the batch form
(padded by ``attention_mask``, packed by ``cu_seqlens``, or plain), which positions of a
``[B, T, ...]`` mask hold a token, and the ``[B, T]`` mask of given row lengths.

The form is decided in two steps: ``structure`` from dtypes and shapes alone (what ``Writer.append``
may look at), then ``read_cu_seqlens`` / ``read_padding`` from the values (the encoder).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._threads import run_parallel
from ..errors import BatchError
from .values import as_cpu, describe, is_tensorlike

__all__ = ["Layout", "token_mask", "structure", "batch_size", "read_cu_seqlens", "read_padding", "padded_mask"]

_CU_SEQLENS = "field 'cu_seqlens': must be a non-empty 1-D integer tensor starting at 0 and non-decreasing"


@dataclass
class Layout:
    """The form of a dict batch, filled in as far as it is known: ``form``, ``B`` and ``T`` from the
    structure; ``N`` and ``lengths`` once ``cu_seqlens`` is read; ``side``, ``mask`` and ``lengths``
    once the attention mask is read (``side`` None: the mask has holes)."""

    form: str  # "padded", "packed" or "plain"
    B: int
    T: int | None = None  # padded
    cu_seqlens: Any = None  # packed: the batch's value
    attention_mask: Any = None  # padded: the batch's value
    N: int | None = None  # packed: cu_seqlens[-1]
    side: str | None = None  # padded: "right", "left", or None (holes: [B, T] fields stored whole)
    mask: torch.Tensor | None = None  # padded, side known: the [B, T] token mask
    lengths: torch.Tensor | None = None  # tokens per row


def token_mask(m: torch.Tensor | np.ndarray) -> torch.Tensor:
    """The ``[B, T]`` bool mask of an attention mask of shape ``[B, T, ...]``: a token is valid where
    every one of its entries is non-zero (the one rule the encoder, the recorder and the
    inspection tools share)."""
    t = torch.as_tensor(m) != 0
    while t.ndim > 2:
        t = t.all(dim=-1)
    return t


def batch_size(batch: Mapping) -> int | None:
    """A plain dict's batch size: the leading size of the first tensor or list found, depth first."""
    for v in batch.values():
        if isinstance(v, torch.Tensor | np.ndarray) and v.ndim >= 1:
            return int(v.shape[0])
        if isinstance(v, list | tuple):
            return len(v)
        if isinstance(v, Mapping):
            n = batch_size(v)
            if n is not None:
                return n
    return None


def structure(batch: Mapping) -> Layout:
    """The form, ``B`` and ``T`` of a dict batch from dtypes and shapes only (no value is read)."""
    cu = batch.get("cu_seqlens")
    if is_tensorlike(cu) and not isinstance(cu, np.generic) and np.ndim(cu) == 1:
        _, name = describe(cu, ("cu_seqlens",))
        if not name.startswith(("int", "uint")) or cu.shape[0] == 0:
            raise BatchError(_CU_SEQLENS)
        return Layout("packed", int(cu.shape[0]) - 1, cu_seqlens=cu)
    m = batch.get("attention_mask")
    if is_tensorlike(m) and np.ndim(m) >= 2:
        describe(m, ("attention_mask",))
        return Layout("padded", int(m.shape[0]), int(m.shape[1]), attention_mask=m)
    return Layout("plain", batch_size(batch) or 0)


def read_cu_seqlens(lay: Layout) -> None:
    """Read a packed batch's ``cu_seqlens`` (B + 1 values, copied from the GPU if there): check that
    it starts at 0 and never decreases; set ``N`` and ``lengths``."""
    _, _, c = as_cpu(lay.cu_seqlens, ("cu_seqlens",))
    c = torch.as_tensor(c).to(torch.int64)
    if int(c[0]) != 0 or bool((c[1:] < c[:-1]).any()):
        raise BatchError(_CU_SEQLENS)
    lay.N, lay.lengths = int(c[-1]), c[1:] - c[:-1]


def read_padding(lay: Layout) -> None:
    """Read a padded batch's attention mask: check its values are 0 or 1; set ``side`` (right when
    every row's tokens are a prefix, left when a suffix, None for holes), ``mask`` and ``lengths``."""
    _, name, a = as_cpu(lay.attention_mask, ("attention_mask",))
    mb = torch.as_tensor(a) if isinstance(a, np.ndarray) else a
    if name != "bool" and not bool(((mb == 0) | (mb == 1)).all()):
        raise BatchError("field 'attention_mask': values must be 0 or 1 (found other values)")
    mask = token_mask(mb)
    T = mask.shape[1]
    lengths = mask.sum(1)
    ar = torch.arange(T)
    right = ar[None, :] < lengths[:, None]
    left = ar[None, :] >= (T - lengths)[:, None]
    lay.side = "right" if torch.equal(mask, right) else "left" if torch.equal(mask, left) else None
    if lay.side is not None:  # holes in the mask: every [B, T] field is stored whole
        lay.mask, lay.lengths = mask, lengths


def padded_mask(lengths: np.ndarray, T: int, side: str) -> torch.Tensor:
    """The [B, T] bool mask of ``lengths`` right- or left-aligned, built by row ranges in parallel."""
    L = np.asarray(lengths, dtype=np.int64).reshape(-1)
    out = np.empty((len(L), T), np.bool_)
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
