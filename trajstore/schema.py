"""Batch <-> Arrow table: the one place that knows how a batch is laid out on disk.

``encode`` turns a batch into an Arrow table (one row per trajectory) plus a
JSON *spec* that says how to rebuild the exact Python structure; ``decode``
does the reverse.  docs/FORMAT.md is the normative description of both.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from ._threads import PIECE_BYTES, balance, run_parallel
from .format import containers as adapters
from .format import dtypes as dt
from .errors import BatchError, ConfigError, FormatError, UnsupportedTypeError

__all__ = ["encode", "decode", "columns_for", "RESERVED"]

RESERVED = ("step",)
SHAPE_PREFIX = "__shape__."
PAD_PREFIX = "__pad__."
_MISSING = object()  # a key absent from one element of a sequence of dicts


# ----------------------------------------------------------------------------- helpers
def _where(path: tuple) -> str:
    return ".".join(str(p) for p in path) if path else "<batch>"


def _is_tensorlike(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, np.ndarray) and x.dtype.kind in "biuf":
        return True
    return isinstance(x, np.generic) and np.dtype(type(x)).kind in "biuf"


def check_tensor(x: torch.Tensor, path: tuple) -> str:
    """The dtype name of a storable torch tensor; raise for dtype, layout or device it cannot be."""
    name = dt.TORCH_NAMES.get(x.dtype)
    if name is None:
        raise UnsupportedTypeError(
            f"field {_where(path)!r}: torch dtype {x.dtype} is not supported; "
            f"convert it to one of {sorted(dt.TORCH_NAMES.values())}"
        )
    if x.layout != torch.strided:
        raise UnsupportedTypeError(
            f"field {_where(path)!r}: {x.layout} tensors are not supported; call .to_dense() first"
        )
    if x.device.type == "meta":
        raise UnsupportedTypeError(f"field {_where(path)!r}: a tensor on the meta device has no values to store")
    return name


def length_error(path: tuple, shape: list, ctx: dict) -> BatchError:
    """A tensor whose leading dimension fits neither the batch size nor the token layout."""
    B, form = ctx["B"], ctx["form"]
    expect = f"{B} (the batch size)"
    if form == "padded":
        expect += f", or [{B}, {ctx['T']}] per-token"
    if form == "packed":
        expect += f", or {ctx['N']} (cu_seqlens[-1]) per-token"
    return BatchError(
        f"field {_where(path)!r}: leading dimension is {shape[0]} (shape {shape}), expected "
        f"{expect}; every field must have one entry per trajectory"
    )


def entries_error(path: tuple, n: int, B: int) -> BatchError:
    """A per-trajectory list whose length is not the batch size."""
    return BatchError(
        f"field {_where(path)!r}: has {n} entries, the batch has {B} trajectories; "
        "every per-trajectory list must have one entry per trajectory"
    )


def _as_cpu(x: Any, path: tuple) -> tuple[str, str, torch.Tensor | np.ndarray]:
    """(lib, dtype name, contiguous CPU tensor or ndarray) for a tensor-like value."""
    if isinstance(x, torch.Tensor):
        name = check_tensor(x, path)
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg().contiguous()
        return "torch", name, t
    lib = "np_scalar" if isinstance(x, np.generic) else "numpy"
    if isinstance(x, np.ma.MaskedArray):
        raise UnsupportedTypeError(f"field {_where(path)!r}: numpy masked arrays are not supported (the mask "
                                   "would be lost); store .filled() values and the mask as two fields")
    a = np.ascontiguousarray(np.asarray(x))
    name = dt.NUMPY_NAMES.get(a.dtype.newbyteorder("=") if a.dtype.byteorder not in "=|" else a.dtype)
    if name is None or a.dtype.byteorder == ">":
        raise UnsupportedTypeError(
            f"field {_where(path)!r}: numpy dtype {a.dtype} is not supported; "
            f"convert it to a native-endian {sorted(dt.NUMPY_NAMES.values())}"
        )
    return lib, name, a


def _storage(x: torch.Tensor | np.ndarray) -> np.ndarray:
    return dt.to_storage(x) if isinstance(x, torch.Tensor) else x


def _bits(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x.view(np.uint8) if x.dtype == np.bool_ else x)
    return dt.bits_view(x)


def _list_array(offsets: np.ndarray, values: np.ndarray, mask: np.ndarray | None = None) -> pa.Array:
    off = pa.array(np.asarray(offsets, dtype=np.int64))
    vals = pa.array(values)
    if mask is not None and mask.any():
        return pa.LargeListArray.from_arrays(off, vals, mask=pa.array(mask))
    # no nulls: declare the values non-nullable, which makes Parquet decoding ~30% cheaper
    return pa.LargeListArray.from_arrays(off, vals, type=pa.large_list(pa.field("element", vals.type, nullable=False)))


MAX_JSON_DEPTH = 200


def _check_str(v: str, where: str) -> None:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise BatchError(f"{where}: string {v[:40]!r} is not valid UTF-8 (it holds a lone surrogate); "
                         "fix the text or store it as bytes in a uint8 tensor") from None


def check_json(v: Any, where: str, _depth: int = 0) -> None:
    """Raise unless ``v`` survives a JSON round trip with identical types."""
    if v is None or type(v) in (bool, int):
        return
    if type(v) is str:
        return _check_str(v, where)
    if type(v) is float:
        return
    if _depth >= MAX_JSON_DEPTH:
        raise BatchError(f"{where[:120]}...: a value nests more than {MAX_JSON_DEPTH} lists/dicts deep; "
                         "flatten it")
    if type(v) is list:
        for i, x in enumerate(v):
            check_json(x, f"{where}[{i}]", _depth + 1)
        return
    if type(v) is dict:
        for k, x in v.items():
            if type(k) is not str:
                raise UnsupportedTypeError(
                    f"{where}: dict key {k!r} is a {type(k).__name__}; only str keys round-trip exactly"
                )
            _check_str(k, f"{where} key")
            check_json(x, f"{where}[{k!r}]", _depth + 1)
        return
    raise UnsupportedTypeError(
        f"{where}: value of type {type(v).__name__} cannot be stored exactly; use None, bool, int, "
        "float, str, list or dict with str keys (or a tensor / numpy array)"
    )


def _dumps(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, allow_nan=True, separators=(",", ":"))


# ----------------------------------------------------------------------------- encoder
class _Encoder:
    def __init__(self, n: int):
        self.n = n
        self.fields: list[pa.Field] = []
        self.arrays: list[pa.Array] = []

    def add(self, name: str, arr: pa.Array, meta: dict[str, str], path: tuple) -> None:
        _check_str(name, f"field {_where(path)!r} name")
        if name in RESERVED or any(f.name == name for f in self.fields):
            raise BatchError(
                f"field {_where(path)!r}: column name {name!r} is reserved or already used; rename the field"
            )
        if len(arr) != self.n:
            raise BatchError(f"field {_where(path)!r}: has {len(arr)} rows, the batch has {self.n}")
        self.fields.append(pa.field(name, arr.type, nullable=arr.null_count > 0 or meta.get("kind") in ("value", "json", "cell", "shape"), metadata={f"trajstore.{k}": v for k, v in meta.items()}))
        self.arrays.append(arr)


def _batch_size(batch: Mapping, path: tuple = ()) -> int | None:
    for k, v in batch.items():
        if isinstance(v, torch.Tensor | np.ndarray) and v.ndim >= 1:
            return int(v.shape[0])
        if isinstance(v, list | tuple):
            return len(v)
        if isinstance(v, Mapping):
            n = _batch_size(v)
            if n is not None:
                return n
    return None


def _layout(batch: Mapping) -> dict:
    """Decide the batch form from ``cu_seqlens`` or ``attention_mask``; validate them."""
    cu = batch.get("cu_seqlens")
    if _is_tensorlike(cu) and not isinstance(cu, np.generic) and np.ndim(cu) == 1:
        _, name, c = _as_cpu(cu, ("cu_seqlens",))
        c = torch.as_tensor(c).to(torch.int64)
        if not name.startswith(("int", "uint")) or c.numel() == 0 or int(c[0]) != 0 or bool((c[1:] < c[:-1]).any()):
            raise BatchError(
                "field 'cu_seqlens': must be a non-empty 1-D integer tensor starting at 0 and non-decreasing"
            )
        return {"form": "packed", "B": c.numel() - 1, "N": int(c[-1]), "lengths": (c[1:] - c[:-1])}
    m = batch.get("attention_mask")
    if _is_tensorlike(m) and np.ndim(m) >= 2:
        _, name, a = _as_cpu(m, ("attention_mask",))
        mb = torch.as_tensor(a) if isinstance(a, np.ndarray) else a
        if name != "bool" and not bool(((mb == 0) | (mb == 1)).all()):
            raise BatchError("field 'attention_mask': values must be 0 or 1 (found other values)")
        mask = (mb != 0)
        while mask.ndim > 2:  # [B, T, ...] masks: a token is valid where all of its entries are
            mask = mask.all(dim=-1)
        B, T = mask.shape
        lengths = mask.sum(1)
        ar = torch.arange(T)
        right = ar[None, :] < lengths[:, None]
        left = ar[None, :] >= (T - lengths)[:, None]
        side = "right" if torch.equal(mask, right) else "left" if torch.equal(mask, left) else None
        if side is None:  # holes in the mask: store every [B, T] field whole
            return {"form": "padded", "B": B, "T": T, "side": None}
        return {"form": "padded", "B": B, "T": T, "side": side, "mask": mask, "lengths": lengths}
    return {"form": "plain", "B": _batch_size(batch) or 0}


def _encode_tensor(enc: _Encoder, ctx: dict, path: tuple, v: Any) -> dict:
    lib, name, x = _as_cpu(v, path)
    col = ".".join(path)
    B = ctx["B"]
    if x.ndim == 0 or (ctx["form"] == "packed" and path == ("cu_seqlens",)):
        raw = np.ascontiguousarray(_storage(x)).reshape(-1)
        return {"t": "gtensor", "lib": lib, "dtype": name, "shape": list(x.shape),
                "data": base64.b64encode(raw.tobytes()).decode()}
    node = {"t": "tensor", "col": col, "lib": lib, "dtype": name}
    form = ctx["form"]
    if form == "padded" and x.ndim >= 2 and tuple(x.shape[:2]) == (B, ctx["T"]) and ctx["side"]:
        xt = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
        mask = ctx["mask"]
        pad = None
        if not bool(mask.all()):
            # every padded element must hold the bits of the first one: compared in place, ~8x
            # faster than extracting the padded region (which is most of a long-tail batch)
            bits, nm, w = _bits(x), ~mask, math.prod(x.shape[2:])
            p = bits.reshape(-1)[int(torch.argmax(nm.reshape(-1).to(torch.uint8))) * w] if w else None
            if not w:
                return _encode_sample(enc, node, path, x, B, tokenlike=True)
            if bool(((bits != p) & nm.reshape(list(nm.shape) + [1] * (x.ndim - 2))).any()):
                # padded positions hold different values (e.g. -0.0 and 0.0, or garbage computed
                # past the end): keep them, unpadded tokens stay a token column
                _encode_padvals(enc, node, path, x, nm, B, ctx["T"] - ctx["lengths"], w)
            else:
                pad = int(p)
        vals = xt[mask]
        return _encode_token(enc, node, path, vals, ctx["lengths"], list(x.shape[2:]), pad, lib)
    if form == "packed" and x.ndim >= 1 and x.shape[0] == ctx["N"]:
        xt = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
        return _encode_token(enc, node, path, xt, ctx["lengths"], list(x.shape[1:]), None, lib)
    if x.shape[0] != B:
        raise length_error(path, list(x.shape), ctx)
    return _encode_sample(enc, node, path, x, B)


def _encode_padvals(enc, node, path, x, nm, B, npad, w) -> None:
    """The values at padded positions, row by row in position order: column ``__pad__.<col>``."""
    xt = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    storage = _storage(xt[nm] if node["lib"] == "torch" else xt[nm].numpy()).reshape(-1)
    offsets = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(np.asarray(npad, dtype=np.int64) * w, out=offsets[1:])
    node["pad_col"] = PAD_PREFIX + node["col"]
    enc.add(node["pad_col"], _list_array(offsets, storage), {"dtype": node["dtype"], "kind": "pad"}, path)


def _encode_token(enc, node, path, vals, lengths, trail, pad, lib) -> dict:
    width = math.prod(trail)
    if isinstance(vals, torch.Tensor) and lib != "torch":
        vals = vals.numpy()
    storage = _storage(vals).reshape(-1)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64) * width, out=offsets[1:])
    node.update(kind="token", trail=trail, pad=pad)
    enc.add(node["col"], _list_array(offsets, storage),
            {"dtype": node["dtype"], "kind": "token", "shape": _dumps(["n"] + trail)}, path)
    return node


def _encode_sample(enc, node, path, x, B, tokenlike=False) -> dict:
    trail = list(x.shape[1:])
    storage = _storage(x)
    node.update(kind="sample", trail=trail)
    if tokenlike:
        node["tokenlike"] = True
    if not trail:
        arr = pa.array(storage)
    else:
        w = math.prod(trail)
        arr = _list_array(np.arange(B + 1, dtype=np.int64) * w, storage.reshape(-1))
    enc.add(node["col"], arr, {"dtype": node["dtype"], "kind": "sample", "shape": _dumps(trail)}, path)
    return node


def _has_tensor(v: Any) -> bool:
    if _is_tensorlike(v):
        return True
    if isinstance(v, Mapping):
        return any(_has_tensor(x) for x in v.values())
    return False


def _encode_elems(enc: _Encoder, path: tuple, elems: list) -> dict:
    """Per-row values (one per trajectory) of one field: cells, columns or nested dicts."""
    node: dict = {}
    none = [i for i, e in enumerate(elems) if e is None]
    missing = [i for i, e in enumerate(elems) if e is _MISSING]
    if none:
        node["none"] = none
    if missing:
        node["missing"] = missing
    present = [(i, e) for i, e in enumerate(elems) if e is not None and e is not _MISSING]
    col = ".".join(str(p) for p in path)
    if not present:
        node["t"] = "empty"
        return node
    tens = [_is_tensorlike(e) for _, e in present]
    dicts = [isinstance(e, Mapping) for _, e in present]
    if all(tens):
        return _encode_cells(enc, node, path, col, elems, present)
    if all(dicts) and any(_has_tensor(e) for _, e in present):
        node["t"] = "struct"
        keys: list = []
        for _, e in present:
            for k in e:
                if type(k) is not str:
                    raise UnsupportedTypeError(f"field {_where(path)!r}: key {k!r} is not a str")
                if k not in keys:
                    keys.append(k)
        node["keys"] = [
            [k, _encode_elems(enc, path + (k,), [
                e.get(k, _MISSING) if isinstance(e, Mapping) else _MISSING for e in elems])]
            for k in keys
        ]
        return node
    if any(tens) or any(dicts[i] and _has_tensor(e) for i, (_, e) in enumerate(present)):
        raise UnsupportedTypeError(
            f"field {_where(path)!r}: mixes tensors with other values across trajectories; "
            "use one kind of value per field (None is allowed)"
        )
    return _encode_values(enc, node, path, col, elems, present)


def _encode_cells(enc, node, path, col, elems, present) -> dict:
    libs, names, parts, shapes = set(), set(), {}, [None] * len(elems)
    for i, e in present:
        lib, name, x = _as_cpu(e, path + (i,))
        libs.add(lib)
        names.add(name)
        parts[i] = _storage(x).reshape(-1)
        shapes[i] = list(x.shape)
    if len(libs) > 1 or len(names) > 1:
        raise UnsupportedTypeError(
            f"field {_where(path)!r}: trajectories hold different array types {sorted(libs)} / dtypes "
            f"{sorted(names)}; use one dtype and one library (torch or numpy) per field"
        )
    name = names.pop()
    lengths = np.array([len(parts[i]) if i in parts else 0 for i in range(len(elems))], dtype=np.int64)
    offsets = np.zeros(len(elems) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    vals = np.concatenate([parts[i] for i, _ in present]) if present else np.empty(0, dt.storage_numpy(name))
    nullmask = np.array([i not in parts for i in range(len(elems))], dtype=bool)
    node.update(t="cell", col=col, lib=libs.pop(), dtype=name, shape_col=SHAPE_PREFIX + col)
    meta = {"dtype": name, "kind": "cell"}
    enc.add(col, _list_array(offsets, vals, nullmask), meta, path)
    enc.add(SHAPE_PREFIX + col, pa.array(shapes, type=pa.list_(pa.int64())), {"kind": "shape"}, path)
    return node


def _encode_values(enc, node, path, col, elems, present) -> dict:
    types = {type(e) for _, e in present}
    vals = [None if (e is None or e is _MISSING) else e for e in elems]
    if types == {str}:
        for i, e in present:
            _check_str(e, f"field {_where(path)!r} row {i}")
        arr, ptype = pa.array(vals, type=pa.string()), "str"
    elif types == {bool}:
        arr, ptype = pa.array(vals, type=pa.bool_()), "bool"
    elif types == {float}:
        arr, ptype = pa.array(vals, type=pa.float64()), "float"
    elif types == {int} and all(-(2**63) <= e < 2**63 for _, e in present):
        arr, ptype = pa.array(vals, type=pa.int64()), "int"
    else:
        for i, e in present:
            check_json(e, f"field {_where(path)!r} row {i}")
        arr, ptype = pa.array([None if v is None else _dumps(v) for v in vals], type=pa.string()), "json"
    node.update(t="value", col=col, ptype=ptype)
    enc.add(col, arr, {"kind": "json" if ptype == "json" else "value"}, path)
    return node


def _encode_field(enc: _Encoder, ctx: dict, path: tuple, v: Any) -> dict:
    B = ctx["B"]
    if _is_tensorlike(v):
        return _encode_tensor(enc, ctx, path, v)
    if isinstance(v, Mapping):
        for k in v:
            if type(k) is not str:
                raise UnsupportedTypeError(f"field {_where(path)!r}: key {k!r} is not a str")
        return {"t": "group", "keys": [[k, _encode_field(enc, ctx, path + (k,), x)] for k, x in v.items()]}
    if isinstance(v, np.ndarray) and v.dtype.kind in "OUS":
        if v.ndim != 1:
            raise BatchError(f"field {_where(path)!r}: numpy {v.dtype} arrays must be 1-D [B], got shape {list(v.shape)}")
        container, elems = "ndarray", list(v)
        if v.dtype.kind in "US":
            elems = [x.item() for x in v]
    elif isinstance(v, list | tuple):
        container, elems = type(v).__name__, list(v)
    else:
        if v is None or type(v) in (bool, int, float, str):
            return {"t": "json", "v": v}
        kind = f" of dtype {v.dtype}" if isinstance(v, np.ndarray | np.generic) else ""
        raise UnsupportedTypeError(
            f"field {_where(path)!r}: a {type(v).__name__}{kind} cannot be stored; use a tensor, numpy array, "
            "list of per-trajectory values, dict, or a plain scalar"
        )
    if len(elems) != B:
        raise entries_error(path, len(elems), B)
    node = {"t": "seq", "container": container, "elem": _encode_elems(enc, path, elems)}
    if container == "ndarray":
        node["np_dtype"] = v.dtype.str
    return node


def encode(batch: Any, *, step: int, split: str, meta: dict | None = None,
           extra: dict | None = None) -> pa.Table:
    """Encode ``batch`` into an Arrow table whose schema metadata holds the spec."""
    plain, container = adapters.unwrap(batch)
    return encode_plain(plain, container, step=step, split=split, meta=meta, extra=extra)


def encode_plain(batch: Any, container: dict | None, *, step: int, split: str, meta: dict | None = None,
                 extra: dict | None = None) -> pa.Table:
    """``encode`` of a batch already unwrapped by ``adapters.unwrap`` (``container`` is its tag)."""
    if isinstance(batch, Mapping):
        for k in batch:
            if type(k) is not str:
                raise UnsupportedTypeError(f"batch key {k!r} is a {type(k).__name__}; keys must be str")
        ctx = _layout(batch)
        enc = _Encoder(ctx["B"])
        spec = {"t": "batch", "form": ctx["form"], "B": ctx["B"]}
        if ctx["form"] == "padded":
            spec.update(T=ctx["T"], side=ctx["side"])
        spec["keys"] = [[k, _encode_field(enc, ctx, (k,), v)] for k, v in batch.items()]
    elif isinstance(batch, list | tuple):
        enc = _Encoder(len(batch))
        spec = {"t": "seq", "container": type(batch).__name__, "elem": _encode_elems(enc, (), list(batch))}
        if spec["elem"].get("t") not in ("struct", "empty"):
            raise UnsupportedTypeError(
                "a list batch must hold one dict (or None) per trajectory; "
                f"got {sorted({type(e).__name__ for e in batch})}"
            )
        _mark_list_tokens(spec["elem"], batch)
    else:
        raise UnsupportedTypeError(
            f"batch of type {type(batch).__name__} is not supported; pass a dict of tensors, "
            "a list of per-trajectory dicts, a TensorDict or a DataProto-like object"
        )
    if container is not None:
        spec["wrapper"] = container
    doc = {"format_version": 1, "step": step, "split": split, "num_rows": enc.n,
           "meta": meta or {}, "batch": spec, **(extra or {})}
    step_col = pa.array(np.full(enc.n, step, dtype=np.int64))
    fields = [pa.field("step", pa.int64())] + enc.fields
    schema = pa.schema(fields, metadata={"trajstore": _dumps(doc)})
    return pa.Table.from_arrays([step_col] + enc.arrays, schema=schema)


def _mark_list_tokens(elem: dict, batch: list | tuple) -> None:
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


# ----------------------------------------------------------------------------- decoder
def _walk_cols(node: dict, out: list) -> None:
    if "col" in node:
        out.append(node["col"])
    if "shape_col" in node:
        out.append(node["shape_col"])
    if "pad_col" in node:
        out.append(node["pad_col"])
    for _, child in node.get("keys", []):
        _walk_cols(child, out)
    if "elem" in node:
        _walk_cols(node["elem"], out)


def columns_for(spec: dict, columns: list[str] | None) -> list[str] | None:
    """Arrow columns needed to decode the top-level fields ``columns`` (None: all)."""
    if columns is None:
        return None
    keys = dict(spec["keys"] if spec["t"] == "batch" else spec["elem"].get("keys", []))
    out: list[str] = []
    for c in columns:
        if c not in keys:
            raise ConfigError(f"field {c!r} is not in this step; fields: {sorted(keys)}")
        _walk_cols(keys[c], out)
    return out


class _Cols:
    """Access to a decoded table's columns: zero-copy where a column is one chunk. ``alloc(n,
    dtype)`` gives the numpy buffer a multi-chunk column is joined into (default ``_empty``, Arrow's
    allocator; the GPU path passes pinned staging memory, so the join is the only host copy)."""

    def __init__(self, table: pa.Table, where: str, alloc=None):
        self.table, self.where = table, where
        self.alloc = alloc or _empty
        self._parts: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def col(self, name: str) -> pa.ChunkedArray:
        try:
            return self.table.column(name)
        except KeyError:
            raise FormatError(f"{self.where}: column {name!r} named in the spec is missing from the file") from None

    def arr(self, name: str) -> pa.Array:
        col = self.col(name)
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()

    def _list_col(self, name: str) -> pa.ChunkedArray:
        col = self.col(name)
        if not pa.types.is_large_list(col.type):
            raise FormatError(f"{self.where}: column {name!r} is {col.type}, expected large_list")
        return col

    def chunks(self, name: str, dtype: str) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
        """(offsets of every row, counted from 0; [(first row, values)] per chunk) of a large_list
        column, without joining the chunks."""
        col = self._list_col(name)
        off, parts, r = _offsets(col.chunks), [], 0
        for c in col.chunks:
            parts.append((r, _values(c, dtype, name, self.where)))
            r += len(c)
        return off, parts

    def join(self, names: list[tuple[str, str]]) -> None:
        """Join the chunks of the large_list columns ``[(name, dtype)]`` into one buffer each,
        every chunk of every column copied in one round on the thread pool."""
        copies: list = []
        for name, dtype in names:
            if name in self._parts or name not in self.table.column_names:
                continue
            col = self._list_col(name)
            if col.num_chunks == 1:
                self._parts[name] = _list_chunk(col.chunk(0), name, self.where, dtype)
                continue
            off = _offsets(col.chunks)
            out = self.alloc(int(off[-1]), dt.storage_numpy(dtype))
            self._parts[name] = (off, out)
            r = 0
            for c in col.chunks:
                dst = out[off[r]:off[r + len(c)]]
                r += len(c)
                if dtype == "bool":  # unpacked from its bitmap on the pool thread
                    copies.append((c, dtype, name, dst))
                    continue
                src = _values(c, dtype, name, self.where)
                step = max(1, PIECE_BYTES // max(1, src.itemsize))
                copies += [(src[i:i + step], None, name, dst[i:i + step]) for i in range(0, len(src), step)]

        def copy(group: list) -> None:
            for src, dtype, name, dst in group:
                dst[...] = src if dtype is None else _values(src, dtype, name, self.where)

        run_parallel(copy, balance(copies, lambda x: x[3].nbytes, PIECE_BYTES),
                     sum(x[3].nbytes for x in copies))

    def list_parts(self, name: str, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, values) of a large_list column, its chunks joined (``join``)."""
        if name not in self._parts:
            self.join([(name, dtype)])
        off, v = self._parts[name]
        if v.dtype != dt.storage_numpy(dtype):
            raise FormatError(f"{self.where}: column {name!r} stores {v.dtype}, spec says {dtype}")
        return off, v

    def prim(self, name: str, dtype: str) -> np.ndarray:
        return _checked(self.arr(name), dtype, name, self.where)


def _empty(n: int, dtype: Any) -> np.ndarray:
    """An uninitialized numpy array in memory from Arrow's allocator, which hands out pages it
    freed earlier still mapped: filling a fresh ``np.empty`` page-faults (a packed step decoded
    ~1.5x slower on the GPU host; benchmarks/RESULTS.md)."""
    dtype = np.dtype(dtype)
    return np.frombuffer(pa.allocate_buffer(max(1, n * dtype.itemsize)), dtype, count=n)


def _np(a: pa.Array) -> np.ndarray:
    """A null-free Arrow array as numpy: zero-copy for numbers; bools are unpacked from the bitmap
    with ``np.unpackbits`` (~10x faster than Arrow's conversion)."""
    if pa.types.is_boolean(a.type) and not a.null_count and len(a):
        bits = np.frombuffer(a.buffers()[1], np.uint8)
        return np.unpackbits(bits, count=a.offset + len(a), bitorder="little")[a.offset:].view(np.bool_)
    return a.to_numpy(zero_copy_only=False)


def _offsets(chunks: list) -> np.ndarray:
    """The row offsets of a chunked large_list column, counted from 0 across its chunks."""
    rows = sum(len(c) for c in chunks)
    off = np.empty(rows + 1, np.int64)
    off[0] = r = p = 0
    for c in chunks:
        o = c.offsets.to_numpy()
        off[r + 1:r + len(o)] = o[1:] - o[0] + p
        r, p = r + len(o) - 1, p + int(o[-1] - o[0])
    return off


def _values(c: pa.Array, dtype: str, name: str, where: str) -> np.ndarray:
    """The values of one large_list chunk, as numpy (zero-copy but for bools), checked."""
    o = c.offsets.to_numpy()
    a, b = (int(o[0]), int(o[-1])) if len(o) else (0, 0)
    return _checked(c.values.slice(a, b - a), dtype, name, where)


def _checked(vals: pa.Array, dtype: str, name: str, where: str) -> np.ndarray:
    """A tensor's values as numpy (``_np``), checked: no nulls, the storage dtype the spec names."""
    if vals.null_count:
        raise FormatError(f"{where}: column {name!r} holds null values inside a tensor")
    v = _np(vals)
    if v.dtype != dt.storage_numpy(dtype):
        raise FormatError(f"{where}: column {name!r} stores {v.dtype}, spec says {dtype}")
    return v


def _list_chunk(a: pa.Array, name: str, where: str, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    o = a.offsets.to_numpy()
    return o - o[0], _values(a, dtype, name, where)


_out = dt.as_value


def _from_b64(node: dict):
    raw = base64.b64decode(node["data"], validate=True)
    a = np.frombuffer(raw, dtype=dt.storage_numpy(node["dtype"])).copy().reshape(node["shape"])
    return _out(a, node)


def _alloc(shape: list, node: dict) -> torch.Tensor:
    # from Arrow's allocator (``_empty``): a padded [B, T] output decoded ~15% faster than into
    # np.empty, and ~4x faster than into torch.empty (benchmarks/RESULTS.md)
    a = _empty(math.prod(shape), dt.storage_numpy(node["dtype"])).reshape(shape)
    return dt.from_storage(a, node["dtype"])


def _fill(shape: list, node: dict, pad: int | None) -> torch.Tensor:
    out = _alloc(shape, node)
    dt.bits_view(out).fill_(pad or 0)
    return out


class _Decoder:
    def __init__(self, cols: _Cols, spec: dict, layout: str | None):
        self.c, self.spec, self.layout = cols, spec, layout
        self.n = spec.get("B", 0)
        self._masks: dict = {}  # (T, side, lengths) -> [B, T] mask, shared by the padded fields
        self._pads: list = []   # padded outputs still to fill: (out, mask, src, row offsets, pad)

    # -- dict batches
    def batch(self, keys: list[str] | None) -> Any:
        spec = self.spec
        if spec["t"] == "seq":
            if self.layout:
                raise ConfigError(f"{self.c.where}: layout conversion applies to dict batches, "
                                  "this step is a list of trajectories")
            return self.seq(spec, self.c.table.num_rows, keys)
        chosen = [(k, n) for k, n in spec["keys"] if keys is None or k in keys]
        want = self.layout or spec["form"]
        if self.layout and spec["form"] not in ("padded", "packed"):
            raise ConfigError(
                f"{self.c.where}: layout={self.layout!r} needs a batch stored with attention_mask or "
                f"cu_seqlens; this one is {spec['form']!r}"
            )
        if self.layout == "padded" and spec["form"] == "padded" and spec["side"] is None:
            want = "padded"
        self.lengths = None
        if want == "packed":  # every flat field joined in one parallel round
            self.c.join([(n["col"], n["dtype"]) for _, n in chosen if n.get("t") == "tensor"
                         and (n.get("kind") == "token" or n.get("trail")) and isinstance(n.get("col"), str)])
        out = {}
        for k, node in chosen:
            if want != spec["form"] and k in ("cu_seqlens", "max_seqlen", "attention_mask"):
                continue
            out[k] = self.field(node, want)
        if want != spec["form"]:
            lengths = self._lengths(chosen)
            if want == "packed":
                cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
                torch.cumsum(torch.as_tensor(lengths), 0, out=cu[1:])
                out["cu_seqlens"] = cu
                out["max_seqlen"] = int(max(lengths)) if len(lengths) else 0
            else:
                T = int(max(lengths)) if len(lengths) else 0
                out["attention_mask"] = torch.arange(T)[None, :] < torch.as_tensor(lengths)[:, None]
        self._fill_padded()
        return out

    def _lengths(self, chosen) -> np.ndarray:
        # any per-token field that was read gives the lengths (the reader may leave out the
        # attention_mask column when it converts a padded batch to packed)
        for _, node in list(chosen) + list(self.spec["keys"]):
            if node.get("kind") == "token" and node.get("col") in self.c.table.column_names:
                off, _ = self.c.list_parts(node["col"], node["dtype"])
                return np.diff(off) // max(1, math.prod(node["trail"]))
        cu = dict(self.spec["keys"]).get("cu_seqlens")
        if cu is not None and cu.get("t") == "gtensor":
            c = np.asarray(_from_b64(cu), dtype=np.int64)
            return np.diff(c)
        raise ConfigError(
            f"{self.c.where}: converting the layout needs a per-token field; include one in columns"
        )

    def field(self, node: dict, want: str) -> Any:
        t = node["t"]
        if t == "json":
            return node["v"]
        if t == "gtensor":
            return _from_b64(node)
        if t == "group":
            return {k: self.field(n, want) for k, n in node["keys"]}
        if t == "seq":
            return self.seq(node, self.n, None)
        if t != "tensor":
            raise FormatError(f"{self.c.where}: unknown node type {t!r} in the spec")
        spec = self.spec
        if node["kind"] == "sample":
            if node["trail"]:
                _, v = self.c.list_parts(node["col"], node["dtype"])
                x = _out(v, node).reshape([self.n] + node["trail"])
            else:
                x = _out(self.c.prim(node["col"], node["dtype"]), node)
            if node.get("tokenlike") and want == "packed":
                mask = self._mask_from_rows()
                bits = _bits(x if isinstance(x, np.ndarray) else x.contiguous())[mask].contiguous()
                return _as_lib(bits.view(_fill([0], node, 0).dtype), node)
            return x
        trail = node["trail"]
        w = max(1, math.prod(trail))
        if want == "packed":
            off, v = self.c.list_parts(node["col"], node["dtype"])
            if len(off) != self.n + 1 or (len(v) and int(off[-1]) - int(off[0]) != len(v)):
                raise FormatError(f"{self.c.where}: column {node['col']!r} has inconsistent offsets")
            return _out(v, node).reshape([-1] + trail) if w else _out(v, node).reshape([0] + trail)
        # padded: scatter straight from each row group's values (no joined copy)
        off, parts = self.c.chunks(node["col"], node["dtype"])
        if len(off) != self.n + 1:
            raise FormatError(f"{self.c.where}: column {node['col']!r} has inconsistent offsets")
        lengths = np.diff(off) // w if w else np.zeros(self.n, np.int64)
        if w and bool((np.diff(off) % w).any()):
            raise FormatError(f"{self.c.where}: column {node['col']!r} rows are not whole tokens of {trail}")
        T = spec["T"] if spec["form"] == "padded" else (int(lengths.max()) if len(lengths) else 0)
        if len(lengths) and int(lengths.max()) > T:
            raise FormatError(f"{self.c.where}: column {node['col']!r} has a row of {int(lengths.max())} "
                              f"tokens, longer than the padded length {T}")
        side = spec.get("side") or "right"
        key = (T, side, lengths.tobytes())
        mask = self._masks.get(key)
        if mask is None:
            mask = self._masks[key] = _mask(lengths, T, side)
        out = _alloc([self.n, T] + trail, node)
        pads = self._padvals(node, lengths, T, w, parts)
        for i, ((r0, v), r1) in enumerate(zip(parts, [r for r, _ in parts[1:]] + [self.n])):
            x = _out(v, node)
            src = _bits(x if isinstance(x, np.ndarray) else x.contiguous()).reshape(-1)
            pv = None if pads is None else (pads[0] - pads[0][r0], pads[1][i])
            self._pads.append((out, mask, src, off - off[r0], node.get("pad") or 0, r0, r1, pv))
        return _as_lib(out, node)

    def _padvals(self, node: dict, lengths: np.ndarray, T: int, w: int, parts: list):
        """Offsets and per-chunk bits of the ``pad_col`` values, checked against the lengths."""
        if "pad_col" not in node:
            return None
        poff, pparts = self.c.chunks(node["pad_col"], node["dtype"])
        if len(poff) != self.n + 1 or not np.array_equal(np.diff(poff), (T - lengths) * w) \
                or [r for r, _ in pparts] != [r for r, _ in parts]:
            raise FormatError(f"{self.c.where}: column {node['pad_col']!r} does not hold the padded "
                              f"positions of {node['col']!r}")
        return poff, [_bits(_out(v, node) if node["lib"] != "torch" else _out(v, node).contiguous()
                            ).reshape(-1) for _, v in pparts]

    def _fill_padded(self) -> None:
        """Fill every padded output: pad value, then the row values (numpy boolean assignment,
        row-major; ~2x faster than torch ``masked_scatter_``). Each output is split into row
        ranges, filled on the shared thread pool."""
        jobs, total = [], 0
        for out, mask, src, off, pad, r0, r1, pv in self._pads:
            nbytes = out[r0:r1].numel() * out.element_size()
            total += nbytes
            k = max(1, min(r1 - r0, nbytes // (4 << 20)))
            bounds = np.linspace(r0, r1, k + 1).astype(np.int64)
            jobs += [(out, mask, src, off, pad, int(a), int(b), pv)
                     for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        self._pads = []

        def fill(job) -> None:
            out, mask, src, off, pad, a, b, pv = job
            o = dt.bits_view(out[a:b]).numpy()  # numpy: one thread per job, no torch pool
            m = mask[a:b].numpy()
            mm = np.broadcast_to(m.reshape(m.shape + (1,) * (o.ndim - 2)), o.shape)
            if pv is None:
                o.fill(pad)
            else:  # the recorded padded values
                o[~mm] = pv[1][pv[0][a]:pv[0][b]].numpy()
            o[mm] = src[off[a]:off[b]].numpy()  # row-major order, as masked_scatter_

        run_parallel(fill, jobs, total)

    def _mask_from_rows(self) -> torch.Tensor:
        for _, node in self.spec["keys"]:
            if node.get("kind") == "token" and node.get("col") in self.c.table.column_names:
                off, _ = self.c.list_parts(node["col"], node["dtype"])
                w = max(1, math.prod(node["trail"]))
                return _mask(np.diff(off) // w, self.spec["T"], self.spec["side"] or "right")
        raise ConfigError(f"{self.c.where}: cannot convert to packed without a per-token field")

    # -- per-trajectory sequences
    def seq(self, node: dict, n: int, keys: list[str] | None) -> Any:
        elems = self.elems(node["elem"], n, keys)
        c = node["container"]
        if c == "list":
            return elems
        if c == "tuple":
            return tuple(elems)
        dtype = np.dtype(node["np_dtype"])
        if dtype.kind == "O":
            arr = np.empty(n, dtype=object)
            for i, e in enumerate(elems):
                arr[i] = e
            return arr
        return np.array(elems, dtype=dtype).reshape(n)

    def elems(self, node: dict, n: int, keys: list[str] | None = None) -> list:
        t = node.get("t")
        if t == "empty":
            out: list = [None] * n
        elif t == "cell":
            off, v = self.c.list_parts(node["col"], node["dtype"])
            shapes = self.c.arr(node["shape_col"]).to_pylist()
            out = [None] * n
            for i, shp in enumerate(shapes):
                if shp is not None:
                    x = v[off[i] - off[0]: off[i + 1] - off[0]]
                    if any(type(d) is not int or d < 0 for d in shp) or math.prod(shp) != len(x):
                        raise FormatError(f"{self.c.where}: column {node['col']!r} row {i} has shape {shp} "
                                          f"but {len(x)} values")
                    out[i] = _out(x.reshape(shp), node)
        elif t == "value":
            vals = self.c.arr(node["col"]).to_pylist()
            out = [json.loads(x) if node["ptype"] == "json" and x is not None else x for x in vals]
        elif t == "struct":
            out = [{} for _ in range(n)]
            for k, child in node["keys"]:
                if keys is not None and k not in keys:
                    continue
                vals = self.elems(child, n)
                miss = set(child.get("missing", ()))
                for i in range(n):
                    if i not in miss:
                        out[i][k] = vals[i]
        else:
            raise FormatError(f"{self.c.where}: unknown element type {t!r} in the spec")
        for i in node.get("none", ()):
            out[i] = None
        for i in node.get("missing", ()):
            out[i] = None  # the parent struct drops the key
        if len(out) != n:
            raise FormatError(f"{self.c.where}: column {node.get('col')!r} has {len(out)} rows, expected {n}")
        return out


def _as_lib(t: torch.Tensor, node: dict):
    return t if node["lib"] == "torch" else t.numpy()


def _mask(lengths: np.ndarray, T: int, side: str) -> torch.Tensor:
    """The [B, T] bool mask of ``lengths`` right- or left-aligned, built by row ranges in parallel."""
    L = np.asarray(lengths, dtype=np.int64).reshape(-1)
    out = np.empty((len(L), T), np.bool_)
    ar = np.arange(T)

    def rows(ab: tuple[int, int]) -> None:
        a, b = ab
        if side == "right":
            np.less(ar[None, :], L[a:b, None], out=out[a:b])
        else:
            np.greater_equal(ar[None, :], (T - L[a:b])[:, None], out=out[a:b])

    bounds = np.linspace(0, len(L), max(1, min(len(L), out.nbytes // (1 << 20))) + 1).astype(np.int64)
    run_parallel(rows, [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a], out.nbytes)
    return torch.from_numpy(out)


def decode(table: pa.Table, spec: dict, *, where: str, columns: list[str] | None = None,
           layout: str | None = None, alloc=None) -> Any:
    """Rebuild the batch from ``table`` (already restricted to the needed columns); ``alloc(n,
    numpy dtype)`` provides the buffers multi-chunk columns are joined into (see ``_Cols``)."""
    if layout not in (None, "padded", "packed"):
        raise ConfigError(f"layout must be 'padded', 'packed' or None, got {layout!r}")
    try:
        out = _Decoder(_Cols(table, where, alloc), spec, layout).batch(columns)
        return adapters.wrap(out, spec.get("wrapper"))
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError, ArithmeticError,
            pa.ArrowException) as e:
        if isinstance(e, (FormatError, ConfigError)):
            if where in str(e):
                raise
            raise type(e)(f"{where}: {e}") from e
        raise FormatError(f"{where}: the file does not match its own spec ({type(e).__name__}: {e}); "
                          "the file is damaged or was not written by trajstore") from e
