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

KNOWN_VERSIONS = (1, 2, 3, 6)  # GAP: 6 adds int32 storage of int64 token columns (3.2), read here; the
# constructs of versions 4 and 5 (number lists, the obj tag, declared masks with holes) are not implemented:
# a step using one is refused (SpecError) where this reader meets it; a class wrapper comes back as Wrapped
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
               "num": pa.float64(), "json": pa.string(), "tjson": pa.string()}


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
    step_meta(meta, path)  # 3.6: a lying meta / meta_t is refused even when only the batch is read
    return _Decoder(cols, table.num_rows, meta["format_version"]).top(meta["batch"])


def read_meta(path: str | Path) -> dict:
    """The step metadata of one step file (3.6): ``meta``, or the typed document ``meta_t`` decoded."""
    path = Path(path)
    meta = json.loads((pq.read_schema(path).metadata or {})[b"trajstore"])
    if meta.get("format_version") not in KNOWN_VERSIONS:  # section 4
        raise SpecError(f"{path}: format_version {meta.get('format_version')!r} unknown")
    return step_meta(meta, path)


def step_meta(meta: dict, path: Any) -> dict:
    """3.6: ``meta`` (plain JSON) or ``meta_t`` (version 3, a typed document of a dict), never both."""
    if "meta_t" not in meta:
        out = meta.get("meta", {})  # 3.6: a file with neither key reads as {}
        if not isinstance(out, dict):
            raise SpecError(f"{path}: meta is not an object")
        return out
    if "meta" in meta or meta["format_version"] < 3:
        raise SpecError(f"{path}: meta_t together with meta, or in a file of version {meta['format_version']}")
    out = typed(meta["meta_t"])
    if not isinstance(out, dict):
        raise SpecError(f"{path}: meta_t is not the typed document of a dict")
    return out


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
            return dt.type()  # 3.8: the empty str_/bytes_ scalar (<U0 / |S0), its bytes b""
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
        if dt.itemsize == 0:  # 3.8: S0 / U0 only in `np`
            raise SpecError(f"typed ndarray of zero-width dtype {dt}")
        if len(raw) != math.prod(shape) * dt.itemsize:
            raise SpecError("typed ndarray: byte count does not match dtype and shape")
        return np.frombuffer(raw, dtype=dt).reshape(shape).copy()
    if t == "tensor":
        return _inline({"dtype": doc["dtype"], "shape": doc["shape"], "data": doc["v"], "lib": "torch"})
    if t == "float" and doc["v"] in ("nan", "inf", "-inf"):  # 3.8, version 3
        if "bits" not in doc:
            return float(doc["v"])
        if doc["v"] != "nan" or not re.fullmatch(r"[0-9a-f]{16}", doc["bits"]):
            raise SpecError(f"typed float: bits {doc['bits']!r}")
        x = float(np.frombuffer(bytes.fromhex(doc["bits"]), dtype=">f8")[0])
        if x == x:
            raise SpecError(f"typed float: bits {doc['bits']} are not a NaN")
        return x
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
        """A list column's flat values (storage dtype), offsets and validity. 3.2: from version 6 an
        int64 list column may hold int32 values (the same numbers), widened back here."""
        narrowed = dtype == "int64" and self.version >= 6 and name in self.cols \
            and pa.types.is_large_list(self.cols[name].type) and self.cols[name].type.value_type == pa.int32()
        arr = self.col(name, pa.int32() if narrowed else self.arrow(dtype), listed=True)
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
        if "wrapper" in node:  # 3.7 Wrappers: the container is rebuilt by whoever has its type
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
        if any(g.get("holes") for g in groups):  # GAP: version 5's holes (3.4) are not implemented here
            raise SpecError("a declared mask with holes (3.4, version 5): this reader does not implement it")
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
        if t == "segtensor":
            return self.segtensor(node)
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
        raise SpecError(f"field node {t!r}")

    def tensor(self, node: dict) -> Any:
        if "axis" in node:  # 3.4 / 3.7 token axis last (version 3)
            return self.last_axis(node)
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
        out[...] = _fill(dtype, node.get("pad"))
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

    def last_axis(self, node: dict) -> Any:
        """3.4 "Token axis last" / 3.7 (version 3): a token field ``[B, *trail, W]`` whose row *i*
        holds its ``[*trail, len_i]`` block of valid positions (``pad_col``: ``[*trail, W - len_i]``)."""
        col, dtype, trail = node.get("col"), node["dtype"], tuple(node["trail"])
        if self.version < 3:
            raise SpecError(f"{col!r}: axis in a file of format_version {self.version}")
        if node["axis"] != "last" or node["kind"] != "token":
            raise SpecError(f"{col!r}: axis {node['axis']!r} on a {node['kind']!r} field")
        k = math.prod(trail)
        if not trail or k == 0:
            raise SpecError(f"{col!r}: axis last with trail {list(trail)}")
        vals, off, _ = self.rows(col, dtype)
        if np.any(np.diff(off) % k):
            raise SpecError(f"{col}: row sizes are not multiples of {k}")
        lens = np.diff(off) // k
        if self.form == "packed":  # 3.7: read packed it is [*trail, N]
            # GAP 3.7 (fixed in the doc): [*trail, N] is the rows' blocks joined on the last axis
            blocks = [vals[off[i]:off[i + 1]].reshape((*trail, int(lens[i]))) for i in range(self.B)]
            flat = np.concatenate(blocks, axis=-1) if blocks else np.empty((*trail, 0), vals.dtype)
            return _tensor(dtype, node["lib"], flat)
        group = self.groups[0] if self.form == "padded" else self.groups[node["mask"]]
        W = group["W"]
        starts = self.starts(group, lens, W)
        out = np.empty((self.B, *trail, W), dtype=vals.dtype)
        out[...] = _fill(dtype, node.get("pad"))
        pad_col = node.get("pad_col")
        pvals, poff = (self.rows(pad_col, dtype)[:2]) if pad_col else (None, None)
        for i in range(self.B):
            s, n = int(starts[i]), int(lens[i])
            out[i, ..., s:s + n] = vals[off[i]:off[i + 1]].reshape((*trail, n))
            if pad_col is not None:
                p = pvals[poff[i]:poff[i + 1]]
                if len(p) != (W - n) * k:
                    raise SpecError(f"{pad_col}: row {i} holds {len(p)} values, expected {(W - n) * k}")
                where = np.ones(W, bool)
                where[s:s + n] = False
                out[i][..., where] = p.reshape((*trail, W - n))
        return _tensor(dtype, node["lib"], out)

    def segtensor(self, node: dict) -> Any:
        """3.7 segtensor (version 3): the column's rows concatenated, reshaped to ``[N, *trail]``."""
        if self.version < 3:
            raise SpecError(f"segtensor {node.get('col')!r} in a file of format_version {self.version}")
        if node["lib"] not in ("torch", "numpy"):
            raise SpecError(f"segtensor {node['col']!r}: lib {node['lib']!r}")
        counts, trail, dtype = node["counts"], tuple(node["trail"]), node["dtype"]
        if (not isinstance(counts, list) or len(counts) != self.B
                or not all(type(c) is int and c >= 0 for c in counts)):
            raise SpecError(f"segtensor {node['col']!r}: counts is not {self.B} non-negative ints")
        if not all(type(d) is int and d >= 0 for d in trail):
            raise SpecError(f"segtensor {node['col']!r}: trail {list(trail)}")
        vals, off, valid = self.rows(node["col"], dtype)
        # GAP 3.7: the doc does not say whether a segment row may be null; a null row would hold no
        # values, so it is refused unless its count is 0 -- and refused outright here (trajstore
        # writes none).
        if not valid.all():
            raise SpecError(f"segtensor {node['col']!r}: a null row")
        k = math.prod(trail)
        if not np.array_equal(np.diff(off), np.asarray(counts, np.int64) * k):
            raise SpecError(f"segtensor {node['col']!r}: a row's value count is not counts[i] * prod(trail)")
        return _tensor(dtype, node["lib"], vals.reshape((sum(counts), *trail)))

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
            rows = [{name: vals[i] for name, vals, missing in kids if i not in missing} for i in range(self.B)]
            for i, order in node.get("orders", ()):  # 3.7 (version 3): a row's own key order
                if self.version < 3 or sorted(order) != [j for j, k in enumerate(kids) if i not in k[2]]:
                    raise SpecError(f"struct: row {i}'s key order {order} does not fit its keys")
                rows[i] = {kids[j][0]: rows[i][kids[j][0]] for j in order}
        elif t == "empty":
            rows = [None] * self.B
        else:
            raise SpecError(f"element node {t!r}")
        listed = set(node.get("none", ())) | set(node.get("missing", ()))
        if t in ("cell", "value") and {i for i, r in enumerate(rows) if r is None} != listed:
            raise SpecError(f"column {node['col']!r}: null rows other than `none` / `missing` (3.7)")
        for i in node.get("none", ()):
            rows[i] = None
        return rows

    def cells(self, node: dict) -> list:
        if "runs" in node:  # 3.10 groups stored by runs (version 3)
            return self.run_cells(node)
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

    def run_cells(self, node: dict) -> list:
        """3.10: token cells ``[g, T, *k]`` whose rows with runs hold each trajectory's run only
        (``[s_0..s_{g-1}, l_0..l_{g-1}]`` in the runs column), the padded positions ``pad`` or, in
        row-major order of ``[g, T]``, the ``pad_col`` row."""
        col, dtype = node["col"], node["dtype"]
        named = node["runs"] in ("__runs__attention_mask", "__runs__attention_mask__action")
        if self.version < 3 or not named or node.get("kind") != "token":
            raise SpecError(f"{col!r}: runs {node['runs']!r} on a {node.get('kind')!r} cell in version {self.version}")
        vals, off, valid = self.rows(col, dtype)
        shapes = self.col(node["shape_col"], pa.int64(), listed=True).to_pylist()
        runs = self.col(node["runs"], pa.int64(), listed=True).to_pylist()
        pad_col = node.get("pad_col")
        pvals, poff = (self.rows(pad_col, dtype)[:2]) if pad_col else (None, None)
        out: list = []
        for i in range(self.B):
            if not valid[i] or shapes[i] is None:
                out.append(None)
                continue
            v, shape = vals[off[i]:off[i + 1]], shapes[i]
            if runs[i] is None:  # stored whole
                if len(v) != math.prod(shape):
                    raise SpecError(f"{col}: row {i} has {len(v)} values for shape {shape}")
                out.append(_tensor(dtype, node["lib"], v.reshape(shape).copy()))
                continue
            # GAP 3.10 (fixed in the doc): g, T and k are the row's shape's; a null pad without a
            # pad_col fills 0; a row without runs holds no pad_col values (not read here).
            if len(shape) < 2:
                raise SpecError(f"{col}: row {i} has runs but shape {shape}")
            g, T, k = shape[0], shape[1], math.prod(shape[2:])
            r = runs[i]
            s, n = r[:g], r[g:]
            if len(r) != 2 * g or any(a < 0 or b < 0 or a + b > T for a, b in zip(s, n)):
                raise SpecError(f"{node['runs']}: row {i} {r} is not {g} runs within {T}")
            if len(v) != sum(n) * k:
                raise SpecError(f"{col}: row {i} has {len(v)} values for runs of {sum(n)} tokens x {k}")
            x = np.empty((g, T, k), dtype=vals.dtype)
            valid_pos = np.zeros((g, T), bool)
            for j in range(g):
                valid_pos[j, s[j]:s[j] + n[j]] = True
            if pad_col is not None:
                p = pvals[poff[i]:poff[i + 1]]
                if len(p) != (g * T - sum(n)) * k:
                    raise SpecError(f"{pad_col}: row {i} holds {len(p)} values, expected {(g * T - sum(n)) * k}")
                x[~valid_pos] = p.reshape((g * T - sum(n), k))
            else:
                x[...] = _fill(dtype, node.get("pad"))
            x[valid_pos] = v.reshape((sum(n), k))  # runs in trajectory order == row-major order of [g, T]
            out.append(_tensor(dtype, node["lib"], x.reshape(shape)))
        return out

    def values(self, node: dict) -> list:
        ptype = node["ptype"]
        if ptype not in VALUE_TYPES:  # GAP: version 4's ilist / flist (3.3) are not implemented here
            raise SpecError(f"value column {node['col']!r}: value type {ptype!r} this reader does not implement")
        rows = self.col(node["col"], VALUE_TYPES[ptype]).to_pylist()
        if ptype == "json":
            return [None if r is None else _json(r) for r in rows]
        if ptype == "tjson":
            return [None if r is None else typed(_json(r)) for r in rows]
        if ptype == "num":  # 3.7 (version 3): float64 rows, Python ints at the rows `ints` names
            if self.version < 3:
                raise SpecError(f"value column {node['col']!r}: ptype num in a file of version {self.version}")
            ints = node["ints"]
            for i in ([i for i, r in enumerate(rows) if r is not None] if ints is True else ints):
                r = rows[i]
                if r is None or not math.isfinite(r) or r != int(r) or abs(r) > 2**53:
                    raise SpecError(f"value column {node['col']!r}: int row {i} holds {r!r}")
                rows[i] = int(r)
        return rows


def _fill(dtype: str, pad: int | None) -> Any:
    """3.4 pad: the bit pattern of the padded positions, 0 when null."""
    # GAP 3.4 (fixed in the doc): 1-byte dtypes record their bits unsigned (an int8 pad of -1 as
    # 255), wider ones signed; the integer modulo 2**bits reads both.
    if dtype == "bool":
        return bool(pad or 0)
    bits = np.dtype(STORAGE[dtype]).itemsize * 8
    return np.array([(pad or 0) % (1 << bits)], dtype=f"<u{bits // 8}").view(STORAGE[dtype])[0]


def _np(arr: pa.Array, dtype: str) -> np.ndarray:
    """An Arrow primitive array (no nulls at valid positions) as numpy of the storage dtype."""
    st = np.dtype(STORAGE[dtype])
    if dtype == "bool":
        return np.asarray(arr.fill_null(False).to_numpy(zero_copy_only=False), dtype=bool)
    if arr.null_count:
        arr = arr.fill_null(0)
    return np.asarray(arr.to_numpy(zero_copy_only=False)).astype(st, copy=False)
