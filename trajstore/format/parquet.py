"""How a step's Arrow table is laid out in Parquet: encodings, compression and row groups
(docs/FORMAT.md section 3.5). The choices were measured by the encoding benchmark
(benchmarks/encodings.py; figures in benchmarks/RESULTS.md)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

__all__ = ["parquet_options", "ROW_GROUPS", "ROW_GROUP_BYTES", "ZSTD_LEVEL"]

ROW_GROUPS = 16  # at most this many row groups per step file: a reader decodes them on several cores
ROW_GROUP_BYTES = 4 << 20  # ...of at least this much Arrow data each (a small step is one row group)
ZSTD_LEVEL = 3


def parquet_options(table: pa.Table) -> dict[str, Any]:
    """The Parquet options of a step's table: BYTE_STREAM_SPLIT for 16/32/64-bit tensor values
    (log-probs and token ids come out small for little write time), dictionary encoding for
    everything else (masks, strings, JSON), zstd at ``ZSTD_LEVEL``, and up to ``ROW_GROUPS`` row
    groups of at least ``ROW_GROUP_BYTES``, so a reader decodes a large step on several cores
    while a small step stays one row group (a smaller footer and one page per column, which keeps
    reading one column of many steps cheap). Every page carries its CRC32, which trajstore's readers
    verify (``page_checksum_verification``), so a flipped bit fails a plain read. The measurements behind each choice are in
    benchmarks/RESULTS.md (encoding benchmark)."""
    bss, dic = [], []
    for f in table.schema:
        t = f.type.value_type if hasattr(f.type, "value_type") else f.type
        # Parquet options name leaf columns: a list column's values are "<name>.list.element"
        names = [f.name, f"{f.name}.list.element"] if hasattr(f.type, "value_type") else [f.name]
        if (f.metadata or {}).get(b"trajstore.kind") in (b"token", b"sample", b"cell") and (
            t.bit_width in (16, 32, 64) and str(t) not in ("bool",)
        ):
            bss += names
        else:
            dic += names
    return {
        "compression": "zstd",
        "compression_level": ZSTD_LEVEL,
        "use_dictionary": dic,
        "use_byte_stream_split": bss,
        "write_statistics": ["step"],
        "write_page_checksum": True,  # CRC32 per page, verified on every read (docs/RELIABILITY.md)
        "row_group_size": max(1, -(-table.num_rows // max(1, min(ROW_GROUPS, table.nbytes // ROW_GROUP_BYTES)))),
    }
