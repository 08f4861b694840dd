"""Checks of the values a batch holds, and their conversions to what gets stored.

Tensor-likes (torch tensors, numeric numpy arrays and scalars) are described without reading
their values (``describe``: dtype, layout, device) and converted to contiguous CPU memory
(``as_cpu``); Python values are checked to survive a JSON round trip with identical types
(``check_json``). Every error names the field.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

from ..errors import BatchError, UnsupportedTypeError
from . import dtypes as dt
from .limits import MAX_VALUE_DEPTH
from .spec import where

__all__ = ["is_tensor", "is_tensorlike", "describe", "check_tensor", "as_cpu", "storage", "bits", "has_tensor", "cycle_error",
           "check_str", "check_json", "dumps", "number_lists", "MAX_JSON_DEPTH"]

MAX_JSON_DEPTH = MAX_VALUE_DEPTH  # format/limits.py: one set for writer and reader


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor. torch is not imported for the question: while it is not
    loaded, no tensor exists (`trajstore info`, `sql`, `verify` run without it, docs/CLI.md)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_tensorlike(x: Any) -> bool:
    """A torch tensor, or a numpy array or scalar of a bool, integer or float dtype."""
    if is_tensor(x):
        return True
    if isinstance(x, np.ndarray) and x.dtype.kind in "biuf":
        return True
    return isinstance(x, np.generic) and np.dtype(type(x)).kind in "biuf"


def check_tensor(x: torch.Tensor, path: tuple) -> str:
    """The dtype name of a storable torch tensor; raise for dtype, layout or device it cannot be."""
    import torch

    name = dt.TORCH_NAMES.get(x.dtype)
    if name is None:
        raise UnsupportedTypeError(
            f"field {where(path)!r}: torch dtype {x.dtype} is not supported; "
            f"convert it to one of {sorted(dt.TORCH_NAMES.values())}"
        )
    if x.layout != torch.strided:
        raise UnsupportedTypeError(
            f"field {where(path)!r}: {x.layout} tensors are not supported; call .to_dense() first"
        )
    if x.device.type == "meta":
        raise UnsupportedTypeError(f"field {where(path)!r}: a tensor on the meta device has no values to store")
    return name


def describe(x: Any, path: tuple) -> tuple[str, str]:
    """(lib, dtype name) of a tensor-like value, from its type alone (no value is read, no GPU sync);
    raise for what cannot be stored. ``lib`` is torch, numpy or np_scalar."""
    if is_tensor(x):
        return "torch", check_tensor(x, path)
    if isinstance(x, np.ma.MaskedArray):
        raise UnsupportedTypeError(f"field {where(path)!r}: numpy masked arrays are not supported (the mask "
                                   "would be lost); store .filled() values and the mask as two fields")
    d = x.dtype  # a numpy array or scalar (is_tensorlike)
    name = dt.NUMPY_NAMES.get(d.newbyteorder("=") if d.byteorder not in "=|" else d)
    if name is None or d.byteorder == ">":
        raise UnsupportedTypeError(
            f"field {where(path)!r}: numpy dtype {d} is not supported; "
            f"convert it to a native-endian {sorted(dt.NUMPY_NAMES.values())}"
        )
    return "np_scalar" if isinstance(x, np.generic) else "numpy", name


def as_cpu(x: Any, path: tuple) -> tuple[str, str, torch.Tensor | np.ndarray]:
    """(lib, dtype name, contiguous CPU tensor or ndarray) for a tensor-like value."""
    lib, name = describe(x, path)
    if is_tensor(x):
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return lib, name, t.resolve_conj().resolve_neg().contiguous()
    a = np.asarray(x)  # 0-d stays 0-d (np.ascontiguousarray would make it 1-d)
    return lib, name, a if a.flags.c_contiguous else np.ascontiguousarray(a)


def storage(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """A CPU tensor or array as a numpy array of its storage dtype (no copy)."""
    return dt.to_storage(x) if is_tensor(x) else x


def bits(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    """The raw bits of a CPU tensor or array as a same-width integer tensor (no copy)."""
    import torch

    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x.view(np.uint8) if x.dtype == np.bool_ else x)
    return dt.bits_view(x)


def has_tensor(v: Any, what: str = "value") -> bool:
    """Whether a tensor-like is inside ``v`` or the dicts nested in it (lists are JSON values: a
    tensor in one is an error of ``check_json``). Iterative: values may nest deeply. A dict that
    contains itself is a BatchError naming ``what`` and the keys to the cycle (``cycle_error``); a
    dict met twice without a cycle (shared) is walked once."""
    stack: list = [(v, False, ())]
    open_: set[int] = set()  # ids of the dicts on the path being walked
    done: set[int] = set()  # dicts walked whole (no tensor in them)
    while stack:
        x, leaving, at = stack.pop()
        if leaving:
            open_.discard(id(x))
            done.add(id(x))
            continue
        if is_tensorlike(x):
            return True
        if isinstance(x, Mapping):
            if id(x) in open_:
                raise cycle_error(_at(what, list(at)))
            if id(x) in done:
                continue
            open_.add(id(x))
            stack.append((x, True, at))
            stack.extend((e, False, at + (k,)) for k, e in x.items())
    return False


def cycle_error(what: str) -> BatchError:
    """The error of a value that contains itself (a dict or list holding a reference to itself, or to
    a container it is inside): no walk of it would end, and no file can hold it."""
    return BatchError(f"{what[:200]}: the value contains itself (a dict or list holding a reference to "
                      "itself or to a container it is inside); a reference cycle cannot be stored: store a "
                      "copy without the cycle")


def check_str(v: str, what: str) -> None:
    """Raise unless ``v`` encodes to UTF-8 (Arrow strings and the spec's JSON are UTF-8)."""
    if v.isascii():  # most text; no copy made
        return
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise BatchError(f"{what}: string {v[:40]!r} is not valid UTF-8 (it holds a lone surrogate); "
                         "fix the text or store it as bytes in a uint8 tensor") from None


def check_json(v: Any, what: str, _depth: int = 0) -> None:
    """Raise unless ``v`` survives a JSON round trip with identical types; ``what`` names ``v`` in
    the message (the place inside it is spelled out only for an error: this runs on every value)."""
    _json(v, what, [], _depth, set())


def _at(what: str, at: list) -> str:
    return what + "".join(f"[{p!r}]" if type(p) is str else f"[{p}]" for p in at)


def _json(v: Any, what: str, at: list, depth: int, open_: set[int]) -> None:
    t = type(v)
    if v is None or t is bool or t is int or t is float:
        return
    if t is str:
        if not v.isascii():
            check_str(v, _at(what, at))
        return
    if depth >= MAX_JSON_DEPTH:
        raise BatchError(f"{_at(what, at)[:120]}...: a value nests more than {MAX_JSON_DEPTH} lists/dicts deep; "
                         "flatten it")
    if t is list or t is dict:
        if id(v) in open_:
            raise cycle_error(_at(what, at))
        open_.add(id(v))
        _json_items(v, what, at, depth, open_)
        open_.discard(id(v))
        return
    raise UnsupportedTypeError(
        f"{_at(what, at)}: value of type {type(v).__name__} is not plain JSON; use None, bool, int, "
        "float, str, list or dict with str keys here"
    )


def _json_items(v: list | dict, what: str, at: list, depth: int, open_: set[int]) -> None:
    if type(v) is list:
        for i, x in enumerate(v):
            at.append(i)
            _json(x, what, at, depth + 1, open_)
            at.pop()
    else:
        for k, x in v.items():
            if type(k) is not str:
                raise UnsupportedTypeError(
                    f"{_at(what, at)}: dict key {k!r} is a {type(k).__name__}; only str keys round-trip exactly"
                )
            if not k.isascii():
                check_str(k, f"{_at(what, at)} key")
            at.append(k)
            _json(x, what, at, depth + 1, open_)
            at.pop()


def dumps(v: Any) -> str:
    """Compact JSON text of a value ``check_json`` accepted (non-ASCII kept, NaN and infinities allowed)."""
    return json.dumps(v, ensure_ascii=False, allow_nan=True, separators=(",", ":"))


def number_lists(rows: Iterable) -> str | None:
    """The value type of per-trajectory ``rows`` that are all lists: ``ilist`` where every item is an int
    (int64 range), ``flist`` where every item is a float (docs/FORMAT.md 3.3, format version 4); None
    otherwise (mixed or other items, or only empty lists: stored as JSON values then)."""
    kind = None
    for e in rows:
        for x in e:
            t = type(x)
            if t is not kind:
                if kind is not None or t not in (int, float):
                    return None
                kind = t
            if t is int and not -(2**63) <= x < 2**63:
                return None
    return None if kind is None else "ilist" if kind is int else "flist"
