"""One column type per field per split (docs/FORMAT.md 3.11): a step's table fitted to the column
types its split already holds.

``fit(table, known)`` keeps every column whose name is new to the split or whose Arrow type is the
one the split recorded for that name (``known``: name -> ``str`` of the Arrow type; an int64 token
column stored as int32, format version 6, goes back to int64 where the split records it so; a list
column whose items differ from the record only in their field's name or nullability takes the recorded
type); a column whose
type differs is stored under another name, ``<name>__<type tag>`` (``__2``... if taken), with the
spec's references to it (``col``, ``pad_col``, ``shape_col``, ``start_col``) rewritten, so that
no reader of a glob of the split casts one step's values to another step's type: the field's
regular column is absent in that step (a schema union gives NULL there) and the spec maps the
field to its column, so trajstore reads it exactly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

import pyarrow as pa

from ..spec import STEP_COLUMN
from ..values import dumps

__all__ = ["type_name", "fit", "SPEC_COLUMN_KEYS"]

SPEC_COLUMN_KEYS = ("col", "pad_col", "shape_col", "start_col", "len_col")  # the keys of spec nodes naming columns


def type_name(t: pa.DataType) -> str:
    """The Arrow type as the split's record keeps it (and ``trajstore info`` shows it)."""
    return str(t)


def _tag(t: pa.DataType) -> str:
    """A short, portable spelling of an Arrow type for a column name: ``float``, ``int64``,
    ``string``, ``large_list_float``."""
    s = re.sub(r"(item|element): |not null", "", str(t))
    return re.sub(r"[^0-9A-Za-z]+", "_", s).strip("_")


def fit(table: pa.Table, known: Mapping[str, str]) -> tuple[pa.Table, dict[str, str], dict[str, str]]:
    """``(table, moved, types)``: the table with every column whose type differs from ``known``
    moved to a name of its own (``moved``: old name -> new name), and the type of each of its
    columns (by its name in the returned table), for the split's record."""
    table = _fitted_lists(table, known)
    taken = set(table.column_names)
    moved: dict[str, str] = {}
    for f in table.schema:
        have = type_name(f.type)
        if f.name == STEP_COLUMN or known.get(f.name, have) == have:
            continue
        base = f"{f.name}__{_tag(f.type)}"
        new, k = base, 1
        while new in taken or known.get(new, have) != have:
            k += 1
            new = f"{base}__{k}"
        moved[f.name] = new
        taken.add(new)
    if moved:
        table = _rename(table, moved)
    return table, moved, {f.name: type_name(f.type) for f in table.schema if f.name != STEP_COLUMN}


def _list_variants(t: pa.DataType) -> dict[str, pa.DataType]:
    """The types a list column of ``t``'s items may be recorded as: its item field called ``element`` or
    ``item``, nullable or not (a list batch's cell column with ``None`` trajectories has nullable items,
    one without has not), by their names."""
    v = t.value_type
    return {type_name(x): x for x in (pa.large_list(pa.field(n, v, nullable=nb))
                                      for n in ("element", "item") for nb in (True, False))}


def _fitted_lists(table: pa.Table, known: Mapping[str, str]) -> pa.Table:
    """The table with each list column whose recorded type holds the same values cast to it, so the
    column keeps its name: an int64 token column stored as int32 (format version 6, 3.2) back to int64
    where the split records it as int64 (its earlier steps: a dump written before version 6, or steps
    whose values needed 64 bits), and a list column whose items differ from the record only in their
    field's name or nullability (a list batch's step without ``None`` trajectories after one with
    them, or the other way round). Never where items would have to be non-null and some are null
    (that column moves)."""
    for i, f in enumerate(table.schema):
        t = f.type
        if f.name not in known or type_name(t) == known[f.name] or not pa.types.is_large_list(t) \
                or pa.types.is_nested(t.value_type):
            continue
        want = _list_variants(t).get(known[f.name])
        if want is None and t.value_type == pa.int32() and (f.metadata or {}).get(b"trajstore.dtype") == b"int64":
            want = _list_variants(pa.large_list(pa.int64())).get(known[f.name])
        if want is None:
            continue
        col = table.column(i)
        if not want.value_field.nullable and any(c.values.null_count for c in col.chunks):
            continue
        table = table.set_column(i, f.with_type(want), col.cast(want))
    return table


def _rename(table: pa.Table, moved: dict[str, str]) -> pa.Table:
    meta = dict(table.schema.metadata or {})
    doc = json.loads(meta[b"trajstore"])
    _walk(doc.get("batch"), moved)
    meta[b"trajstore"] = dumps(doc).encode()
    fields = []
    for f in table.schema:
        if f.name in moved:  # the field's own name stays in its metadata (readers without the spec)
            f = f.with_name(moved[f.name]).with_metadata({**(f.metadata or {}), b"trajstore.column": f.name.encode()})
        fields.append(f)
    return pa.Table.from_arrays(table.columns, schema=pa.schema(fields, metadata=meta))


def _walk(node, moved: dict[str, str]) -> None:
    """Rewrite the column names of the spec's nodes (never the values a node holds: ``json``,
    ``tvalue``, ``gtensor`` and wrappers are not walked)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if type(n) is not dict:
            continue
        for k in SPEC_COLUMN_KEYS:
            if type(n.get(k)) is str and n[k] in moved:
                n[k] = moved[n[k]]
        t = n.get("t")
        if t == "batch":
            stack.extend(n.get("masks", []))
        if t in ("batch", "group", "struct"):
            stack.extend(child for _, child in n.get("keys", []))
        elif t == "seq":
            stack.append(n.get("elem"))
