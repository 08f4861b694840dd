"""A step's large_list columns joined while the Parquet reader is still decoding the step
(``StreamJoin``): what ``Columns`` (``format/arrow.py``) would join after the read, started row group
by row group as the reader yields them (``format/file/parquet.py`` ``read_columns(on_batch=)``), so
a read to host memory joins only its last row group after the decode (benchmarks/RESULTS.md)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ...base.threads import submit
from .. import dtypes as dt
from .. import limits
from ..arrow import _offsets, empty, to_numpy

__all__ = ["StreamJoin"]


class StreamJoin:
    """The values of large_list columns joined while the Parquet reader is still decoding: each
    record batch (one row group) handed to ``feed`` as it arrives has its values copied into the
    column's joined buffer on the shared pool, so the copies of the first row groups overlap the
    decode of the last ones (a read then joins only the last row group's values). ``parts(table)``
    waits for the copies and gives ``Columns`` the joined values of the table read from those
    batches.

    A column's buffer is sized from its first batch (values per row, times the step's rows, plus a
    quarter); one that outgrows it moves to a buffer twice as large. A column whose values need a
    conversion (half-precision values stored widened) or that ``feed`` cannot take (nulls, another
    type: the normal join raises the error that names it) is left out: ``Columns`` joins it as
    before. Only values as the column holds them are copied, so the result is the normal join's."""

    def __init__(self, names: list[tuple[str, str]], rows: int) -> None:
        self.want = dict(names)  # column -> spec dtype
        self.rows = max(1, int(rows))
        self._out: dict[str, np.ndarray] = {}
        self._pos: dict[str, int] = {}
        self._pending: dict[str, list] = {}
        self._batches = 0

    def feed(self, batch: pa.RecordBatch) -> None:
        """Start copying one record batch's values of the wanted columns into their buffers."""
        self._batches += 1
        for name in list(self.want):
            if batch.schema.get_field_index(name) < 0:
                del self.want[name]
                continue
            try:
                self._feed(name, batch.column(name))
            except Exception:  # noqa: BLE001 - left to Columns' join, which raises the error naming it
                self._drop(name)

    def _feed(self, name: str, a: pa.Array) -> None:
        dtype = self.want[name]
        if not pa.types.is_large_list(a.type) or a.null_count:
            raise ValueError(name)
        o = a.offsets.to_numpy()
        lo, hi = (int(o[0]), int(o[-1])) if len(o) else (0, 0)
        vals = a.values.slice(lo, hi - lo)
        boolean = dtype == "bool" and pa.types.is_boolean(vals.type)
        want = dt.storage_numpy(dtype)
        if vals.null_count or (not boolean and (vals.type.bit_width % 8 or
                                                np.dtype(vals.type.to_pandas_dtype()) != want)):
            raise ValueError(name)  # widened half values, or not what the spec says
        n = len(vals)
        out = self._room(name, n, len(a), want)
        p = self._pos[name]
        self._pos[name] = p + n
        if n:
            f = submit(_copy_values, out[p:p + n], vals, boolean)
            if f is not None:
                self._pending[name].append(f)

    def _room(self, name: str, n: int, rows: int, dtype: Any) -> np.ndarray:
        """The column's buffer, grown where ``n`` more values do not fit."""
        dtype = np.dtype(dtype)
        out = self._out.get(name)
        if out is None:
            cap = n * self.rows // max(1, rows) + self.rows  # this batch's values per row, every row
            cap += cap // 4 + 64
            if cap * dtype.itemsize > limits.MAX_DECODED_BYTES:  # a first row group far off the rest
                raise ValueError(name)  # (or a damaged file): the join after the read, with its checks
            out = self._out[name] = empty(cap, dtype)
            self._pos[name], self._pending[name] = 0, []
        p = self._pos[name]
        if p + n > len(out):
            _wait(self._pending[name])
            self._pending[name] = []
            if 2 * (p + n) * dtype.itemsize > limits.MAX_DECODED_BYTES:
                raise ValueError(name)
            grown = empty(2 * (p + n), dtype)
            grown[:p] = out[:p]
            out = self._out[name] = grown
        return out

    def _drop(self, name: str) -> None:
        self.want.pop(name, None)
        self._out.pop(name, None)
        self._pos.pop(name, None)
        self._pending.pop(name, None)  # copies still running write into the dropped buffer only

    def parts(self, table: pa.Table) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{column: (offsets, values)}`` of the columns joined, for ``Columns(..., joined=)``;
        ``table`` is the one read from the fed batches (a column whose chunks are not exactly those
        batches is left out)."""
        out = {}
        for name in list(self._out):
            try:
                _wait(self._pending[name])
            except Exception:  # noqa: BLE001 - Columns joins it again and raises what it finds
                continue
            if name not in table.column_names or table.column(name).num_chunks != self._batches:
                continue
            off = _offsets(table.column(name).chunks)
            if int(off[-1]) != self._pos[name]:
                continue
            out[name] = (off, self._out[name][:self._pos[name]])
        return out


def _copy_values(dst: np.ndarray, vals: pa.Array, boolean: bool) -> None:
    dst[...] = to_numpy(vals) if boolean else vals.to_numpy(zero_copy_only=True)


def _wait(futures: list) -> None:
    for f in futures:
        f.result()
