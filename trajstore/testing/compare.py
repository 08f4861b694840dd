"""An exact comparison of two batches: the same structure, types, dtypes, shapes, key orders and bits."""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..format.dtypes import bits_view


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def assert_batch_equal(a: Any, b: Any, path: str = "batch") -> None:
    """Assert ``a`` and ``b`` are the same structure with bit-identical contents."""
    assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if all(hasattr(a, k) for k in ("batch", "non_tensor_batch", "meta_info")) and not isinstance(a, Mapping):
        for k in ("batch", "non_tensor_batch", "meta_info"):  # a DataProto-like batch
            assert_batch_equal(getattr(a, k), getattr(b, k), f"{path}.{k}")
    elif hasattr(a, "batch_size") and hasattr(a, "to_dict"):  # a TensorDict
        assert list(a.batch_size) == list(b.batch_size), f"{path}: batch_size {a.batch_size} != {b.batch_size}"
        assert_batch_equal(dict(a.items()), dict(b.items()), path)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        ac, bc = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
        assert torch.equal(bits_view(ac), bits_view(bc)), f"{path}: values differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        if a.dtype == object:
            for i, (x, y) in enumerate(zip(a.reshape(-1), b.reshape(-1))):
                assert_batch_equal(x, y, f"{path}[{i}]")
        else:
            assert a.tobytes() == b.tobytes(), f"{path}: values differ"
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, Mapping):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_batch_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_batch_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert _float_bits(a) == _float_bits(b) or (math.isnan(a) and math.isnan(b)), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
