"""Typed values: the one encoding of a non-tensor value that plain JSON cannot hold exactly
(docs/FORMAT.md section 3.8), used alike for per-trajectory values (element ``value`` with ptype
``tjson``), batch-wide values (field node ``tvalue``) and a DataProto's ``meta_info``
(``meta_info_t``).

A typed document is JSON: ``null``, booleans, numbers, strings and arrays stand for themselves
(arrays are lists); an object without a ``"$t"`` key is a dict with those str keys; an object with
a ``"$t"`` key is one of:

* ``{"$t": "tuple", "v": [...]}``;
* ``{"$t": "dict", "v": [[key, value], ...]}``: a dict whose keys are not all str (or has a ``"$t"`` key);
* ``{"$t": "bytes", "v": base64}``;
* ``{"$t": "np", "dtype": numpy dtype.str, "v": base64}``: a numpy scalar, its bytes;
* ``{"$t": "ndarray", "dtype": dtype.str, "shape": [...], "v": base64 | [items]}``: a numpy array, its
  C-order bytes, or for dtype ``|O`` its items in C order;
* ``{"$t": "tensor", "dtype": trajstore dtype name, "shape": [...], "v": base64}``: a torch tensor's
  little-endian storage bytes (bfloat16 as its bits);
* ``{"$t": "float", "v": "nan" | "inf" | "-inf", "bits"?: 16 hex digits}``: a Python float JSON has
  no number for (format version 3), ``bits`` its IEEE 754 bits where a NaN is not the usual one, so
  every document is strict JSON (Polars ``json_decode``, DuckDB ``json``) and NaN payloads survive.
* ``{"$t": "obj", "cls": "module:qualname", "v": {field: value, ...}}`` (format version 4): a
  dataclass value of a framework's class trajstore knows (``VALUE_CLASSES``: SkyRL's
  ``TrajectoryID``), rebuilt as that class where its package is installed, else as the dict of its
  fields.

``needs_typed`` walks a value on the caller's thread (no tensor value is read) and says whether it
is plain JSON (stored as today) or needs this encoding; it raises ``UnsupportedTypeError`` naming
the place for what neither can hold. ``encode`` and ``decode`` convert; ``decode`` checks a
document from a file and raises ``FormatError``. ``step_meta`` reads a step's metadata, stored as
plain JSON (``meta``) or, where it needs this encoding, as ``meta_t`` (docs/FORMAT.md 3.6).
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import struct
from typing import Any

import numpy as np

from ..errors import BatchError, FormatError, UnsupportedTypeError
from ..integrations import class_path, load_class, skyrl
from . import dtypes as dt
from .limits import MAX_VALUE_DEPTH
from .values import check_tensor, cycle_error, is_tensor

__all__ = ["needs_typed", "check_np_dtype", "encode", "decode", "version", "step_meta", "STORABLE", "MAX_DEPTH"]

VALUE_CLASSES = skyrl.VALUE_CLASSES  # dataclasses stored as ``obj`` documents, field by field
MAX_DEPTH = MAX_VALUE_DEPTH  # format/limits.py: one set for writer and reader
TAG = "$t"
STORABLE = ("None, bool, int, float, str, bytes, list, tuple, dict, a numpy scalar or array, "
            "or a torch tensor")
_NP_DTYPE = re.compile(r"^[<>|=]?(b1|[iu][1248]|f[248]|c(8|16)|[SU]\d{1,9}|[Mm]8(\[\d{0,4}[a-zA-Z]{1,2}\])?|O)$")
_PLAIN = (type(None), bool, int, float, str)
_NAN = 0x7FF8000000000000  # the bits of float("nan")


def _at(what: str, at: list) -> str:
    return what + "".join(f"[{p!r}]" if type(p) is str else f"[{p}]" for p in at)


def _np_dtype_ok(d: np.dtype) -> bool:
    return d.kind in "biufcSUMmO" and bool(_NP_DTYPE.match(d.str))


def needs_typed(v: Any, what: str) -> bool:
    """Whether ``v`` needs the typed encoding (False: plain JSON, stored as before). Raises
    UnsupportedTypeError (naming ``what`` and the place inside it) for what cannot be stored."""
    return _walk(v, what, [], 0, set())


def _walk(v: Any, what: str, at: list, depth: int, open_: set[int]) -> bool:
    t = type(v)
    if t in _PLAIN:
        if t is str and not v.isascii():
            _utf8(v, what, at)
        return t is float and not math.isfinite(v)  # NaN / inf: not strict JSON, typed ("float")
    if depth >= MAX_DEPTH:
        raise BatchError(f"{_at(what, at)[:120]}...: a value nests more than {MAX_DEPTH} levels deep; flatten it")
    if id(v) in open_:  # a container inside itself: no walk would end
        raise cycle_error(_at(what, at))
    open_.add(id(v))
    try:
        return _inner(v, t, what, at, depth, open_)
    finally:
        open_.discard(id(v))


def _inner(v: Any, t: type, what: str, at: list, depth: int, open_: set[int]) -> bool:
    """``_walk`` of a value that is not a plain scalar, once it is on the path ``open_``."""
    if t is list or t is tuple:
        typed = t is tuple
        for i, x in enumerate(v):
            at.append(i)
            typed |= _walk(x, what, at, depth + 1, open_)
            at.pop()
        return typed
    if t is dict:
        typed = False
        for k, x in v.items():
            if type(k) is not str or k == TAG:
                typed = True
                at.append(k)
                _walk(k, what + " key", at, depth + 1, open_)
                at.pop()
            elif not k.isascii():
                _utf8(k, what + " key", at)
            at.append(k)
            typed |= _walk(x, what, at, depth + 1, open_)
            at.pop()
        return typed
    if t is bytes:
        return True
    if isinstance(v, np.generic | np.ndarray):
        if isinstance(v, np.ma.MaskedArray):
            raise UnsupportedTypeError(f"{_at(what, at)}: numpy masked arrays are not supported (the mask would "
                                       "be lost); store .filled() values and the mask separately")
        check_np_dtype(v, _at(what, at))
        if v.dtype.kind == "O":
            for i, x in enumerate(v.reshape(-1)):
                at.append(i)
                _walk(x, what, at, depth + 1, open_)
                at.pop()
        return True
    if is_tensor(v):
        check_tensor(v, (_at(what, at),))
        return True
    if class_path(t) in VALUE_CLASSES and hasattr(v, "__dataclass_fields__"):
        at.append(t.__name__)
        _walk(_obj_fields(v), what, at, depth + 1, open_)
        at.pop()
        return True
    raise UnsupportedTypeError(f"{_at(what, at)}: a value of type {t.__module__}.{t.__qualname__} cannot be "
                               f"stored; convert it to {STORABLE} (e.g. dataclasses.asdict, or str)")


def _obj_fields(v: Any) -> dict:
    names = list(v.__dataclass_fields__)
    extra = [k for k in getattr(v, "__dict__", ()) if k not in names]
    if extra:
        raise BatchError(f"a {type(v).__qualname__} value carries attributes {extra[:8]} besides its fields: "
                         "they would be lost; store them as fields of their own")
    return {n: getattr(v, n) for n in names}


def check_np_dtype(v: np.ndarray | np.generic, what: str) -> None:
    """Raise unless a numpy array's (or scalar's) dtype is one a typed value keeps."""
    if not _np_dtype_ok(v.dtype) or (v.dtype.kind == "O" and isinstance(v, np.generic)):
        raise UnsupportedTypeError(f"{what}: numpy dtype {v.dtype} cannot be stored; convert it to a bool, "
                                   "integer, float, complex, str, bytes, datetime64 or object dtype")


def _utf8(s: str, what: str, at: list) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise BatchError(f"{_at(what, at)}: string {s[:40]!r} is not valid UTF-8 (it holds a lone surrogate); "
                         "fix the text or store it as bytes") from None


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def encode(v: Any) -> Any:
    """The typed document of a value ``needs_typed`` accepted (tensors are copied to the CPU)."""
    t = type(v)
    if t in _PLAIN:
        return v if t is not float or math.isfinite(v) else _float(v)
    if t is list:
        return [encode(x) for x in v]
    if t is tuple:
        return {TAG: "tuple", "v": [encode(x) for x in v]}
    if t is dict:
        if all(type(k) is str and k != TAG for k in v):
            return {k: encode(x) for k, x in v.items()}
        return {TAG: "dict", "v": [[encode(k), encode(x)] for k, x in v.items()]}
    if t is bytes:
        return {TAG: "bytes", "v": _b64(v)}
    if isinstance(v, np.generic):
        raw = np.asarray(v).tobytes() if v.dtype.itemsize else b""  # np.bytes_(b"") is |S0
        return {TAG: "np", "dtype": v.dtype.str, "v": _b64(raw)}
    if isinstance(v, np.ndarray):
        out = {TAG: "ndarray", "dtype": v.dtype.str, "shape": list(v.shape)}
        if v.dtype.kind == "O":
            out["v"] = [encode(x) for x in v.reshape(-1)]
        else:
            out["v"] = _b64(np.ascontiguousarray(v).tobytes())
        return out
    if class_path(t) in VALUE_CLASSES:
        return {TAG: "obj", "cls": class_path(t), "v": encode(_obj_fields(v))}
    assert is_tensor(v)
    name = dt.TORCH_NAMES[v.dtype]
    x = v.detach().cpu().resolve_conj().resolve_neg().contiguous()
    return {TAG: "tensor", "dtype": name, "shape": list(x.shape), "v": _b64(dt.to_storage(x).tobytes())}


def _float(v: float) -> dict:
    """The typed document of a NaN or an infinity (strict JSON has no number for them)."""
    bits = int.from_bytes(struct.pack(">d", v), "big")
    if v != v:
        return {TAG: "float", "v": "nan"} if bits == _NAN else {TAG: "float", "v": "nan", "bits": f"{bits:016x}"}
    return {TAG: "float", "v": "inf" if v > 0 else "-inf"}


def version(doc: Any) -> int:
    """The format version a typed document needs: 4 where it holds an ``obj`` tag, 3 where it holds a
    ``float`` tag, else 2."""
    stack, out = [doc], 2
    while stack:
        d = stack.pop()
        if type(d) is list:
            stack.extend(d)
        elif type(d) is dict:
            if d.get(TAG) == "obj":
                return 4
            if d.get(TAG) == "float":
                out = 3
            stack.extend(d.values())
    return out


class _Bad(Exception):
    pass


def decode(doc: Any, where: str) -> Any:
    """The value of a typed document read from a file; FormatError (naming ``where``) if it lies."""
    try:
        return _dec(doc, 0)
    except _Bad as e:
        raise FormatError(f"{where}: a typed value is malformed: {e}; the file is damaged or was not "
                          "written by trajstore") from None
    except RecursionError:
        raise FormatError(f"{where}: a typed value nests too deeply; the file is damaged") from None


def _raw(s: Any) -> bytes:
    if type(s) is not str:
        raise _Bad(f"data {str(s)[:40]!r} is not a base64 string")
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise _Bad(f"data {s[:40]!r} is not base64") from None


def _shape(s: Any) -> list[int]:
    if type(s) is not list or len(s) > 32 or any(type(d) is not int or d < 0 for d in s):
        raise _Bad(f"shape {str(s)[:60]} is not a list of sizes")
    return s


def _dtype(s: Any) -> np.dtype:
    if type(s) is not str or not _NP_DTYPE.match(s):
        raise _Bad(f"numpy dtype {str(s)[:40]!r} is not one trajstore writes")
    try:
        return np.dtype(s)
    except TypeError:
        raise _Bad(f"numpy dtype {s!r} is not understood by numpy") from None


def _dec(d: Any, depth: int) -> Any:
    t = type(d)
    if t in _PLAIN:
        return d
    if depth > MAX_DEPTH:
        raise _Bad(f"it nests deeper than {MAX_DEPTH} levels")
    if t is list:
        return [_dec(x, depth + 1) for x in d]
    if t is not dict:
        raise _Bad(f"{t.__name__} is not a JSON value")
    if TAG not in d:
        return {k: _dec(x, depth + 1) for k, x in d.items()}
    tag, v = d.get(TAG), d.get("v")
    if tag == "tuple" and type(v) is list:
        return tuple(_dec(x, depth + 1) for x in v)
    if tag == "dict" and type(v) is list:
        out = {}
        for kv in v:
            if type(kv) is not list or len(kv) != 2:
                raise _Bad("a dict item is not a [key, value] pair")
            k = _dec(kv[0], depth + 1)
            try:
                out[k] = _dec(kv[1], depth + 1)
            except TypeError:
                raise _Bad(f"dict key {str(k)[:40]} is not hashable") from None
        return out
    if tag == "bytes":
        return _raw(v)
    if tag == "np":
        dtype = _dtype(d.get("dtype"))
        raw = _raw(v)
        if dtype.kind == "O" or len(raw) != dtype.itemsize:
            raise _Bad(f"a numpy {dtype} scalar holds {len(raw)} bytes")
        return np.frombuffer(raw, dtype)[0] if raw else dtype.type()  # the empty str_ / bytes_
    if tag == "ndarray":
        dtype, shape = _dtype(d.get("dtype")), _shape(d.get("shape"))
        n = math.prod(shape)
        if dtype.kind == "O":
            if type(v) is not list or len(v) != n:
                raise _Bad(f"an object array of shape {shape} does not hold {n} items")
            out = np.empty(n, dtype=object)
            for i, x in enumerate(v):
                out[i] = _dec(x, depth + 1)
            return out.reshape(shape)
        raw = _raw(v)
        if dtype.itemsize == 0:  # <U0 / |S0: only scalars (np.str_("")), numpy makes arrays width 1
            raise _Bad(f"a numpy array of dtype {dtype} (zero-width strings) does not exist")
        if len(raw) != n * dtype.itemsize:
            raise _Bad(f"a numpy {dtype} array of shape {shape} holds {len(raw)} bytes")
        return np.frombuffer(raw, dtype).reshape(shape).copy()
    if tag == "tensor":
        name, shape = d.get("dtype"), _shape(d.get("shape"))
        if type(name) is not str or not dt.known(name) or name in ("uint16", "uint32", "uint64"):
            raise _Bad(f"tensor dtype {name!r} is not one trajstore writes")
        raw, sd = _raw(v), dt.storage_numpy(name)
        if len(raw) != math.prod(shape) * sd.itemsize:
            raise _Bad(f"a {name} tensor of shape {shape} holds {len(raw)} bytes")
        return dt.from_storage(np.frombuffer(raw, sd).reshape(shape).copy(), name)
    if tag == "float" and v in ("nan", "inf", "-inf") and set(d) <= {TAG, "v", "bits"}:
        if "bits" not in d:
            return float(v)
        b = d["bits"]
        if v != "nan" or type(b) is not str or not re.fullmatch(r"[0-9a-f]{16}", b):
            raise _Bad(f"float bits {str(b)[:40]!r} are not 16 hex digits of a NaN")
        x = struct.unpack(">d", bytes.fromhex(b))[0]
        if x == x:
            raise _Bad(f"float bits {b} are not a NaN")
        return x
    if tag == "obj" and type(v) is dict and type(d.get("cls")) is str and d["cls"] in VALUE_CLASSES:
        fields = {k: _dec(x, depth + 1) for k, x in v.items()}
        cls = load_class(d["cls"], VALUE_CLASSES)
        try:
            return fields if cls is None else cls(**fields)
        except TypeError:  # another version of the class: its fields as a dict
            return fields
    raise _Bad(f"type tag {str(tag)[:40]!r} (or its value) is unknown")


def step_meta(doc: dict, where: str) -> dict:
    """The step metadata of a step envelope ``doc`` read from a file: its plain-JSON ``meta``, or the
    value of its typed ``meta_t`` (format version 3; never both); FormatError naming ``where`` if it lies."""
    if "meta_t" not in doc:
        meta = doc.get("meta", {})
        if type(meta) is not dict:
            raise FormatError(f"{where}: the step's meta is not an object; the file is damaged")
        return meta
    v = doc.get("format_version")
    if "meta" in doc or type(v) is not int or v < 3:
        raise FormatError(f"{where}: the step has typed metadata (meta_t) together with meta, or in a format "
                          f"version {v!r} file; the file is damaged or was not written by trajstore")
    meta = decode(doc["meta_t"], f"{where}: the step's meta")
    if type(meta) is not dict:
        raise FormatError(f"{where}: the step's typed meta is a {type(meta).__name__}, not a dict; the file is damaged")
    return meta
