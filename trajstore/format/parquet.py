"""How a step's Arrow table is laid out in Parquet: encodings, compression and row groups
(docs/FORMAT.md section 3.5). The choices were measured by the encoding benchmark
(benchmarks/encodings.py; figures in benchmarks/RESULTS.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from . import dtypes as dt
from ..errors import ConfigError, FormatError

__all__ = ["parquet_options", "read_sample", "ENCODINGS", "ROW_GROUPS", "ROW_GROUP_BYTES", "ZSTD_LEVEL"]

ROW_GROUPS = 16  # at most this many row groups per step file: a reader decodes them on several cores
ROW_GROUP_BYTES = 4 << 20  # ...of at least this much Arrow data each (a small step is one row group)
ZSTD_LEVEL = 3
# "portable": encodings every Parquet reader decodes (PLAIN, dictionary; docs/FORMAT.md 3.5);
# "compact": BYTE_STREAM_SPLIT for 16/32/64-bit tensor values, which fastparquet and older
# parquet-mr engines cannot read (tests/test_readers.py::test_cell_compact)
ENCODINGS = ("portable", "compact")
_TENSOR_KINDS = (b"token", b"sample", b"cell", b"pad", b"segment")


def check_encodings(encodings: Any, what: str) -> str:
    if encodings not in ENCODINGS:
        raise ConfigError(f"{what}: encodings must be one of {ENCODINGS}, got {encodings!r}")
    return encodings


def parquet_options(table: pa.Table, encodings: str = "portable") -> dict[str, Any]:
    """The Parquet options of a step's table, zstd at ``ZSTD_LEVEL`` for every column and up to
    ``ROW_GROUPS`` row groups of at least ``ROW_GROUP_BYTES``, so a reader decodes a large step on
    several cores while a small step stays one row group (a smaller footer and one page per
    column, which keeps reading one column of many steps cheap). Every page carries its CRC32,
    which trajstore's readers verify (``page_checksum_verification``), so a flipped bit fails a
    plain read.

    ``encodings`` "portable" (the default): float32 / float64 tensor values PLAIN (a dictionary of
    distinct log-probs only grows the file), everything else dictionary-encoded (token ids, masks,
    half-precision values, strings, JSON) -- encodings every reader of tests/test_readers.py decodes. "compact": BYTE_STREAM_SPLIT
    for 16/32/64-bit tensor values (smaller float columns, faster writes), for readers that
    decode it. The measurements behind each choice are in benchmarks/RESULTS.md (encoding
    benchmark)."""
    check_encodings(encodings, "parquet_options")
    bss, dic = [], []
    for f in table.schema:
        t = f.type.value_type if hasattr(f.type, "value_type") else f.type
        # Parquet options name leaf columns: a list column's values are "<name>.list.element"
        names = [f.name, f"{f.name}.list.element"] if hasattr(f.type, "value_type") else [f.name]
        tensor = (f.metadata or {}).get(b"trajstore.kind") in _TENSOR_KINDS
        if tensor and encodings == "compact" and t.bit_width in (16, 32, 64) and not pa.types.is_boolean(t):
            bss += names
        elif not (tensor and (f.metadata or {}).get(b"trajstore.dtype") in (b"float32", b"float64")):
            dic += names  # (half-precision values have at most 65536 distinct values: a small dictionary)
    return {
        "compression": "zstd",
        "compression_level": ZSTD_LEVEL,
        "use_dictionary": dic,
        "use_byte_stream_split": bss,
        "write_statistics": ["step"],
        "write_page_checksum": True,  # CRC32 per page, verified on every read (docs/RELIABILITY.md)
        "row_group_size": max(1, -(-table.num_rows // max(1, min(ROW_GROUPS, table.nbytes // ROW_GROUP_BYTES)))),
    }


def read_sample(pf: pq.ParquetFile, node: dict, doc: dict, f: Path) -> Any:
    """Decode a plain per-trajectory tensor field from its column alone, checking that one node."""
    col, dtype = node["col"], node["dtype"]
    schema_ = pf.schema_arrow
    idx = schema_.get_field_index(col)
    if idx < 0:
        raise FormatError(f"{f}: column {col!r} named in the spec is missing from the file")
    v = doc.get("format_version")
    want = dt.arrow_type(dtype, v if type(v) is int else 1)
    if schema_.field(idx).type != want:
        raise FormatError(f"{f}: column {col!r} has Arrow type {schema_.field(idx).type}, "
                          f"the spec says {dtype} (stored as {want})")
    arr = pf.reader.read_column(idx)
    n = doc.get("num_rows")
    if len(arr) != pf.metadata.num_rows or len(arr) != n or arr.null_count:
        raise FormatError(f"{f}: column {col!r} holds {len(arr)} values ({arr.null_count} null) for "
                          f"{n} rows; the step is damaged")
    a = arr.chunk(0) if arr.num_chunks == 1 else arr.combine_chunks()
    return dt.as_value(a.to_numpy(zero_copy_only=False), node)
