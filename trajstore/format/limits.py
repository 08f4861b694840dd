"""The limits a step file is held to, one set for the writer and the reader.

What ``Writer.append`` accepts the reader accepts, and what the reader refuses ``append`` refuses
first, naming the field and the limit (so anything written reads back):

* ``MAX_SPEC_DEPTH``: fields nested in dicts (a group or a per-trajectory struct is one level);
* ``MAX_VALUE_DEPTH``: lists / dicts inside one JSON or typed value;
* ``MAX_DIMS``: dimensions of a tensor.

A decode allocates at most ``MAX_DECODED_BYTES`` (environment variable
``TRAJSTORE_MAX_DECODED_BYTES``, default 16 GiB) beyond what the file's own metadata says its
pages hold, and that is bounded before anything is allocated: the Parquet row groups' uncompressed
sizes (what pyarrow decompresses), padded outputs and their ``[B, T]`` masks, inline tensors,
fixed-width strings, one Python object per row of every per-trajectory node, the description's
JSON. Over it: ``FormatError`` naming the file and this knob (``over``). ``check_pages`` bounds
what pyarrow decompresses and ``load_doc`` the description's JSON; ``format/file/validate.py`` the rest
of what the description says, ``format/codec/decoder.py`` (``Decoder.charge``) a layout conversion's.
"""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq

from ..errors import ConfigError, FormatError, foreign_errors

__all__ = ["KNOB", "MAX_DECODED_BYTES", "MAX_SPEC_DEPTH", "MAX_VALUE_DEPTH", "MAX_DIMS", "MAX_META_BYTES",
           "ROW_OBJECT_BYTES", "STRUCT_ROW_BYTES", "JSON_EXPANSION", "THRIFT_LIMITS", "over", "decoded_limit",
           "check_pages", "load_doc", "padded_bytes"]

KNOB = "TRAJSTORE_MAX_DECODED_BYTES"


def _env_bytes(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of bytes; set it to an int such as {default}") from None
    if v < 0:
        raise ConfigError(f"{name}={raw!r} is negative; set it to an int of bytes >= 0")
    return v


MAX_DECODED_BYTES = _env_bytes(KNOB, 16 << 30)
MAX_SPEC_DEPTH = 64  # a field at depth d sits inside d - 1 dicts (top-level fields: 1)
MAX_VALUE_DEPTH = 200  # lists / dicts inside a JSON or typed value
MAX_DIMS = 32
MAX_META_BYTES = 1 << 20  # a step's ``meta`` as JSON (the writer's limit)

# what a decoded per-trajectory value costs in Python objects, beyond the file's data: a list slot
# and a small object (an int, a float, None...) per row and node, a dict per row of a struct
ROW_OBJECT_BYTES = 64
STRUCT_ROW_BYTES = 256
# json.loads of the description: Python objects take at most this many times the text's bytes
# (``[[],[],...]``: 3 bytes of text, a 56-byte list and an 8-byte slot each)
JSON_EXPANSION = 24
# the footer's thrift decode (``pq.ParquetFile(thrift_...)``): one string (the description) and
# one list (columns, row groups, key-value pairs) at most this long
THRIFT_LIMITS = {"thrift_string_size_limit": 256 << 20, "thrift_container_size_limit": 1 << 20}


def padded_bytes(n: int, T: int, elem: int, masks: int = 1) -> int:
    """What a ``[n, T]`` padded output of ``elem``-byte tokens allocates: itself, its ``masks`` ``[n, T]``
    bool masks and their ``arange(T)`` (none for no rows: ``masks.padded_mask``)."""
    return n * T * (elem + masks) + (8 * T if n else 0)


def decoded_limit() -> int:
    """The limit now (tests and callers may set ``MAX_DECODED_BYTES`` of this module)."""
    return MAX_DECODED_BYTES


def over(where: object, nbytes: int, what: str) -> FormatError:
    """The error for a decode of ``nbytes`` (``what``) over the limit, naming the file and the knob."""
    return FormatError(f"{where}: decoding {what} would allocate {nbytes} bytes, over the limit of "
                       f"{MAX_DECODED_BYTES} bytes; set {KNOB} to raise it if the file is trusted")


def check_pages(md: pq.FileMetaData, where: str) -> None:
    """Raise FormatError before pyarrow decompresses a file whose row groups say they hold more
    than the decode limit once decompressed (a few KB of zstd can hold GBs of zeros). The
    row-group totals are read, not each column chunk's metadata: pyarrow aborts the process (a C++
    exception through its Python accessors) on some damaged column-chunk metadata. They bound a
    read of any of the file's columns."""
    with foreign_errors(where, "reading its Parquet footer"):
        total = sum(max(0, md.row_group(i).total_byte_size) for i in range(md.num_row_groups))
        total += 8 * max(0, md.num_rows) * max(0, md.num_columns)  # a list column's offsets
    if total > MAX_DECODED_BYTES:
        raise over(where, total, f"its {md.num_row_groups} row group(s) of {md.num_rows} rows "
                   "(the uncompressed sizes its Parquet footer gives)")


def load_doc(raw: bytes, where: str) -> object:
    """A step's trajstore description (footer key ``trajstore``) parsed, its size bounded first."""
    if len(raw) * JSON_EXPANSION > MAX_DECODED_BYTES:
        raise over(where, len(raw) * JSON_EXPANSION, f"its description ({len(raw)} bytes of JSON)")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{where}: trajstore metadata is not valid JSON ({str(e)[:200]}); "
                          "the file is damaged or was not written by trajstore") from None
