"""Per-trajectory sequences, encode and decode side by side (docs/FORMAT.md 3.3, 3.7): a ``seq`` field
(a list, tuple or 1-D numpy object/str array with one value per trajectory; also the top level of a
list batch) and its element kinds, one value per row:

* ``cell``: tensors whose shape varies by row (values in ``col``, shapes in ``__shape__<col>``);
* ``value``: Python scalars of one type, JSON text (``ptype`` json), or typed JSON text (``ptype``
  tjson, format/typed.py) for what plain JSON cannot hold exactly;
* ``struct``: dicts holding tensors somewhere, one child element node per key;
* ``empty``: every row None or absent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from ...errors import FormatError
from .. import dtypes as dt
from . import grouped
from .. import typed
from ..arrow import Columns, TableBuilder, list_array
from ..batch.check import MISSING, Cells, Empty, Seq, Struct, Values
from ..spec import SHAPE_PREFIX, ElemNode, SeqNode
from ..values import as_cpu, dumps, storage

__all__ = ["encode_seq", "encode_elems", "mark_list_tokens", "decode_seq", "decode_elems"]

_ARROW = {"str": pa.string(), "bool": pa.bool_(), "float": pa.float64(), "int": pa.int64(),
          "ilist": pa.large_list(pa.int64()), "flist": pa.large_list(pa.float64())}  # lists: version 4


# ----------------------------------------------------------------------------- encode
def encode_seq(enc: TableBuilder, f: Seq) -> SeqNode:
    """The spec node of a per-trajectory sequence field; its columns go to ``enc``."""
    node: Any = {"t": "seq", "container": f.container, "elem": encode_elems(enc, f.elem)}
    if f.np_dtype is not None:
        node["np_dtype"] = f.np_dtype
    if f.trail is not None:  # an N-D numpy array: each row has shape ``trail``
        node["trail"] = f.trail
        enc.needs(2)
    return node


def encode_elems(enc: TableBuilder, p: Empty | Cells | Struct | Values) -> ElemNode:
    """The element node of one value per row (classified by ``format.check``)."""
    node: Any = {}
    none = [i for i, e in enumerate(p.elems) if e is None]
    missing = [i for i, e in enumerate(p.elems) if e is MISSING]
    if none:
        node["none"] = none
    if missing:
        node["missing"] = missing
    if isinstance(p, Empty):
        node["t"] = "empty"
    elif isinstance(p, grouped.RunCells):  # a list batch's groups, unpadded (format version 3)
        grouped.encode_cells(enc, node, p)
    elif isinstance(p, Cells):
        _encode_cells(enc, node, p)
    elif isinstance(p, Struct):
        node["t"] = "struct"
        node["keys"] = [[k, encode_elems(enc, child)] for k, child in p.keys]
        orders = _orders(p)
        if orders:  # rows whose keys are not in the node's order (version 3)
            node["orders"] = orders
            enc.needs(3)
    else:
        _encode_values(enc, node, p)
    return node


def _orders(p: Struct) -> list:
    """``[[row, [key index, ...]], ...]`` for the rows whose dict's keys come in another order than
    the struct's keys (first seen across rows)."""
    idx = {k: i for i, (k, _) in enumerate(p.keys)}
    out = []
    for i, e in p.present:
        ks = [idx[k] for k in e]
        if any(a > b for a, b in zip(ks, ks[1:])):
            out.append([i, ks])
    return out


def _encode_cells(enc: TableBuilder, node: dict, p: Cells) -> None:
    n, present = len(p.elems), p.present
    parts, shapes = {}, [None] * n
    for i, e in present:
        _, _, x = as_cpu(e, p.path + (i,))
        parts[i] = storage(x).reshape(-1)
        shapes[i] = list(x.shape)
    lengths = np.array([len(parts[i]) if i in parts else 0 for i in range(n)], dtype=np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    vals = np.concatenate([parts[i] for i, _ in present]) if present else np.empty(0, dt.storage_numpy(p.dtype))
    nullmask = np.array([i not in parts for i in range(n)], dtype=bool)
    node.update(t="cell", col=p.col, lib=p.lib, dtype=p.dtype, shape_col=SHAPE_PREFIX + p.col)
    enc.add(p.col, list_array(offsets, vals, nullmask), {"dtype": p.dtype, "kind": "cell"}, p.path)
    enc.add(SHAPE_PREFIX + p.col, pa.array(shapes, type=pa.list_(pa.int64())), {"kind": "shape"}, p.path)


def _encode_values(enc: TableBuilder, node: dict, p: Values) -> None:
    vals = [None if (e is None or e is MISSING) else e for e in p.elems]
    if p.ptype == "json":
        arr = pa.array([None if v is None else dumps(v) for v in vals], type=pa.string())
    elif p.ptype == "tjson":
        docs = [None if v is None else typed.encode(v) for v in vals]
        arr = pa.array([None if d is None else dumps(d) for d in docs], type=pa.string())
        enc.needs(max(typed.version(d) for d in docs if d is not None))  # 3 with a NaN / inf inside
    elif p.ptype == "num":  # Python numbers in one float64 column; the int rows named (version 3)
        ints = [i for i, v in enumerate(vals) if type(v) is int]
        arr = pa.array([None if v is None else float(v) for v in vals], type=pa.float64())
        node["ints"] = True if len(ints) == len(vals) - vals.count(None) else ints
        enc.needs(3)
    else:
        arr = pa.array(vals, type=_ARROW[p.ptype])
        if p.ptype in ("ilist", "flist"):  # a ragged list of ints / floats per trajectory (version 4)
            enc.needs(4)
    node.update(t="value", col=p.col, ptype=p.ptype)
    enc.add(p.col, arr, {"kind": "json" if p.ptype in ("json", "tjson") else "value"}, p.path)


def mark_list_tokens(elem: dict, batch: list | tuple) -> None:
    """In a list of trajectory dicts, flag the cells shaped like each row's attention mask."""
    keys = dict(elem.get("keys", []))
    if keys.get("attention_mask", {}).get("t") != "cell":
        return
    rows = [e for e in batch if isinstance(e, Mapping)]
    for k, node in keys.items():
        if node.get("t") != "cell" or node.get("missing") or node.get("none"):
            continue
        if all("attention_mask" in e and tuple(np.shape(e[k]))[: np.ndim(e["attention_mask"])]
               == tuple(np.shape(e["attention_mask"])) for e in rows):
            node["kind"] = "token"


# ----------------------------------------------------------------------------- decode
def decode_seq(cols: Columns, node: SeqNode, n: int, keys: list[str] | None = None) -> Any:
    """A sequence of ``n`` rows as its container: list, tuple, or numpy array of ``np_dtype``;
    ``keys`` limits the dicts of a list batch to those fields."""
    elems = decode_elems(cols, node["elem"], n, keys)
    c = node["container"]
    if c == "list":
        return elems
    if c == "tuple":
        return tuple(elems)
    dtype = np.dtype(node["np_dtype"])
    if "trail" in node:
        return _rows_array(cols, elems, dtype, [n, *node["trail"]])
    if dtype.kind == "O":
        arr = np.empty(n, dtype=object)
        for i, e in enumerate(elems):
            arr[i] = e
        return arr
    try:
        return np.array(elems, dtype=dtype).reshape(n)
    except (ValueError, TypeError) as e:  # e.g. text that a bytes dtype cannot hold
        raise FormatError(f"{cols.where}: the values do not fit numpy dtype {dtype} ({e})") from None


def _rows_array(cols: Columns, elems: list, dtype: np.dtype, shape: list[int]) -> np.ndarray:
    """An N-D numpy array from its rows (each an array of shape ``shape[1:]``)."""
    arr = np.empty(shape, dtype=dtype)
    for i, e in enumerate(elems):
        if not isinstance(e, np.ndarray) or list(e.shape) != shape[1:] or e.dtype != dtype:
            raise FormatError(f"{cols.where}: row {i} of a numpy {dtype} array of shape {shape} is not an "
                              f"array of shape {shape[1:]}")
        arr[i] = e
    return arr


def decode_elems(cols: Columns, node: ElemNode, n: int, keys: list[str] | None = None) -> list:
    """The ``n`` values of an element node; ``keys`` limits a struct to those children."""
    t = node.get("t")
    if t == "empty":
        out: list = [None] * n
    elif t == "cell":
        out = grouped.decode_cells(cols, node, n) if "runs" in node else _decode_cells(cols, node, n)
    elif t == "value":
        out = _decode_values(cols, node)
    elif t == "struct":
        out = [{} for _ in range(n)]
        for k, child in node["keys"]:
            if keys is not None and k not in keys:
                continue
            vals = decode_elems(cols, child, n)
            miss = set(child.get("missing", ()))
            for i in range(n):
                if i not in miss:
                    out[i][k] = vals[i]
        names = [k for k, _ in node["keys"]]
        for i, ks in node.get("orders", ()):  # a row's own key order (checked by format/file/validate.py)
            out[i] = {names[j]: out[i][names[j]] for j in ks if names[j] in out[i]}
    else:
        raise FormatError(f"{cols.where}: unknown element type {t!r} in the spec")
    if t in ("cell", "value"):
        _check_nulls(cols, node, out)
    for i in node.get("none", ()):
        out[i] = None
    for i in node.get("missing", ()):
        out[i] = None  # the parent struct drops the key
    if len(out) != n:
        raise FormatError(f"{cols.where}: column {node.get('col')!r} has {len(out)} rows, expected {n}")
    return out


def _check_nulls(cols: Columns, node: dict, rows: list) -> None:
    """A column's null rows are exactly the rows its node lists in ``none`` or ``missing``
    (docs/FORMAT.md 3.7): any other null is a lie of the file, refused."""
    listed = set(node.get("none", ())) | set(node.get("missing", ()))
    nulls = {i for i, v in enumerate(rows) if v is None}
    if nulls != listed:
        bad = sorted(nulls ^ listed)[:5]
        raise FormatError(f"{cols.where}: column {node.get('col')!r} is null at rows other than the ones its "
                          f"spec lists as None or absent (rows {bad}); the file is damaged")


def _decode_cells(cols: Columns, node: dict, n: int) -> list:
    off, v = cols.list_parts(node["col"], node["dtype"])
    shapes = cols.pylist(node["shape_col"])
    if len(off) != n + 1 or len(shapes) != n:
        raise FormatError(f"{cols.where}: column {node['col']!r} has {len(off) - 1} rows, expected {n}")
    out: list = [None] * n
    for i, shp in enumerate(shapes):
        if shp is not None:
            x = v[off[i] - off[0]: off[i + 1] - off[0]]
            if any(type(d) is not int or d < 0 for d in shp) or math.prod(shp) != len(x):
                raise FormatError(f"{cols.where}: column {node['col']!r} row {i} has shape {shp} "
                                  f"but {len(x)} values")
            out[i] = dt.as_value(x.reshape(shp), node)
    return out


def _decode_values(cols: Columns, node: dict) -> list:
    vals = cols.pylist(node["col"])
    if node["ptype"] == "num":
        return _nums(cols, node, vals)
    if node["ptype"] not in ("json", "tjson"):
        return vals
    try:
        out = [None if x is None else json.loads(x) for x in vals]
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{cols.where}: column {node['col']!r} holds text that is not JSON ({e})") from None
    if node["ptype"] == "tjson":
        w = f"{cols.where}: column {node['col']!r}"
        out = [None if x is None else typed.decode(x, w) for x in out]
    return out


def _nums(cols: Columns, node: dict, vals: list) -> list:
    """A ``num`` column's rows: floats, and Python ints at the rows ``ints`` names (``true``: every
    row that is not null); an int row must hold an integral float64 of magnitude at most 2**53."""
    ints = node["ints"]
    rows = [i for i, v in enumerate(vals) if v is not None] if ints is True else ints
    for i in rows:
        x = vals[i]
        if x is None or not (math.isfinite(x) and x == int(x) and abs(x) <= 2**53):
            raise FormatError(f"{cols.where}: column {node['col']!r} row {i} is an int row holding {x!r}")
        vals[i] = int(x)
    return vals
