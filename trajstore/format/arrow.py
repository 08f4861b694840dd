"""Arrow <-> numpy for the codecs: building a step's table (``TableBuilder``, ``ColumnNames``,
``list_array``) and reading a decoded table's columns back as checked numpy arrays (``Columns``; the
arrays themselves as numpy: ``numpy_view.py``, whose names are also found here).

Reading treats the table as untrusted input: what pyarrow raises is mapped to ``FormatError``
naming the file (``errors.foreign_errors``), and every value array is checked against the dtype
the spec names before it is used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from ..base.threads import PIECE_BYTES, balance, is_serial, pieces, run_parallel
from ..errors import BatchError, FormatError, foreign_errors
from . import dtypes as dt
from .spec import COMPANION_PREFIXES, RESERVED, STEP_COLUMN, where
from .numpy_view import _checked, _offsets, _raw, _sliced, _values, empty, to_numpy
from .values import check_str, dumps

__all__ = ["ColumnNames", "TableBuilder", "list_array", "Columns"]

Alloc = Callable[[int, Any], np.ndarray]  # (count, numpy dtype) -> uninitialized 1-D array


# ----------------------------------------------------------------------------- writing
class ColumnNames:
    """The column names a step's fields take, claimed in the order the encoder adds them."""

    def __init__(self) -> None:
        self.used: set[str] = set()

    def claim(self, name: str, path: tuple, companion: bool = False) -> None:
        """Claim column ``name`` for the field at ``path``, or for one of its ``companion`` columns
        (``__shape__<col>``...: a field's own column may not start like one)."""
        check_str(name, f"field {where(path)!r} name")
        if name in RESERVED or name in self.used or not companion and name.startswith(COMPANION_PREFIXES):
            raise BatchError(
                f"field {where(path)!r}: column name {name!r} is reserved or already used (names starting with "
                f"{', '.join(COMPANION_PREFIXES)} are trajstore's companion columns); rename the field"
            )
        self.used.add(name)


_NULLABLE_KINDS = ("value", "json", "cell", "shape")
NARROW_TOKENS = True  # int64 token-id (and cell) columns whose values fit are stored as int32 (format version 6)
ID_FIELDS = ("responses", "prompts", "sequences", "tokens")  # ids by name, besides "...ids" / "..._id"


def is_id_field(path: tuple) -> bool:
    """Whether the field at ``path`` holds identifiers (token ids, position ids) by its name: ``input_ids``,
    ``prompt_ids``, ``completion_ids``, ``position_ids``, ``..._id``, and verl's ``responses`` /
    ``prompts``, OpenRLHF's ``sequences``. Only such int64 fields are stored as int32 (3.2): arithmetic on
    identifiers means nothing, while a reader that sums an int32 column in 32 bits (Polars does, and
    wraps) would give a wrong sum of counts or timestamps stored so."""
    leaf = str(path[-1]) if path else ""
    return leaf.endswith(("ids", "_id")) or leaf in ID_FIELDS


def is_position_column(name: str) -> bool:
    """Whether column ``name`` holds positions by its field's name (``position_ids``, ``positions``):
    runs counting up from 0 in every row, which zstd compresses well as PLAIN values and a dictionary
    does not (docs/FORMAT.md 3.5)."""
    return name.rsplit(".", 1)[-1].startswith("position")


class TableBuilder:
    """The columns of one step's table, in order, each with its trajstore field metadata."""

    def __init__(self, n: int, names: ColumnNames) -> None:
        self.n = n
        self.names = names  # pad columns are claimed while encoding (they depend on values)
        self.fields: list[pa.Field] = []
        self.arrays: list[pa.Array] = []
        self.version = 1  # the lowest format version that reads what was added (``needs``)
        self.memo: dict = {}  # what one step's encode computes once and several fields share (codec/tensors.py)

    def needs(self, version: int) -> None:
        """Record that the step uses a construct of format ``version`` (docs/FORMAT.md section 5)."""
        self.version = max(self.version, version)

    def add(self, name: str, arr: pa.Array, meta: dict[str, str], path: tuple) -> None:
        """Append column ``name`` (claimed beforehand) of one row per trajectory. Half-precision
        values (``meta["dtype"]`` bfloat16 / float16) are stored widened to float32, which every
        Parquet reader shows as numbers (format version 3, docs/FORMAT.md 3.2). A token column (or a
        list batch's cell column) of int64 identifiers (``is_id_field``) whose values all fit in 32
        bits is stored as int32 (format version 6, 3.2), the numbers unchanged, ``meta["dtype"]``
        still int64."""
        if len(arr) != self.n:
            raise BatchError(f"field {where(path)!r}: has {len(arr)} rows, the batch has {self.n}")
        if meta.get("dtype") in dt.HALF:
            arr = _widened(arr, meta["dtype"])
            self.needs(dt.WIDE_VERSION)
        elif NARROW_TOKENS and meta.get("kind") in ("token", "cell") and meta.get("dtype") == "int64" \
                and is_id_field(path):
            narrowed = _narrowed(arr)
            if narrowed is not None:
                arr = narrowed
                self.needs(dt.NARROW_VERSION)
        nullable = arr.null_count > 0 or meta.get("kind") in _NULLABLE_KINDS
        self.fields.append(pa.field(name, arr.type, nullable=nullable,
                                    metadata={f"trajstore.{k}": v for k, v in meta.items()}))
        self.arrays.append(arr)

    def table(self, step: int, doc: dict) -> pa.Table:
        """The step's table: the ``step`` column, then every field column; ``doc`` in the metadata."""
        step_col = pa.array(np.full(self.n, step, dtype=np.int64))
        schema = pa.schema([pa.field(STEP_COLUMN, pa.int64())] + self.fields, metadata={"trajstore": dumps(doc)})
        return pa.Table.from_arrays([step_col] + self.arrays, schema=schema)


def list_array(offsets: np.ndarray, values: np.ndarray, mask: np.ndarray | None = None) -> pa.Array:
    """A ``large_list`` array of ``values`` cut at ``offsets``; rows where ``mask`` is set are null."""
    off = pa.array(np.asarray(offsets, dtype=np.int64))
    vals = pa.array(values) if values.dtype != np.bool_ or values.ndim != 1 else pa.Array.from_buffers(
        pa.bool_(), len(values), [None, pa.py_buffer(np.packbits(values, bitorder="little"))])  # 8x pa.array's
    if mask is not None and mask.any():
        return pa.LargeListArray.from_arrays(off, vals, mask=pa.array(mask))
    # no nulls: the values are declared non-nullable, so Parquet has no per-value null state to
    # record, and a reader none to decode
    return pa.LargeListArray.from_arrays(off, vals, type=pa.large_list(pa.field("element", vals.type, nullable=False)))


def _widened(arr: pa.Array, name: str) -> pa.Array:
    """A column of half-precision storage (a primitive or ``large_list`` array, as built by the
    codecs) with its values widened to float32, nulls and offsets kept."""
    if not pa.types.is_large_list(arr.type):
        return pa.array(dt.widen(arr.to_numpy(zero_copy_only=False), name))
    o = arr.offsets.to_numpy()
    vals = arr.values.slice(int(o[0]), int(o[-1] - o[0])).to_numpy(zero_copy_only=False) if len(o) else []
    out = list_array(o - o[0], dt.widen(np.asarray(vals, dt.storage_numpy(name)), name),
                     arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else None)
    return out


def _narrowed(arr: pa.Array) -> pa.Array | None:
    """A large_list<int64> column as large_list<int32> when every value fits (Arrow's checked cast:
    one pass, offsets and null rows kept), else None."""
    if not pa.types.is_large_list(arr.type) or arr.type.value_type != pa.int64():
        return None
    try:
        return arr.cast(pa.large_list(pa.field("element", pa.int32(), nullable=arr.type.value_field.nullable)))
    except (pa.ArrowInvalid, OverflowError):  # a value needs 64 bits: the column stays int64
        return None


# ----------------------------------------------------------------------------- reading
class Columns:
    """Access to a decoded table's columns: zero-copy where a column is one chunk. ``alloc(n,
    dtype)`` gives the numpy buffer a multi-chunk column is joined into (default ``empty``, Arrow's
    allocator; the GPU path passes pinned staging memory, so the join is the only host copy).
    ``joined``: columns already joined while the table was read (``StreamJoin.parts``). ``direct``: Arrow decoded
    into pinned memory (``device/sends.py`` ``Sends``: ``send`` takes a chunk to copy to the device from there
    instead of joining it here, ``ready_for`` joins what it took of a column the host reads, ``list_parts``)."""

    def __init__(self, table: pa.Table, where: str, alloc: Alloc | None = None,
                 joined: dict[str, tuple[np.ndarray, np.ndarray]] | None = None, direct: Any = None) -> None:
        self.table, self.where = table, where
        self.alloc = alloc or empty
        self.direct = direct
        self.defer: list | None = None  # fill jobs of padded outputs the caller fills (decoder.decode's defer)
        self._parts: dict[str, tuple[np.ndarray, np.ndarray]] = dict(joined or {})

    def has(self, name: str) -> bool:
        """Whether the table holds column ``name`` (the reader may have left it out)."""
        return name in self.table.column_names

    def col(self, name: str) -> pa.ChunkedArray:
        """Column ``name``; FormatError if the file lacks it."""
        try:
            return self.table.column(name)
        except KeyError:
            raise FormatError(f"{self.where}: column {name!r} named in the spec is missing from the file") from None

    def arr(self, name: str) -> pa.Array:
        """Column ``name`` as one Arrow array (its chunks combined)."""
        col = self.col(name)
        with foreign_errors(self.where, "reading column {!r}", name):
            return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()

    def pylist(self, name: str) -> list:
        """Column ``name`` as Python values."""
        a = self.arr(name)
        with foreign_errors(self.where, "reading column {!r}", name):
            try:
                return a.to_pylist()
            except UnicodeDecodeError as e:  # pyarrow does not check a string column's bytes
                raise FormatError(f"{self.where}: column {name!r} holds text that is not UTF-8 ({e}); "
                                  "the file is damaged or was not written by trajstore") from None

    def _list_col(self, name: str) -> pa.ChunkedArray:
        col = self.col(name)
        if not pa.types.is_large_list(col.type):
            raise FormatError(f"{self.where}: column {name!r} is {col.type}, expected large_list")
        return col

    def chunks(self, name: str, dtype: str) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
        """(offsets of every row, counted from 0; [(first row, values)] per chunk) of a large_list
        column, without joining the chunks."""
        col = self._list_col(name)
        with foreign_errors(self.where, "reading column {!r}", name):
            off, parts, r = _offsets(col.chunks), [], 0
            for c in col.chunks:
                parts.append((r, _raw(_sliced(c), dtype, name, self.where) if dtype != "bool"
                              else _values(c, dtype, name, self.where)))
                r += len(c)
        if any(dt.is_wide(dtype, v) for _, v in parts):  # widened half values, narrowed in pieces on the pool
            wide = [(r, v, np.empty(len(v), dt.storage_numpy(dtype))) for r, v in parts]
            cut = [(v[s], out[s]) for _, v, out in wide for s in pieces(len(v), v.itemsize)]
            run_parallel(lambda group: [dt.narrow(v, dtype, out=o) for v, o in group],
                         balance(cut, lambda p: p[0].nbytes, PIECE_BYTES), sum(v.nbytes for _, v, _ in wide))
            parts = [(r, out) for r, _, out in wide]
        return off, parts

    def offsets(self, name: str, dtype: str) -> np.ndarray:
        """The row offsets of a large_list column, counted from 0 (its values not read)."""
        if name in self._parts:
            return self._parts[name][0]
        col = self._list_col(name)
        with foreign_errors(self.where, "reading column {!r}", name):
            return _offsets(col.chunks)

    def join(self, names: list[tuple[str, str]]) -> None:
        """Join the chunks of the large_list columns ``[(name, dtype)]`` into one buffer each,
        every chunk of every column copied in one round on the thread pool."""
        with foreign_errors(self.where, "reading its columns"):
            self._join(names)

    def _join(self, names: list[tuple[str, str]]) -> None:
        if is_serial():  # several steps decode at once, one a thread: few calls a column (below)
            for name, dtype in names:
                if name not in self._parts and self.has(name):
                    self._parts[name] = self._combined(name, dtype)
            return
        copies: list = []
        for name, dtype in names:
            if name in self._parts or not self.has(name):
                continue
            col = self._list_col(name)
            wide = dt.is_wide_type(dtype, col.type.value_type)  # converted as it is copied
            if col.num_chunks == 1 and not wide:
                c = col.chunk(0)
                o = to_numpy(c.offsets)
                self._parts[name] = (o - o[0], _values(c, dtype, name, self.where))
                continue
            off = _offsets(col.chunks)
            out = self.alloc(int(off[-1]), dt.storage_numpy(dtype))
            self._parts[name] = (off, out)
            r = 0
            for c in col.chunks:
                dst = out[off[r]:off[r + len(c)]]
                r += len(c)
                if dtype == "bool":  # unpacked from its bitmap on the pool thread
                    copies.append((c, dtype, name, dst))
                    continue
                src = _raw(_sliced(c), dtype, name, self.where)
                how = dtype if dt.is_wide(dtype, src) else None
                if how is None and self.direct is not None and self.direct.send(dst, src):
                    continue
                copies += [(src[s], how, name, dst[s]) for s in pieces(len(src), src.itemsize)]

        def copy(group: list) -> None:
            for src, dtype, name, dst in group:
                if dtype is None:
                    dst[...] = src
                elif dtype == "bool":
                    dst[...] = _values(src, dtype, name, self.where)
                else:
                    dt.narrow(src, dtype, out=dst)

        run_parallel(copy, balance(copies, lambda x: x[3].nbytes, PIECE_BYTES),
                     sum(x[3].nbytes for x in copies))

    def _combined(self, name: str, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """A column joined on a serial thread in a few calls that release the GIL for a whole column or
        chunk (numbers: one ``np.concatenate``, widening int32 ids; bools: Arrow joins the bitmaps, one
        unpack), not ``_join``'s pieces on the pool, whose calls serialize on the GIL (RESULTS.md)."""
        col = self._list_col(name)
        chunks = [col.combine_chunks()] if dtype == "bool" and col.num_chunks != 1 else col.chunks
        off, parts = _offsets(chunks), [_raw(_sliced(c), dtype, name, self.where) for c in chunks]
        if len(parts) == 1 and not dt.is_wide(dtype, parts[0]) and (self.alloc is empty or col.num_chunks == 1):
            return off, parts[0]  # Arrow's memory, or the bools just unpacked
        out = self.alloc(int(off[-1]), dt.storage_numpy(dtype))
        if dtype in dt.HALF and any(dt.is_wide(dtype, v) for v in parts):
            p = 0
            for v in parts:
                dt.narrow(v, dtype, out=out[p:p + len(v)])
                p += len(v)
        elif self.direct is None:
            if parts:  # (a column of no chunks: nothing to copy)
                np.concatenate(parts, out=out, casting="same_kind")
        else:  # each chunk taken to send from Arrow's memory, or copied here
            p = 0
            for v in parts:
                if not self.direct.send(out[p:p + len(v)], v):
                    out[p:p + len(v)] = v
                p += len(v)
        return off, out

    def joined(self, name: str, dtype: str) -> tuple[np.ndarray, np.ndarray] | None:
        """``list_parts`` of a column already joined (``join``), else None: a padded field's values for its fill jobs,
        left where ``direct`` took them (the pad plan, or ``Arena.fill``, copies back what it reads)."""
        return self._list_parts(name, dtype) if name in self._parts else None

    def bitmap(self, name: str) -> int:
        """-1; for a bool column ``joined`` gives as its bitmap's bytes, its first value's bit (``codec/late.py``)."""
        return -1

    def list_parts(self, name: str, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, values) of a large_list column, its chunks joined (``join``), for any use on the host."""
        off, v = self._list_parts(name, dtype)
        if self.direct is not None:
            self.direct.ready_for(v)
        return off, v

    def _list_parts(self, name: str, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        if name not in self._parts:
            self.join([(name, dtype)])
        off, v = self._parts[name]
        if v.dtype != dt.storage_numpy(dtype):
            raise FormatError(f"{self.where}: column {name!r} stores {v.dtype}, spec says {dtype}")
        return off, v

    def flat_parts(self, name: str, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """``list_parts`` of a packed field's column, its values used whole (left where ``direct`` took them to send;
        ``codec/late.py`` may defer them)."""
        return self._list_parts(name, dtype)

    def prim(self, name: str, dtype: str) -> np.ndarray:
        """A primitive column's values, checked (no nulls, the storage dtype of ``dtype``)."""
        a = self.arr(name)
        with foreign_errors(self.where, "reading column {!r}", name):
            return _checked(a, dtype, name, self.where)
