"""A padded token field that reached the host without its padding (``Unpadded``): the writer selects a
padded CUDA batch's tokens on the GPU at ``append`` and copies only them (``device/unpad.py``); the
encoder (``tensors.encode``) stores these values exactly as it stores ``x[mask]`` of the whole tensor,
so the file is the same byte for byte. Where the batch's values show that a field is stored another way
after all (a group with holes or a mask not 0/1: fields stored whole), ``full()`` rebuilds the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from typing import Any

import torch

from .. import dtypes as dt
from ..arrow import TableBuilder
from ..batch.check import TOKENS, Tensor
from ..batch.layout import Layout
from ..spec import TensorNode
from . import tensors

__all__ = ["Unpadded", "Unpadding", "placeholder", "encode"]


def placeholder(x: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of ``x``'s shape and dtype holding one element (a stride-0 view): what the batch
    holds in place of an ``Unpadded`` field for the walk, which looks at shapes and dtypes only."""
    return torch.zeros((), dtype=x.dtype).expand(x.shape)


@dataclass(eq=False)
class Unpadded:
    """Field ``[B, W, *trail]`` of ``dtype`` as selected by the token mask ``mask`` (host ``[B, W]``
    bool; columns ``lo:lo+W`` of mask field ``src``): ``values`` ``x[mask]`` (row-major), and either
    ``padvals`` ``x[~mask]`` (padded positions holding different values) or ``pad``, the bits every
    padded element holds (None where nothing is padded or ``padvals`` hold them)."""

    src: str
    lo: int
    W: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    mask: torch.Tensor
    values: torch.Tensor
    padvals: torch.Tensor | None
    pad: int | None

    def follows(self, src: str, lo: int, W: int) -> bool:
        """Whether it was selected by columns ``lo:lo+W`` of mask field ``src``."""
        return (self.src, self.lo, self.W) == (src, lo, W)

    def full(self) -> torch.Tensor:
        """The whole ``[B, W, *trail]`` tensor, padding included."""
        B, W, trail = self.shape[0], self.shape[1], self.shape[2:]
        out = torch.empty((B * W, *trail), dtype=self.dtype)
        m = self.mask.reshape(-1)
        out[m] = self.values
        if self.padvals is not None:
            out[~m] = self.padvals
        elif self.pad is not None:
            b = dt.bits_view(out)
            b[~m] = torch.tensor(self.pad, dtype=b.dtype)
        return out.reshape(self.shape)

    @property
    def width(self) -> int:
        """Elements per token."""
        return math.prod(self.shape[2:])


@dataclass(eq=False)
class Unpadding:
    """What the encoder gets of a batch unpadded on the GPU: its ``fields`` (top-level name ->
    ``Unpadded``) and the ``[B, T]`` bool token mask of each mask field they were selected by
    (``masks``; None for a mask holding other values than 0/1), read instead of the mask's values."""

    fields: dict[str, Unpadded]
    masks: dict[str, torch.Tensor | None]


def encode(enc: TableBuilder, lay: Layout, f: Tensor, u: Unpadded) -> Any:
    """``tensors.encode`` of field ``f``, whose tokens ``u`` holds: stored from them where the field
    is stored as the tokens of the group ``u`` was selected by, else from its whole tensor."""
    g = lay.groups[f.group] if f.role == TOKENS and f.group is not None else None
    if g is not None and g.side and not g.holes and not f.last and u.follows(g.src, g.lo, g.W):
        node: TensorNode = tensors.encode_selected(enc, lay, f, u.values, u.padvals, u.pad, u.width)
        return node
    return tensors.encode(enc, lay, f, u.full())  # stored another way than as its tokens
