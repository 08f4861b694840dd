"""How the tokens of a dict batch are laid out: which positions of a ``[B, T, ...]`` mask hold a token."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["token_mask"]


def token_mask(m: torch.Tensor | np.ndarray) -> torch.Tensor:
    """The ``[B, T]`` bool mask of an attention mask of shape ``[B, T, ...]``: a token is valid where
    every one of its entries is non-zero (the one rule the encoder, the recorder and the
    inspection tools share)."""
    t = torch.as_tensor(m) != 0
    while t.ndim > 2:
        t = t.all(dim=-1)
    return t
