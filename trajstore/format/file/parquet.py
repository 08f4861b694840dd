"""How a step's Arrow table is laid out in Parquet: encodings, compression and row groups
(docs/FORMAT.md section 3.5). The choices were measured by the encoding benchmark
(benchmarks/encodings.py; figures in benchmarks/RESULTS.md)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ...base import threads as _threads
from ...base.arrow_pool import arrow_pool
from ...errors import ConfigError, FormatError
from .. import dtypes as dt
from .. import limits
from ..arrow import is_position_column

__all__ = ["parquet_options", "check_compression", "COMPRESSIONS", "read_sample", "read_columns", "PARALLEL_READ_BYTES", "ENCODINGS", "ROW_GROUPS", "ROW_GROUP_BYTES", "ZSTD_LEVEL"]

ROW_GROUPS = 16  # at most this many row groups per step file: a reader decodes them on several cores
ROW_GROUP_BYTES = 4 << 20  # ...of at least this much Arrow data each (a small step is one row group)
ZSTD_LEVEL = 1  # as small as level 3 (+0.6%), its writes 12-14% cheaper (docs/FORMAT.md 3.5)
# "portable": encodings every Parquet reader decodes (PLAIN, dictionary; docs/FORMAT.md 3.5);
# "compact": BYTE_STREAM_SPLIT for 16/32/64-bit tensor values, which fastparquet and older
# parquet-mr engines cannot read (tests/test_readers.py::test_cell_compact)
ENCODINGS = ("portable", "compact")
_TENSOR_KINDS = (b"token", b"sample", b"cell", b"pad", b"segment")


COMPRESSIONS = ("zstd", "zstd:<level>", "lz4_raw")


def check_compression(compression: Any, what: str) -> tuple[str, int | None]:
    """``(codec, level)`` of a writer's ``compression``: "zstd" (level ``ZSTD_LEVEL``, the default),
    "zstd:<level>" (an int from -7 to 22: negative levels are faster and larger) or "lz4_raw"
    (docs/FORMAT.md 3.5: every reader of tests/test_readers.py reads both codecs)."""
    c = compression if isinstance(compression, str) else None
    if c == "zstd":
        return "zstd", ZSTD_LEVEL
    if c == "lz4_raw":
        return "lz4", None  # pyarrow's "lz4" is Parquet's LZ4_RAW codec
    lvl = c.split(":", 1)[1] if c and c.startswith("zstd:") else ""
    if lvl.lstrip("-").isdigit() and -7 <= int(lvl) <= 22:
        return "zstd", int(lvl)
    raise ConfigError(f"{what}: compression={compression!r}; use one of {', '.join(COMPRESSIONS)} "
                      "(a zstd level from -7 to 22; docs/FORMAT.md 3.5)")


def check_encodings(encodings: Any, what: str) -> str:
    if encodings not in ENCODINGS:
        raise ConfigError(f"{what}: encodings must be one of {ENCODINGS}, got {encodings!r}")
    return encodings


def parquet_options(table: pa.Table, encodings: str = "portable",
                    compression: tuple[str, int | None] = ("zstd", ZSTD_LEVEL)) -> dict[str, Any]:
    """The Parquet options of a step's table, zstd at ``ZSTD_LEVEL`` for every column (``compression``:
    another codec and level, ``check_compression``) and up to
    ``ROW_GROUPS`` row groups of at least ``ROW_GROUP_BYTES``, so a reader decodes a large step on
    several cores while a small step stays one row group (a smaller footer and one page per
    column, which keeps reading one column of many steps cheap). Every page carries its CRC32,
    which trajstore's readers verify (``page_checksum_verification``), so a flipped bit fails a
    plain read.

    ``encodings`` "portable" (the default): float32 / float64 tensor values PLAIN (a dictionary of
    distinct log-probs only grows the file), so are integer tensor values of a position field
    (``arrow.is_position_column``: runs counting up, which zstd compresses better), everything else
    dictionary-encoded (token ids, masks, half-precision values, strings, JSON) -- encodings every
    reader of tests/test_readers.py decodes. "compact": BYTE_STREAM_SPLIT
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
        elif tensor and pa.types.is_integer(t) and is_position_column(f.name):
            pass  # PLAIN: position runs compress to a third of their dictionary, written and read faster
        elif not (tensor and (f.metadata or {}).get(b"trajstore.dtype") in (b"float32", b"float64")):
            dic += names  # (half-precision values have at most 65536 distinct values: a small dictionary)
    return {
        "compression": compression[0],
        "compression_level": compression[1],
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


def read_columns(pf: pq.ParquetFile, src: Any, cols: list[str] | None,
                 rows: tuple[int, int] | None = None, on_batch: Any = None, pool: Any = None) -> pa.Table:
    """Columns ``cols`` (None: all) of the step file ``pf`` reads from ``src``; ``rows=(start, stop)``:
    those rows only, read from the row groups that hold them (a rank's slice of a shard it cuts).

    Large reads go through Arrow's dataset reader, which decodes row groups and columns in parallel on
    Arrow's CPU pool (even with ``use_threads=False``), faster per thread than row groups read from
    Python threads (benchmarks/RESULTS.md, "Thread budget"). Arrow sizes that pool from
    ``OMP_NUM_THREADS``, which torchrun sets to 1, so while such a read is in flight the pool is raised
    to the reader's thread budget where it is smaller, and restored after (``base/arrow_pool.py``;
    README, Threads); on a serial thread of a deep prefetch it is set to three quarters of the budget
    (``threads.arrow_share``), the rest left to the joins of the steps decoding at once (thirteen sixteenths when
    it decodes into ``pool``, the pinned pool: those joins copy little).
    ``pre_buffer=False``: the column chunks are read as they are decoded, not gathered first, which is
    faster on a step of many row groups (benchmarks/RESULTS.md). Pages are checked
    (``page_checksum_verification``). Small reads (a column of per-trajectory values) read the file on
    the calling thread. ``schema.decode`` then joins the row-group chunks of each column in parallel;
    ``on_batch(record batch)``, for a large read of the whole file, is called with each row group as
    Arrow's reader yields it (in order), so the caller can start joining them while the rest decode
    (``format/file/joining.py`` ``StreamJoin``). ``pool``: the ``pyarrow.MemoryPool`` a read of the whole file
    decodes into (a small one too: it goes through the dataset reader then), default Arrow's."""
    md = pf.metadata
    sch = pq.ParquetSchema(md)  # not md.schema: FileMetaData would keep it, a cycle freed only by the collector
    leaves = [sch.column(j).path for j in range(md.num_columns)]
    want = [j for j, p in enumerate(leaves)  # an estimate: it only picks the faster path
            if cols is None or any(p == c or p.startswith(c + ".") for c in cols)]
    # row-group totals, not md.row_group(i).column(j): pyarrow aborts the process (instead of
    # raising) on some damaged column-chunk metadata when it is accessed from Python
    groups = list(range(md.num_row_groups))
    if rows is not None:
        ends = list(itertools.accumulate(md.row_group(i).num_rows for i in groups))
        groups = [i for i in groups if ends[i] > rows[0] and ends[i] - md.row_group(i).num_rows < rows[1]]
    size = sum(md.row_group(i).total_byte_size for i in groups) * len(want) // max(1, len(leaves))
    threads, small = not _threads.is_serial(), size <= PARALLEL_READ_BYTES
    if rows is None and small and pool is None:
        return pf.read(columns=cols, use_threads=threads)
    if rows is not None and not groups:
        return pf.schema_arrow.empty_table().select(list(pf.schema_arrow.names if cols is None else cols))
    if small and rows is not None:
        table = pf.read_row_groups(groups, columns=cols, use_threads=False)
    else:
        n, deep = _threads.threads(), _threads.is_serial()  # deep: one of several steps decoding at once
        with arrow_pool(_threads.arrow_share(n, pool is not None) if deep else n, exact=deep):
            table = _scan(src, cols, None if rows is None else groups, threads, on_batch if rows is None else None,
                          pool if rows is None else None)
    if rows is None:
        return table
    first = ends[groups[0]] - md.row_group(groups[0]).num_rows
    return table.slice(rows[0] - first, rows[1] - rows[0])


def _scan(src: Any, cols: list[str] | None, groups: list[int] | None, threads: bool,
          on_batch: Any = None, pool: Any = None) -> pa.Table:
    """Row groups ``groups`` (None: all) of the Parquet file ``src``, columns ``cols``, read by Arrow's
    dataset reader (what ``pq.read_table`` does, there for the whole file only), pages checked. A reader
    of its own: one ``ParquetFile`` read from several threads at once crashes pyarrow. ``pyarrow.dataset``
    is imported here, as ``pq.read_table`` does: it loads pandas, which commands that read no step skip."""
    import pyarrow.dataset as ds

    fmt = ds.ParquetFileFormat(pre_buffer=False, page_checksum_verification=True, **limits.THRIFT_LIMITS)
    frag = fmt.make_fragment(src, row_groups=groups)
    data = ds.FileSystemDataset([frag], schema=frag.physical_schema, format=fmt, filesystem=frag.filesystem)
    if on_batch is None:
        return data.to_table(columns=cols, use_threads=threads, memory_pool=pool)
    scanner = data.scanner(columns=cols, use_threads=threads, memory_pool=pool)
    batches = []
    for batch in scanner.to_batches():  # in the file's order, each as soon as it is decoded
        on_batch(batch)
        batches.append(batch)
    return pa.Table.from_batches(batches, schema=scanner.projected_schema)


PARALLEL_READ_BYTES = 4 << 20
