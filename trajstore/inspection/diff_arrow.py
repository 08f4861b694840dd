"""The fast path of ``diff``: tensor fields compared on their stored Arrow columns, whole step at once.

A token column already holds what ``format.rows`` cuts per trajectory: row *i* is trajectory *i*'s own
tokens, flattened (docs/FORMAT.md 3.3), and a per-sample column one value (or ``prod(trail)`` values)
per row. So the values of every trajectory, concatenated, are the column's values buffer, and the
trajectory boundaries are its list offsets. ``diff`` compares those buffers in one vectorized pass
(``_Field.add_flat``) instead of trajectory by trajectory, and decodes nothing.

It takes only fields it compares exactly as the trajectory-by-trajectory path does (``plan``): tensor
fields of kind ``token`` or ``sample`` of a padded or packed dict batch (and a list of strings, one per
trajectory, when the two columns are equal), read from its step file or its shards joined (not from a
replaying rank's slice), with the same column type on both sides and the same per-row
lengths (else the other path reports the mismatch). Values are compared in the dtype ``rows`` gives:
bfloat16 as float32 (widened in files of format version 3, as its bits before), other dtypes as
themselves; "same bits" compares the stored bits, which for a half dtype widened to float32 is the
same as comparing the half values' bits (the widening is one to one, NaN payloads and -0.0 included).
Every other field (values, JSON, cells, segments, masked batches...) goes to the decode path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..format.spec import is_dict_batch
from ..read import shards as shard_read
from ..format.file.parquet import read_columns as read_file_columns
from ..read.reader import Reader
from ..store import checksums

__all__ = ["field_names", "fast_step", "plan", "read_columns", "same_file", "strings", "values"]

_GLOBAL = ("json", "gtensor", "tvalue")
_LAYOUT = ("cu_seqlens", "max_seqlen")


def field_names(spec: dict) -> dict[str, dict] | None:
    """The names ``format.rows`` gives the fields of a dict batch's trajectories (dotted for nested
    fields), in order, with their spec nodes; None for a batch whose names only decoding tells."""
    if not is_dict_batch(spec):
        return None
    out: dict[str, dict] = {}
    if int(spec.get("B", 0)) < 1:
        return out  # no trajectories: no rows to name fields

    def walk(keys: list, prefix: str) -> None:
        for k, node in keys:
            name = f"{prefix}{k}"
            if node.get("t") == "group":
                walk(node["keys"], name + ".")
            elif node.get("t") not in _GLOBAL and not (not prefix and spec.get("form") == "packed" and k in _LAYOUT):
                out[name] = node

    walk(spec.get("keys", []), "")
    return out


def plan(spec: dict) -> bool:
    """Whether the fields of this step can be compared on their columns (per field: ``eligible``)."""
    if not is_dict_batch(spec) or spec.get("form") not in ("padded", "packed") or int(spec.get("B", 0)) < 1:
        return False
    top = dict(spec["keys"])
    return not ("prompts" in top and "responses" in top)  # verl: fields cut by a part of the mask


def eligible(spec: dict, node: dict) -> bool:
    """A token or sample tensor field ``rows`` cuts as its column's rows are cut."""
    if node.get("t") != "tensor" or node.get("kind") not in ("token", "sample"):
        return False
    if node.get("tokenlike") or "axis" in node or "mask" in node:
        return False
    trail = node.get("trail", [])
    # a [B, T, ...] sample field of a padded batch is cut by the mask too
    return not (node["kind"] == "sample" and spec.get("form") == "padded" and trail and trail[0] == spec.get("T"))


def strings(node: dict) -> str | None:
    """The column of a dict batch's list of strings, one per trajectory, none missing (``uid``)."""
    elem = node.get("elem") if node.get("t") == "seq" else None
    if not isinstance(elem, dict) or elem.get("t") != "value" or elem.get("ptype") != "str":
        return None
    return None if any(k in elem for k in ("missing", "none", "ints")) else elem.get("col")


def same_file(ra: Reader, rb: Reader, step: int) -> bool:
    """Both step files are the same bytes by their recorded SHA-256 (docs/FORMAT.md 1.1)."""
    if ra is rb:
        return True
    if ra._sharded(step) or rb._sharded(step):
        return False
    da = checksums.read_sum(checksums.sum_path(ra.file(step)))
    return da is not None and da == checksums.read_sum(checksums.sum_path(rb.file(step)))


def read_columns(r: Reader, step: int, cols: list[str], tops: list[str]) -> pa.Table | None:
    """The stored columns ``cols`` of ``step``, nothing else read; of a step written by several ranks,
    the shards' columns of the top-level fields ``tops`` joined (docs/FORMAT.md 3.12)."""
    if r._sharded(step):
        _, table, _ = shard_read.logical(r, step, sorted(set(tops)), None)
        return table
    sf = r._open(step)
    table = read_file_columns(sf.pf, sf.src, sorted(set(cols)))
    if table.num_rows != sf.doc.get("num_rows", table.num_rows):
        return None  # the decode path reports it
    return table


def values(col: Any, node: dict) -> tuple[np.ndarray, np.ndarray, np.dtype] | None:
    """(values, per-row value counts, the numpy dtype ``rows`` gives) of a token or sample column."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if arr.null_count:
        return None
    if pa.types.is_large_list(arr.type) or pa.types.is_list(arr.type):
        counts = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
        vals = arr.flatten()
    else:
        counts = np.ones(len(arr), dtype=np.int64)
        vals = arr
    if vals.null_count:
        return None
    x = vals.to_numpy(zero_copy_only=False)
    dt = node.get("dtype")
    if dt == "bfloat16":
        if x.dtype == np.uint16:  # format versions 1 and 2: the bits
            x = (x.astype(np.uint32) << 16).view(np.float32)
        return x, counts, np.dtype(np.float32)
    if dt == "float16":
        return x, counts, np.dtype(np.float16)
    return x, counts, x.dtype


def bits(x: np.ndarray) -> np.ndarray:
    return x if x.dtype.kind == "b" else x.view(f"u{x.dtype.itemsize}")


def fast_step(acc_for: Any, xa: pa.Table, xb: pa.Table, spec_a: dict, spec_b: dict, todo: list,
              names_a: dict, names_b: dict, mask: str | None) -> dict[str, Any]:
    """Compare the eligible fields of ``todo`` (``(field_a, field_b, label)``) on their columns;
    returns ``{label: FieldDiff}`` for those done (the others go to the decode path).
    ``acc_for(label)`` makes the accumulator (``diff._Field``)."""
    done: dict[str, Any] = {}
    m = None
    if mask is not None:
        mn = names_a.get(mask)
        if mn is None or not eligible(spec_a, mn) or mn["kind"] != "token" or mn.get("trail"):
            return done
        mv = values(xa.column(mn["col"]), mn)
        if mv is None:
            return done
        m = (mv[0] != 0, mv[1])
    for fa, fb, label in todo:
        na, nb = names_a.get(fa), names_b.get(fb)
        if na is None or nb is None:
            continue
        sa, sb = strings(na), strings(nb)
        if sa and sb and mask is None:  # equal strings: identical, one value each (else decoded)
            ca, cb = xa.column(sa).combine_chunks(), xb.column(sb).combine_chunks()
            if ca.type == cb.type and not ca.null_count and not cb.null_count and ca.equals(cb):
                acc = acc_for(label)
                acc.e.n = len(ca)
                done[label] = acc
            continue
        if not (eligible(spec_a, na) and eligible(spec_b, nb)):
            continue
        if na["kind"] != nb["kind"] or list(na.get("trail", [])) != list(nb.get("trail", [])):
            continue
        ca, cb = xa.column(na["col"]), xb.column(nb["col"])
        if ca.type != cb.type:
            continue
        va = values(ca, na)
        vb = va if ca is cb else values(cb, nb)
        if va is None or vb is None or not np.array_equal(va[1], vb[1]):
            continue
        trail = [int(t) for t in na.get("trail", [])]
        if na["kind"] == "token":
            width = int(np.prod(trail)) if trail else 1
        else:
            width = int(np.prod(trail[1:])) if len(trail) > 1 else 1
        keep = None
        if m is not None:
            if na["kind"] != "token" or not np.array_equal(m[1] * width, va[1]):
                continue
            keep = np.repeat(m[0], width)
        acc = acc_for(label)
        acc.add_flat(va[0], vb[0], va[2], vb[2], va[1], width, na["kind"] == "token" or bool(trail), keep,
                     ca is cb)
        done[label] = acc
    return done
