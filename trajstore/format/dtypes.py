"""dtype mapping: torch/numpy dtypes <-> names <-> Arrow storage types.

Every stored tensor value is a flat Arrow array of its *storage* type; the
logical dtype name travels in field metadata (``trajstore.dtype``).  bfloat16
has no Arrow type and is stored as its raw bits (uint16).
"""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import torch

# name -> (torch dtype or None, numpy storage dtype, arrow storage type)
_TABLE: dict[str, tuple[torch.dtype | None, np.dtype, pa.DataType]] = {
    "bool": (torch.bool, np.dtype(np.bool_), pa.bool_()),
    "uint8": (torch.uint8, np.dtype(np.uint8), pa.uint8()),
    "int8": (torch.int8, np.dtype(np.int8), pa.int8()),
    "int16": (torch.int16, np.dtype(np.int16), pa.int16()),
    "int32": (torch.int32, np.dtype(np.int32), pa.int32()),
    "int64": (torch.int64, np.dtype(np.int64), pa.int64()),
    "float16": (torch.float16, np.dtype(np.float16), pa.float16()),
    "bfloat16": (torch.bfloat16, np.dtype(np.uint16), pa.uint16()),
    "float32": (torch.float32, np.dtype(np.float32), pa.float32()),
    "float64": (torch.float64, np.dtype(np.float64), pa.float64()),
    # numpy-only unsigned types
    "uint16": (None, np.dtype(np.uint16), pa.uint16()),
    "uint32": (None, np.dtype(np.uint32), pa.uint32()),
    "uint64": (None, np.dtype(np.uint64), pa.uint64()),
}
TORCH_NAMES = {v[0]: k for k, v in _TABLE.items() if v[0] is not None}
NUMPY_NAMES = {v[1]: k for k, v in _TABLE.items() if k != "bfloat16"}
# same-width integer dtype used to compare and fill raw bits
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def names() -> list[str]:
    return list(_TABLE)


def torch_dtype(name: str) -> torch.dtype:
    dt = _TABLE[name][0]
    if dt is None:
        raise KeyError(name)
    return dt


def numpy_dtype(name: str) -> np.dtype:
    """numpy dtype of the *logical* type (bfloat16 has none)."""
    if name == "bfloat16":
        raise KeyError(name)
    return _TABLE[name][1]


def storage_numpy(name: str) -> np.dtype:
    return _TABLE[name][1]


def arrow_type(name: str) -> pa.DataType:
    return _TABLE[name][2]


def known(name: str) -> bool:
    return name in _TABLE


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as a same-width integer tensor (no copy)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(_BITS[t.element_size()])


def to_storage(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array of its storage dtype (no copy)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_storage(a: np.ndarray, name: str) -> torch.Tensor:
    """A numpy array of storage dtype as a tensor of logical dtype ``name`` (no copy)."""
    if name == "bfloat16":
        a = a.view(np.int16)
    with warnings.catch_warnings():  # Arrow buffers are read-only but owned by this result
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if name == "bfloat16" else t


def as_value(a: np.ndarray, node: dict):
    """A storage numpy array as the value type a spec node names (``lib`` torch, numpy or np_scalar)."""
    if node["lib"] == "torch":
        return from_storage(a, node["dtype"])
    r = a.view(numpy_dtype(node["dtype"]))
    return r[()] if node["lib"] == "np_scalar" else r
