"""dtype mapping: torch/numpy dtypes <-> names <-> Arrow storage types.

Every tensor is held in memory as a numpy array of its *storage* dtype (bfloat16 as its raw
uint16 bits) and stored in a Parquet column of its *column* type; the logical dtype name travels
in field metadata (``trajstore.dtype``). From format version 3 the half-precision dtypes
(bfloat16, float16) are stored widened to float32, exactly (``widen`` / ``narrow``), so that any
Parquet reader shows their numbers; files of versions 1 and 2 hold bfloat16 as uint16 bits and
float16 as Arrow halffloat (docs/FORMAT.md 3.2). From format version 6 a token column of int64
values that all fit in 32 bits is stored as int32 (``arrow.TableBuilder.add``; restored to int64 by
``narrow``): a smaller column, cheaper to encode and decode (docs/FORMAT.md 3.2).
"""

from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    import torch

# torch is imported by the functions that make or read tensors, not here: `trajstore info`, `sql` and
# `verify` read dumps through this module without loading torch (docs/CLI.md).
# name -> (torch dtype's attribute name or None, numpy storage dtype, arrow storage type)
_TABLE: dict[str, tuple[str | None, np.dtype, pa.DataType]] = {
    "bool": ("bool", np.dtype(np.bool_), pa.bool_()),
    "uint8": ("uint8", np.dtype(np.uint8), pa.uint8()),
    "int8": ("int8", np.dtype(np.int8), pa.int8()),
    "int16": ("int16", np.dtype(np.int16), pa.int16()),
    "int32": ("int32", np.dtype(np.int32), pa.int32()),
    "int64": ("int64", np.dtype(np.int64), pa.int64()),
    "float16": ("float16", np.dtype(np.float16), pa.float16()),
    "bfloat16": ("bfloat16", np.dtype(np.uint16), pa.uint16()),
    "float32": ("float32", np.dtype(np.float32), pa.float32()),
    "float64": ("float64", np.dtype(np.float64), pa.float64()),
    # numpy-only unsigned types
    "uint16": (None, np.dtype(np.uint16), pa.uint16()),
    "uint32": (None, np.dtype(np.uint32), pa.uint32()),
    "uint64": (None, np.dtype(np.uint64), pa.uint64()),
}
NUMPY_NAMES = {v[1]: k for k, v in _TABLE.items() if k != "bfloat16"}
_TORCH: dict[str, Any] = {}  # TORCH_NAMES (torch dtype -> name) and _BITS, made on first use (__getattr__)


def __getattr__(name: str) -> Any:
    """``TORCH_NAMES`` (torch dtype -> name) and ``_BITS`` (element size -> same-width integer dtype,
    to compare and fill raw bits), built when first asked for: they need torch."""
    if name not in ("TORCH_NAMES", "_BITS"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _TORCH:
        import torch

        _TORCH["TORCH_NAMES"] = {getattr(torch, v[0]): k for k, v in _TABLE.items() if v[0] is not None}
        _TORCH["_BITS"] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        globals().update(_TORCH)  # later lookups are plain module attributes
    return _TORCH[name]


def names() -> list[str]:
    return list(_TABLE)


def torch_dtype(name: str) -> torch.dtype:
    import torch

    attr = _TABLE[name][0]
    if attr is None:
        raise KeyError(name)
    return getattr(torch, attr)


def numpy_dtype(name: str) -> np.dtype:
    """numpy dtype of the *logical* type (bfloat16 has none)."""
    if name == "bfloat16":
        raise KeyError(name)
    return _TABLE[name][1]


def storage_numpy(name: str) -> np.dtype:
    return _TABLE[name][1]


HALF = ("bfloat16", "float16")  # stored widened to float32 from format version 3
WIDE_VERSION = 3


NARROW_VERSION = 6  # int64 token values stored as int32 where every value of the column fits
_NARROW = {"int64": np.dtype(np.int32)}
# dtype -> the other numpy type its values may be read in from a column (``is_wide``; ``narrow`` restores)
_STORED_AS = {**{h: np.dtype(np.float32) for h in HALF}, **_NARROW}


def arrow_type(name: str, version: int = WIDE_VERSION) -> pa.DataType:
    """The Arrow type of a column of dtype ``name`` in a file of format ``version`` (default: the
    files this library writes; a token column of int64 may also be int32: ``list_types``)."""
    if name in HALF and version >= WIDE_VERSION:
        return pa.float32()
    return _TABLE[name][2]


def list_types(name: str, version: int = WIDE_VERSION) -> tuple[pa.DataType, ...]:
    """The value types a large_list tensor column of dtype ``name`` may have in a file of format
    ``version``: ``arrow_type``'s, and from version 6 int32 for int64 (a token column whose values fit)."""
    want = arrow_type(name, version)
    if name in _NARROW and version >= NARROW_VERSION:
        return want, pa.from_numpy_dtype(_NARROW[name])
    return (want,)


def is_wide(name: str, a: np.ndarray) -> bool:
    """Whether ``a`` holds values of dtype ``name`` in another type than its storage dtype, as read
    from a column: half values widened to float32, or int64 values narrowed to int32 (``narrow``
    restores either)."""
    other = _STORED_AS.get(name)  # (not ``a.dtype == None``: numpy reads None as float64)
    return other is not None and a.dtype == other


def is_wide_type(name: str, t: pa.DataType) -> bool:
    """``is_wide`` for a column's Arrow value type."""
    other = _STORED_AS.get(name)
    return other is not None and t == pa.from_numpy_dtype(other)


def widen(a: np.ndarray, name: str) -> np.ndarray:
    """Half-precision storage (bfloat16 bits, float16) as float32 holding the same numbers, every
    bit kept: a bfloat16 is the high half of its float32; a float16 converts exactly (its NaN
    payloads are set by bits, so a converter that quiets signalling NaNs changes nothing)."""
    if name == "bfloat16":
        out = a.view(np.uint16).astype(np.uint32)
        out <<= 16
        return out.view(np.float32)
    out = a.astype(np.float32)
    nan = np.isnan(a)
    if nan.any():
        h = a[nan].view(np.uint16).astype(np.uint32)
        out.view(np.uint32)[nan] = ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13)
    return out


def narrow(a: np.ndarray, name: str, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of ``widen``: float32 values as half storage (into ``out`` if given), vectorized. A
    value no half holds exactly (a file that lies) rounds; it never fails. int32 values of an int64
    token column (format version 6) come back as int64, exactly."""
    if out is None:
        out = np.empty(a.shape, storage_numpy(name))
    if name in _NARROW:
        out[...] = a
        return out
    if name == "bfloat16":
        np.right_shift(a.view(np.uint32), 16, out=out.view(np.uint16), casting="unsafe")
        return out
    out[...] = a
    nan = np.isnan(a)
    if nan.any():
        f = a[nan].view(np.uint32)
        m = (f >> 13) & 0x3FF
        h = ((f >> 16) & 0x8000) | 0x7C00 | m | (m == 0)  # a NaN stays a NaN
        out.view(np.uint16)[nan] = h.astype(np.uint16)
    return out


def known(name: str) -> bool:
    return name in _TABLE


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as a same-width integer tensor (no copy)."""
    import torch

    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(__getattr__("_BITS")[t.element_size()])


def to_storage(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array of its storage dtype (no copy)."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_storage(a: np.ndarray, name: str) -> torch.Tensor:
    """A numpy array of storage dtype as a tensor of logical dtype ``name`` (no copy)."""
    import torch

    if name == "bfloat16":
        a = a.view(np.int16)
    t = torch.from_numpy(a) if _read_only_quiet or a.flags.writeable else _quiet_from_numpy(a)
    return t.view(torch.bfloat16) if name == "bfloat16" else t


_read_only_quiet = False  # torch has given its warning about read-only arrays (``_quiet_from_numpy``)
_quiet_lock = threading.Lock()


def _quiet_from_numpy(a: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy`` of a read-only array (Arrow's buffers are immutable, the tensor owns a view of
    them) without torch's UserWarning about it. torch gives that warning once a process, so it is taken
    here once, under a lock, inside ``warnings.catch_warnings``; later arrays are converted without
    touching the warning filters. (``catch_warnings`` on every call, from the prefetch threads decoding
    at once, is not thread-safe: interleaved, it left an "ignore UserWarning" filter behind, silencing the
    program's warnings.) A torch that warns every time keeps the lock and the filter on every call."""
    import torch

    global _read_only_quiet
    with _quiet_lock:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            t = torch.from_numpy(a)
            first = len(seen)
            torch.from_numpy(a)
        ours = [i for i, w in enumerate(seen) if _TORCH_READ_ONLY in str(w.message)]
        _read_only_quiet = not any(i >= first for i in ours)  # the second conversion said nothing
        for i, w in enumerate(seen):  # another thread's warning caught in passing: shown as it would be
            if i not in ours:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return t


_TORCH_READ_ONLY = "NumPy array is not writable"


def as_value(a: np.ndarray, node: dict):
    """A storage numpy array (or a column's widened float32 values) as the value type a spec node names (``lib`` torch, numpy or np_scalar)."""
    if is_wide(node["dtype"], a):
        a = narrow(a, node["dtype"])
    if node["lib"] == "torch":
        return from_storage(a, node["dtype"])
    r = a.view(numpy_dtype(node["dtype"]))
    return r[()] if node["lib"] == "np_scalar" else r
