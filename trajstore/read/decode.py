"""One step file's columns read and decoded (``Reader`` and ``shards.py`` call these): which columns a read
of ``columns`` in ``layout`` needs (a padded batch's attention mask of ones is rebuilt from another token
column's lengths, not read), read with the step's row count checked (``read_table``), then decoded
(``decode``), into the pinned arena where the batch goes to a GPU (its padded fields left for the device
to build: ``trajstore/device/plan.py``)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from .. import schema
from ..base.threads import is_serial
from ..errors import ConfigError, FormatError, foreign_errors
from ..format.codec.late import flat_nbytes
from ..format.file.joining import StreamJoin
from ..format.codec.decoder import joined_first
from ..format.codec.tensors import ones_source
from ..format.file.parquet import read_columns
from ..format.spec import STEP_COLUMN, is_dict_batch, is_token, node_columns
from ..store.stepfile import StepFile

__all__ = ["read_table", "decode", "decode_file"]


def decode_file(sf: StepFile, step: int, columns: list[str] | None, layout: str | None,
                arena: Any = None) -> Any:
    """``columns`` of the opened step file ``sf`` of ``step``, in ``layout``, decoded (``decode``).
    Read to host memory (no ``arena``), the columns the decode joins first (``joined_first``) are
    joined as the row groups arrive (``StreamJoin``), except on a thread decoding serially (a deep
    prefetch): there each column is joined after the read in a few calls (``Columns._combined``)."""
    join = None
    if arena is None and sf.pf.metadata.num_row_groups > 1 and not is_serial():
        names = joined_first(sf.doc["batch"], columns, layout)
        join = StreamJoin(names, sf.pf.metadata.num_rows) if names else None  # (the doc's num_rows: checked equal)
    direct = getattr(arena, "arrow_pool", None)  # Arrow decodes into pinned memory (device/decode_pool.py)
    table = read_table(sf, step, columns, layout, on_batch=None if join is None else join.feed, pool=direct)
    return decode(sf.doc, table, sf.path, columns, layout, arena, None if join is None else join.parts(table),
                  direct=direct is not None)


def read_table(sf: StepFile, step: int, columns: list[str] | None, layout: str | None,
               rows: tuple[int, int] | None = None, on_batch: Any = None, also: list[str] = (),
               pool: Any = None) -> pa.Table:
    """The columns of the opened step file that decoding ``columns`` in ``layout`` needs, and the Arrow
    columns ``also`` (``rows``: of those rows only, ``(start, stop)``; ``on_batch``, ``pool``: see ``read_columns``)."""
    doc, f = sf.doc, sf.path
    spec = doc["batch"]
    try:
        cols = schema.columns_for(spec, columns)
    except ConfigError as e:
        raise ConfigError(f"{f}: {e}") from None
    if layout and cols is not None and is_dict_batch(spec):  # a token field's row lengths, for the conversion
        extra = next((n for _, n in spec["keys"] if is_token(n) and n["col"] not in cols), None)
        if extra is not None:  # with its padding values' column: shards join a field with those
            cols = list(cols)
            node_columns(extra, cols, spec.get("masks"))
    if (cols is None and layout == "packed" and is_dict_batch(spec) and spec.get("form") == "padded"
            and spec.get("side")):
        # the attention mask is dropped by the conversion: decode it only if it is the one
        # per-token field (its lengths are then needed)
        keep = [k for k, n in spec["keys"] if k != "attention_mask"]
        cols = schema.columns_for(spec, keep)
        if not any(c in cols for c in _token_cols(spec)):
            cols = None
    if cols is None and layout != "packed" and ones_source(spec) is not None:
        # a padded batch's attention mask holds ones on its tokens (docs/FORMAT.md 3.4): built
        # from the lengths of another token column (format/codec/tensors.py ``mask_of_ones``)
        # (nor the step column kept for outside readers)
        skip = {dict(spec["keys"])["attention_mask"]["col"], STEP_COLUMN}
        cols = [c for c in sf.pf.schema_arrow.names if c not in skip]
    if cols is not None:
        cols = cols + [c for c in also if c not in cols]
    with foreign_errors(f, "reading step {}", step, then="the step is damaged"):
        table = read_columns(sf.pf, sf.src, cols, rows, on_batch, pool)
    if rows is None and table.num_rows != doc.get("num_rows", table.num_rows):
        raise FormatError(f"{f}: holds {table.num_rows} rows, its metadata says {doc.get('num_rows')}")
    return table


def decode(doc: dict, table: pa.Table, f: Any, columns: list[str] | None, layout: str | None,
           arena: Any = None, joined: dict | None = None, direct: bool = False) -> Any:
    """``table``, columns of the step ``doc`` describes (read from ``f``), decoded; with ``arena``
    (``trajstore/device/bridge.py`` ``Arena``) into its pinned memory, padded fields left to the device;
    ``joined``: columns already joined (``StreamJoin.parts``); ``direct``: ``table`` was read into the arena's
    pinned Arrow pool, so its chunks go to the device from there (``device/sends.py``) instead of joined on the host."""
    spec = doc["batch"]
    if arena is not None:
        arena.reserve(flat_nbytes(table))  # the flat fields are joined straight into pinned memory
    return schema.decode(table, spec, where=str(f), columns=columns, layout=layout,
                         alloc=None if arena is None else arena.alloc,
                         defer=None if arena is None else arena.jobs,  # padded: built on the device
                         joined=joined, late=None if arena is None else arena.late,  # ids, masks: converted there
                         direct=arena.sends if direct and arena is not None else None)


def _token_cols(spec: dict) -> list[str]:
    return [n["col"] for _, n in spec["keys"] if is_token(n)]
