"""A step's large_list columns joined while the Parquet reader is still decoding the step
(``StreamJoin``): what ``Columns`` (``format/arrow.py``) would join after the read, started row group
by row group as the reader yields them (``format/file/parquet.py`` ``read_columns(on_batch=)``), so
a read to host memory joins only its last row group after the decode (benchmarks/RESULTS.md)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
import pyarrow as pa

from ...base.threads import submit
from .. import dtypes as dt
from .. import limits
from ..numpy_view import _offsets, _raw, _sliced, empty, to_numpy

__all__ = ["StreamJoin"]


class StreamJoin:
    """The values of large_list columns joined while the Parquet reader is still decoding: each
    record batch (one row group) handed to ``feed`` as it arrives has its values copied into the
    column's joined buffer on the shared pool, so the copies of the first row groups overlap the
    decode of the last ones (a read then joins only the last row group's values). ``parts(table)``
    waits for the copies and gives ``Columns`` the joined values of the table read from those
    batches.

    A column's buffer is sized from its first batch (values per row, times the step's rows, plus a
    quarter); one that outgrows it moves to a buffer twice as large; a buffer over the decode limit
    (``limits.MAX_DECODED_BYTES``) is not allocated. A column whose values need a bit-level conversion
    (half-precision values stored widened) or that the join's own checks refuse (``numpy_view._raw``:
    nulls, another dtype) is left out: ``Columns`` joins it after the read, converting it or raising
    the error that names it. Values are copied as the column holds them (int32 values of an int64
    column, format version 6, widened by the copy), so the result is the normal join's."""

    def __init__(self, names: list[tuple[str, str]], rows: int) -> None:
        self.want = dict(names)  # column -> spec dtype, while it is still joined here
        self.rows = max(1, int(rows))
        self._cols: dict[str, _Joined] = {}
        self._batches = 0

    def feed(self, batch: pa.RecordBatch) -> None:
        """Start copying one record batch's values of the wanted columns into their buffers."""
        self._batches += 1
        for name in list(self.want):
            try:
                self._feed(name, batch.column(name))
            except Exception:  # noqa: BLE001 - absent or refused: left to Columns' join after the read
                del self.want[name]
                self._cols.pop(name, None)  # copies still running write into the dropped buffer only

    def _feed(self, name: str, a: pa.Array) -> None:
        dtype = self.want[name]
        if not pa.types.is_large_list(a.type) or a.null_count:
            raise ValueError(name)
        vals = _sliced(a)
        want = np.dtype(dt.storage_numpy(dtype))
        if dtype == "bool" and pa.types.is_boolean(vals.type) and not vals.null_count:
            src: Any = vals  # unpacked from its bitmap by the copy, on the pool
        else:
            src = _raw(vals, dtype, name, name)  # the join's checks; numbers zero-copy
            if src.dtype != want and dtype in dt.HALF:
                raise ValueError(name)  # widened half values: the join after the read narrows them
            # (int32 values of an int64 column, format version 6, are widened by the copy's assignment)
        n = len(vals)
        col = self._room(name, n, len(a), want)
        p, col.pos = col.pos, col.pos + n
        if n:
            f = submit(_copy_values, col.out[p:p + n], src)
            if f is not None:
                col.pending.append(f)

    def _room(self, name: str, n: int, rows: int, dtype: np.dtype) -> _Joined:
        """The column's buffer, grown where ``n`` more values do not fit."""
        col = self._cols.get(name)
        if col is None:
            cap = n * self.rows // max(1, rows) + self.rows  # this batch's values per row, every row
            col = self._cols[name] = _Joined(_allocate(name, cap + cap // 4 + 64, dtype))
        if col.pos + n > len(col.out):
            col.wait()
            grown = _allocate(name, 2 * (col.pos + n), dtype)
            grown[:col.pos] = col.out[:col.pos]
            col.out = grown
        return col

    def parts(self, table: pa.Table) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{column: (offsets, values)}`` of the columns joined, for ``Columns(..., joined=)``;
        ``table`` is the one read from the fed batches (a column whose chunks are not exactly those
        batches is left out)."""
        out = {}
        for name, col in self._cols.items():
            try:
                col.wait()
            except Exception:  # noqa: BLE001 - Columns joins it again and raises what it finds
                continue
            if name not in table.column_names or table.column(name).num_chunks != self._batches:
                continue
            off = _offsets(table.column(name).chunks)
            if int(off[-1]) == col.pos:
                out[name] = (off, col.out[:col.pos])
        return out


class _Joined:
    """One column's joined buffer, how many values are in it, and the copies still filling it."""

    __slots__ = ("out", "pos", "pending")

    def __init__(self, out: np.ndarray) -> None:
        self.out, self.pos = out, 0
        self.pending: list[Future] = []

    def wait(self) -> None:
        pending, self.pending = self.pending, []
        for f in pending:
            f.result()


def _allocate(name: str, n: int, dtype: np.dtype) -> np.ndarray:
    if n * dtype.itemsize > limits.MAX_DECODED_BYTES:  # a first row group far off the rest, or a damaged
        raise ValueError(name)  # file: the join after the read, with its checks
    return empty(n, dtype)


def _copy_values(dst: np.ndarray, src: Any) -> None:
    dst[...] = to_numpy(src) if isinstance(src, pa.Array) else src
