"""Arrow arrays seen as numpy, for reading a decoded table (``arrow.Columns``, the joins, the late conversions):
zero-copy views of a column's values and offsets, checked against the dtype the spec names (what pyarrow holds is
untrusted input: a mismatch is a ``FormatError`` naming the column)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import FormatError
from . import dtypes as dt

__all__ = ["empty", "to_numpy", "unpack_bits"]


def empty(n: int, dtype: Any) -> np.ndarray:
    """An uninitialized numpy array in memory from Arrow's allocator, which hands out pages it
    freed earlier still mapped: filling a fresh ``np.empty`` page-faults on every page
    (measured on the GPU host: benchmarks/RESULTS.md)."""
    dtype = np.dtype(dtype)
    return np.frombuffer(pa.allocate_buffer(max(1, n * dtype.itemsize)), dtype, count=n)


def to_numpy(a: pa.Array) -> np.ndarray:
    """A null-free Arrow array as numpy: numbers a zero-copy view of the data buffer, taken without
    pyarrow's conversion, which releases and retakes the GIL on every call (a wait each time several
    steps decode at once: benchmarks/RESULTS.md); bools are unpacked from the bitmap with
    ``np.unpackbits``, much faster than Arrow's conversion (benchmarks/RESULTS.md)."""
    t = a.type
    if len(a) and not a.null_count:
        if pa.types.is_integer(t) or pa.types.is_floating(t):
            d = np.dtype(t.to_pandas_dtype())
            return np.frombuffer(a.buffers()[1], d, count=len(a), offset=a.offset * d.itemsize)
        if pa.types.is_boolean(t):
            return unpack_bits(np.frombuffer(a.buffers()[1], np.uint8), a.offset, len(a))
    return a.to_numpy(zero_copy_only=False)


def unpack_bits(bits: np.ndarray, shift: int, n: int) -> np.ndarray:
    """``n`` bools of an Arrow bitmap's bytes (least significant bit first), from bit ``shift``."""
    return np.unpackbits(bits, count=shift + n, bitorder="little")[shift:].view(np.bool_)


def _offsets(chunks: list) -> np.ndarray:
    """The row offsets of a chunked large_list column, counted from 0 across its chunks."""
    rows = sum(len(c) for c in chunks)
    off = np.empty(rows + 1, np.int64)
    off[0] = r = p = 0
    for c in chunks:
        o = to_numpy(c.offsets)
        off[r + 1:r + len(o)] = o[1:] - o[0] + p
        r, p = r + len(o) - 1, p + int(o[-1] - o[0])
    return off


def _raw(vals: pa.Array, dtype: str, name: str, where: str) -> np.ndarray:
    """A tensor's values as numpy (``to_numpy``), as the column holds them (no nulls): the storage
    dtype the spec names, or float32 for a half dtype (widened, ``validate`` checked which)."""
    if vals.null_count:
        raise FormatError(f"{where}: column {name!r} holds null values inside a tensor")
    v = to_numpy(vals)
    if v.dtype != dt.storage_numpy(dtype) and not dt.is_wide(dtype, v):
        raise FormatError(f"{where}: column {name!r} stores {v.dtype}, spec says {dtype}")
    return v


def _checked(vals: pa.Array, dtype: str, name: str, where: str) -> np.ndarray:
    """A tensor's values as numpy of the storage dtype the spec names (``_raw``, widened half
    values narrowed back)."""
    v = _raw(vals, dtype, name, where)
    if dt.is_wide(dtype, v):
        return dt.narrow(v, dtype)
    if v.dtype != dt.storage_numpy(dtype):
        raise FormatError(f"{where}: column {name!r} stores {v.dtype}, spec says {dtype}")
    return v


def _sliced(c: pa.Array) -> pa.Array:
    """The values of one large_list chunk's rows (a chunk may be a slice of a longer values array)."""
    o = to_numpy(c.offsets)
    a, b = (int(o[0]), int(o[-1])) if len(o) else (0, 0)
    return c.values.slice(a, b - a)


def _values(c: pa.Array, dtype: str, name: str, where: str) -> np.ndarray:
    """The values of one large_list chunk, as numpy (zero-copy but for bools), checked."""
    return _checked(_sliced(c), dtype, name, where)
