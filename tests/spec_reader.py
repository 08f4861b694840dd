"""A trajstore step-file reader written from docs/FORMAT.md alone (pyarrow + numpy, no trajstore).

It is what an outside implementer would write from the document: ``read_step(path)`` decodes one
step file into plain values. Tensors come back as :class:`Tensor` (the dtype name of section 3.2,
the library, and a numpy array of the *storage*: bfloat16 as its uint16 bits), numpy fields as
numpy arrays, per-trajectory lists as lists, containers (3.7 "wrapper") as :class:`Wrapped`.
Where the document left a choice open, the choice made here is commented with ``GAP``.
"""

from __future__ import annotations

import base64
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

KNOWN_VERSIONS = (1, 2, 3)
STEP_NAME = re.compile(r"^step_(\d{8,})\.parquet$")

# 3.2: logical dtype -> numpy storage dtype (bfloat16 as its raw uint16 bits)
STORAGE = {"bool": np.bool_, "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "int32": np.int32,
           "int64": np.int64, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
           "float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "float64": np.float64}
ARROW = {"bool": pa.bool_(), "uint8": pa.uint8(), "int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(),
         "int64": pa.int64(), "uint16": pa.uint16(), "uint32": pa.uint32(), "uint64": pa.uint64(),
         "float16": pa.float16(), "bfloat16": pa.uint16(), "float32": pa.float32(), "float64": pa.float64()}
HALF = ("float16", "bfloat16")  # 3.2: stored as float32 from version 3
VALUE_TYPES = {"str": pa.string(), "bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(),
               "json": pa.string(), "tjson": pa.string()}


class SpecError(ValueError):
    """The file does not follow docs/FORMAT.md."""


@dataclass
class Tensor:
    """A torch tensor as the file describes it: dtype name (3.2) and its storage as numpy."""
    dtype: str
    array: np.ndarray


@dataclass
class Wrapped:
    """A batch that was a container (3.7 "wrapper"): the wrapper object and the decoded value."""
    wrapper: dict
    value: Any


def read_step(path: str | Path) -> Any:
    """The batch stored in one step file, decoded as docs/FORMAT.md says."""
    path = Path(path)
    m = STEP_NAME.match(path.name)
    if not m:
        raise SpecError(f"{path.name}: not a step file name (section 1)")
    table = pq.read_table(path)
    meta = json.loads((table.schema.metadata or {})[b"trajstore"])
    if meta.get("format_version") not in KNOWN_VERSIONS:  # section 4
        raise SpecError(f"{path}: format_version {meta.get('format_version')!r} unknown")
    if meta["step"] != int(m.group(1)) or meta["num_rows"] != table.num_rows:
        raise SpecError(f"{path}: step / num_rows of the spec do not match the file")
    cols = {name: table.column(name).combine_chunks() if table.column(name).num_chunks != 1
            else table.column(name).chunk(0) for name in table.column_names}
    return _Decoder(cols, table.num_rows, meta["format_version"]).top(meta["batch"])


# ----------------------------------------------------------------------------- values
def _tensor(dtype: str, lib: str, arr: np.ndarray) -> Any:
    if lib == "torch":
        return Tensor(dtype, arr)
    if lib == "np_scalar":
        return arr.reshape(())[()]  # a numpy scalar of that dtype
    return arr


def _inline(node: dict) -> Any:
    """3.7 gtensor: little-endian storage bytes, base64."""
    dt = np.dtype(STORAGE[node["dtype"]]).newbyteorder("<")
    raw = base64.b64decode(node["data"])
    shape = tuple(node["shape"])
    if len(raw) != math.prod(shape) * dt.itemsize:
        raise SpecError(f"gtensor: {len(raw)} bytes for shape {shape} of {node['dtype']}")
    arr = np.frombuffer(raw, dtype=dt).astype(dt.newbyteorder("="), copy=True).reshape(shape)
    return _tensor(node["dtype"], node["lib"], arr)


def _np_dtype(s: str) -> np.dtype:
    """3.8: numpy dtypes allowed in typed documents (``dtype.str``)."""
    if not re.fullmatch(r"[<>|=]?(b1|[iuf][1248]|f2|c8|c16|[SU]\d+|[Mm]8\[[a-zA-Z]+\]|O)", s):
        raise SpecError(f"typed document: dtype {s!r} not allowed")
    return np.dtype(s)


def typed(doc: Any) -> Any:
    """3.8: a typed document to its Python value."""
    if isinstance(doc, list):
        return [typed(d) for d in doc]
    if not isinstance(doc, dict):
        return doc
    if "$t" not in doc:
        return {k: typed(v) for k, v in doc.items()}
    t = doc["$t"]
    if t == "tuple":
        return tuple(typed(d) for d in doc["v"])
    if t == "dict":
        return {_hashable(typed(k)): typed(v) for k, v in doc["v"]}
    if t == "bytes":
        return base64.b64decode(doc["v"])
    if t == "np":
        dt = _np_dtype(doc["dtype"])
        raw = base64.b64decode(doc["v"])
        if dt.kind in "SU" and raw == b"":
            return dt.type()  # GAP 3.8: the empty str_/bytes_ scalar, its bytes b""
        if len(raw) != dt.itemsize:
            raise SpecError(f"typed np: {len(raw)} bytes for {dt}")
        return np.frombuffer(raw, dtype=dt)[0]
    if t == "ndarray":
        dt, shape = _np_dtype(doc["dtype"]), tuple(doc["shape"])
        if dt == object:
            items = doc["v"]
            if len(items) != math.prod(shape):
                raise SpecError("typed ndarray: item count does not match shape")
            out = np.empty(len(items), dtype=object)
            for i, d in enumerate(items):
                out[i] = typed(d)
            return out.reshape(shape)
        raw = base64.b64decode(doc["v"])
        if len(raw) != math.prod(shape) * dt.itemsize:
            raise SpecError("typed ndarray: byte count does not match dtype and shape")
        return np.frombuffer(raw, dtype=dt).reshape(shape).copy()
    if t == "tensor":
        return _inline({"dtype": doc["dtype"], "shape": doc["shape"], "data": doc["v"], "lib": "torch"})
    raise SpecError(f"typed document: unknown tag {t!r}")


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def _json(s: str) -> Any:
    return json.loads(s)  # Python's json accepts NaN / Infinity / -Infinity (3.3)


# ----------------------------------------------------------------------------- decoding
def _narrow(f: np.ndarray, dtype: str) -> np.ndarray:
    """3.2: a float32 column's values back to the half dtype's storage, bit for bit."""
    u = f.view(np.uint32)
    if dtype == "bfloat16":
        return (u >> 16).astype(np.uint16)  # the high 16 bits
    h = f.astype(np.float16)  # IEEE narrowing: exact for every value a float16 holds
    nan = np.isnan(f)  # NaN: sign, all-ones exponent, the payload's top 10 bits
    m = (u[nan] >> 13) & 0x3FF
    h.view(np.uint16)[nan] = (((u[nan] >> 16) & 0x8000) | 0x7C00 | m | (m == 0)).astype(np.uint16)
    return h


class _Decoder:
    def __init__(self, cols: dict[str, pa.Array], B: int, version: int = 1):
        self.cols, self.B, self.version = cols, B, version

    def arrow(self, dtype: str) -> pa.DataType:
        """3.2: the column type of a tensor dtype in this file's version."""
        return pa.float32() if dtype in HALF and self.version >= 3 else ARROW[dtype]

    def np(self, arr: pa.Array, dtype: str) -> np.ndarray:
        v = _np(arr, "float32" if dtype in HALF and self.version >= 3 else dtype)
        return _narrow(v, dtype) if dtype in HALF and self.version >= 3 else v

    def col(self, name: str, want: pa.DataType | None = None, listed: bool = False) -> pa.Array:
        if name not in self.cols:
            raise SpecError(f"column {name!r} named by the spec is missing (section 4)")
        arr = self.cols[name]
        t = arr.type
        if listed:
            if not (pa.types.is_large_list(t) or pa.types.is_list(t)):
                raise SpecError(f"column {name!r}: {t} is not a list")
            t = t.value_type
        if want is not None and t != want:
            raise SpecError(f"column {name!r}: storage {t}, spec says {want}")
        return arr

    def rows(self, name: str, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A list column's flat values (storage dtype), offsets and validity."""
        arr = self.col(name, self.arrow(dtype), listed=True)
        offsets = np.asarray(arr.offsets).astype(np.int64)
        flat = arr.values.slice(offsets[0], offsets[-1] - offsets[0]) if len(arr) else arr.values.slice(0, 0)
        vals = self.np(flat, dtype)
        return vals, offsets - offsets[0], ~np.asarray(arr.is_null())

    def top(self, node: dict) -> Any:
        t = node["t"]
        if t == "batch":
            out = self.batch(node)
        elif t == "seq":
            out = self.seq(node)
        else:
            raise SpecError(f"top-level node {t!r}")
        if "wrapper" in node:  # GAP 3.7: the wrapper's keys are listed, their meaning is not
            return Wrapped(node["wrapper"], out)
        return out

    # ---- dict batches
    def batch(self, node: dict) -> dict:
        form, B = node["form"], node["B"]
        if B != self.B:
            raise SpecError(f"B {B} != {self.B} rows")
        if form not in ("padded", "packed", "plain", "masked"):
            raise SpecError(f"form {form!r}")
        groups = node.get("masks", []) if form == "masked" else []
        if form == "padded":
            groups = [{"W": node["T"], "side": node["side"]}]
        self.form, self.groups = form, groups
        return self.fields(node["keys"])

    def fields(self, keys: list) -> dict:
        return {name: self.field(child) for name, child in keys}

    def field(self, node: dict) -> Any:
        t = node["t"]
        if t == "tensor":
            return self.tensor(node)
        if t == "gtensor":
            out = _inline(node)
            if "col" in node:  # 3.7: a packed step's cu_seqlens, also a column of ends
                ends = self.np(self.col(node["col"], self.arrow(node["dtype"])), node["dtype"])
                if not np.array_equal(ends, np.asarray(out.array).reshape(-1)[1:]):
                    raise SpecError(f"column {node['col']!r} does not hold cu_seqlens[1:]")
            return out
        if t == "json":
            return node["v"]
        if t == "tvalue":
            return typed(node["v"])
        if t == "group":
            return self.fields(node["keys"])
        if t == "seq":
            return self.seq(node)
        if t == "segtensor":  # 3.7: the column's values in row order, [sum(counts), *trail]
            vals, off, _ = self.rows(node["col"], node["dtype"])
            counts, trail = node["counts"], tuple(node["trail"])
            if len(counts) != self.B or list(np.diff(off)) != [c * math.prod(trail) for c in counts]:
                raise SpecError(f"{node['col']}: rows do not hold their counts of {trail}")
            return _tensor(node["dtype"], node["lib"], vals.reshape((sum(counts), *trail)))
        raise SpecError(f"field node {t!r}")

    def tensor(self, node: dict) -> Any:
        dtype, trail, kind = node["dtype"], tuple(node["trail"]), node["kind"]
        k = math.prod(trail)
        if kind == "sample":
            if not trail:
                arr = self.np(self.col(node["col"], self.arrow(dtype)), dtype)
            else:
                vals, off, _ = self.rows(node["col"], dtype)
                if len(vals) != self.B * k:
                    raise SpecError(f"{node['col']}: {len(vals)} values for {self.B} rows of {trail}")
                arr = vals.reshape((self.B, *trail))
            return _tensor(dtype, node["lib"], arr)
        if kind != "token":
            raise SpecError(f"tensor kind {kind!r}")
        vals, off, _ = self.rows(node["col"], dtype)
        if self.form == "packed":
            return _tensor(dtype, node["lib"], vals.reshape((-1, *trail)))
        if self.form == "padded":
            group = self.groups[0]
        else:
            group = self.groups[node["mask"]]
        W, side = group["W"], group["side"]
        lens = np.diff(off) // k if k else np.zeros(self.B, np.int64)
        if k and np.any(np.diff(off) % k):
            raise SpecError(f"{node['col']}: row sizes are not multiples of {k}")
        starts = self.starts(group, lens, W)
        out = np.empty((self.B, W, *trail), dtype=vals.dtype)
        pad = node.get("pad")
        # GAP 3.4: "bits read as a signed integer of the same width" vs uint8 pad 255: take the
        # integer modulo 2**bits, which reads both.
        bits = np.dtype(STORAGE[dtype]).itemsize * 8
        fill = np.array([(pad or 0) % (1 << bits)], dtype=f"<u{bits // 8}").view(vals.dtype)[0] \
            if dtype != "bool" else bool(pad or 0)
        out[...] = fill
        pad_col = node.get("pad_col")
        pvals, poff = (self.rows(pad_col, dtype)[:2]) if pad_col else (None, None)
        for i in range(self.B):
            s, n = int(starts[i]), int(lens[i])
            out[i, s:s + n] = vals[off[i]:off[i + 1]].reshape((n, *trail))
            if pad_col is not None:
                where = np.ones(W, bool)
                where[s:s + n] = False
                p = pvals[poff[i]:poff[i + 1]]
                if len(p) != (W - n) * k:
                    raise SpecError(f"{pad_col}: row {i} holds {len(p)} values, expected {(W - n) * k}")
                out[i, where] = p.reshape((W - n, *trail))
        return _tensor(dtype, node["lib"], out)

    def starts(self, group: dict, lens: np.ndarray, W: int) -> np.ndarray:
        side = group["side"]
        if np.any(lens > W):
            raise SpecError(f"a row holds more than {W} tokens")
        if side == "right":
            return np.zeros(self.B, np.int64)
        if side == "left":
            return W - lens
        if side == "span":
            s = _np(self.col(group["start_col"], pa.int64()), "int64")
            if np.any(s < 0) or np.any(s + lens > W):
                raise SpecError(f"{group['start_col']}: a run outside 0..{W}")
            return s
        raise SpecError("a token field's group has no side")

    # ---- per-trajectory lists
    def seq(self, node: dict) -> Any:
        rows = self.elem(node["elem"])
        c = node["container"]
        if c == "list":
            return rows
        if c == "tuple":
            return tuple(rows)
        if c != "ndarray":
            raise SpecError(f"seq container {c!r}")
        dt = _np_dtype(node["np_dtype"])
        trail = tuple(node.get("trail", ()))
        if trail:
            out = np.empty((self.B, *trail), dtype=dt)
            for i, r in enumerate(rows):
                out[i] = r
            return out
        if dt == object:
            out = np.empty(self.B, dtype=object)
            for i, r in enumerate(rows):
                out[i] = r
            return out
        return np.array(rows, dtype=dt).reshape(self.B)

    def elem(self, node: dict) -> list:
        t = node["t"]
        if t == "cell":
            rows = self.cells(node)
        elif t == "value":
            rows = self.values(node)
        elif t == "struct":
            kids = [(name, self.elem(child), set(child.get("missing", ()))) for name, child in node["keys"]]
            # GAP 3.7: "key order is first-seen order across rows" -- the spec keeps one order, the keys'.
            rows = [{name: vals[i] for name, vals, missing in kids if i not in missing} for i in range(self.B)]
        elif t == "empty":
            rows = [None] * self.B
        else:
            raise SpecError(f"element node {t!r}")
        for i in node.get("none", ()):  # GAP 3.7: a null row and the `none` list: `none` decides
            rows[i] = None
        return rows

    def cells(self, node: dict) -> list:
        dtype = node["dtype"]
        vals, off, valid = self.rows(node["col"], dtype)
        shapes = self.col(node["shape_col"], pa.int64(), listed=True).to_pylist()
        out: list = []
        for i in range(self.B):
            if not valid[i] or shapes[i] is None:
                out.append(None)
                continue
            v = vals[off[i]:off[i + 1]]
            if len(v) != math.prod(shapes[i]):
                raise SpecError(f"{node['col']}: row {i} has {len(v)} values for shape {shapes[i]}")
            out.append(_tensor(dtype, node["lib"], v.reshape(shapes[i]).copy()))
        return out

    def values(self, node: dict) -> list:
        ptype = node["ptype"]
        rows = self.col(node["col"], VALUE_TYPES[ptype]).to_pylist()
        if ptype == "json":
            return [None if r is None else _json(r) for r in rows]
        if ptype == "tjson":
            return [None if r is None else typed(_json(r)) for r in rows]
        return rows


def _np(arr: pa.Array, dtype: str) -> np.ndarray:
    """An Arrow primitive array (no nulls at valid positions) as numpy of the storage dtype."""
    st = np.dtype(STORAGE[dtype])
    if dtype == "bool":
        return np.asarray(arr.fill_null(False).to_numpy(zero_copy_only=False), dtype=bool)
    if arr.null_count:
        arr = arr.fill_null(0)
    return np.asarray(arr.to_numpy(zero_copy_only=False)).astype(st, copy=False)
