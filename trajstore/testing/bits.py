"""Tensors and numpy arrays of arbitrary bits (NaN payloads, -0.0, inf included) of every dtype trajstore
stores, and the masks and padded values the batch forms are built from."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from hypothesis import strategies as st

TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64]
NUMPY_DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16, np.float32,
                np.float64, np.uint16, np.uint32, np.uint64]


def _random_bits(seed: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, -0.0, inf included) of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, size), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape) if shape else raw.view(dtype).reshape(())


@st.composite
def tensors(draw: st.DrawFn, shape: tuple, dtypes: Sequence[torch.dtype] = TORCH_DTYPES,
            numpy: bool | None = False) -> torch.Tensor | np.ndarray:
    """A tensor (or numpy array when ``numpy``) of ``shape`` holding arbitrary bits."""
    use_np = draw(st.booleans()) if numpy is None else numpy
    seed = draw(st.integers(0, 2**31 - 1))
    if use_np:
        dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
        rng = np.random.default_rng(seed)
        if dtype == np.bool_:
            return rng.integers(0, 2, shape).astype(bool)
        return rng.integers(0, 256, (*shape, dtype.itemsize), dtype=np.uint8).view(dtype).reshape(shape)
    return _random_bits(seed, tuple(shape), draw(st.sampled_from(list(dtypes))))


def padded_values(draw: st.DrawFn, mask: torch.Tensor, dtypes: Sequence[torch.dtype]) -> torch.Tensor:
    """A tensor shaped like ``mask`` of arbitrary bits whose padded positions hold one pad value, or (sometimes)
    values of their own (non-constant padding)."""
    x = draw(tensors(tuple(mask.shape), dtypes))
    if draw(st.booleans()):
        pad = draw(tensors((), [x.dtype]))
        x = torch.where(mask, x, pad)
    return x


def run_mask(draw: st.DrawFn, B: int, W: int, side: str) -> torch.Tensor:
    """A [B, W] bool mask with one run of tokens per row, right / left aligned or anywhere."""
    ar = torch.arange(W)
    rows = []
    for _ in range(B):
        n = draw(st.integers(0, W))
        start = {"right": 0, "left": W - n}.get(side) if side != "span" else draw(st.integers(0, W - n))
        rows.append((ar >= start) & (ar < start + n))
    return torch.stack(rows) if rows else torch.zeros(0, W, dtype=torch.bool)
