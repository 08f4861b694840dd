"""Strategies for the non-tensor values of a batch: verl's ``non_tensor_batch`` (numpy object arrays, lists,
batch-wide scalars) and every value trajstore keeps typed (numpy scalars and arrays of any dtype, bytes,
tuples, dicts with keys that are not str, tensors inside values), in plain and DataProto-like batches."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from ..format.batch.containers import DataProtoLike
from .bits import tensors


def _object_array(vals: list) -> np.ndarray:
    """A one-dimensional object array of ``vals`` (``np.array`` would make lists of one length a 2-D array)."""
    a = np.empty(len(vals), dtype=object)
    for i, v in enumerate(vals):
        a[i] = v
    return a


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=8,
)


def non_tensor_values(n: int) -> st.SearchStrategy[list]:
    """One per-sample value list of a single kind: str / int / float / bool / JSON / None mix."""
    leaf = st.sampled_from(["str", "int", "float", "bool", "json"])

    @st.composite
    def _one(draw: st.DrawFn) -> list:
        kind = draw(leaf)
        base = {"str": st.text(max_size=6), "int": st.integers(-(2**63), 2**63 - 1),
                "float": st.floats(), "bool": st.booleans(), "json": _json}[kind]
        return [draw(st.none() | base) for _ in range(n)]

    return _one()


@st.composite
def non_tensor_batches(draw: st.DrawFn, max_batch: int = 5) -> dict[str, Any]:
    """verl-style ``non_tensor_batch``: numpy object arrays, plus plain lists and scalars."""
    B = draw(st.integers(0, max_batch))
    batch: dict[str, Any] = {"rewards": draw(tensors((B,), [torch.float32]))}
    for i in range(draw(st.integers(1, 3))):
        vals = draw(non_tensor_values(B))
        batch[f"nt{i}"] = _object_array(vals) if draw(st.booleans()) else vals
    batch["uid"] = np.array([f"u{j}" for j in range(B)]) if B else np.array([], dtype="<U1")
    batch["global_flag"] = draw(st.none() | st.booleans() | st.integers(0, 9) | st.text(max_size=3))
    batch["temperature"] = torch.tensor(draw(st.floats(0, 2)), dtype=torch.float32)
    return batch


_NP_SCALAR_DTYPES = ["?", "u1", "i1", "<i2", "<i4", "<i8", "<u8", "<f2", "<f4", "<f8", "<c16", "<M8[ns]",
                     "<M8[D]", "<m8[s]", "S4", "<U3"]


@st.composite
def _np_arrays(draw: st.DrawFn, shape: tuple) -> np.ndarray:
    """A numpy array of a non-object dtype (datetime64, bytes, str, complex included), arbitrary bits
    for the fixed-width numeric ones."""
    d = np.dtype(draw(st.sampled_from(_NP_SCALAR_DTYPES)))
    n = math.prod(shape)
    if d.kind in "SU":
        chars = st.characters(min_codepoint=1, max_codepoint=0x7F if d.kind == "S" else 0x2FFF,
                              exclude_categories=("Cs",))
        text = st.text(chars, max_size=d.itemsize // (4 if d.kind == "U" else 1))
        vals = [draw(text) for _ in range(n)]
        return np.array([v.encode() if d.kind == "S" else v for v in vals], dtype=d).reshape(shape)
    raw = draw(st.binary(min_size=n * d.itemsize, max_size=n * d.itemsize))
    if d.kind == "b":
        return np.frombuffer(raw, dtype=np.uint8).reshape(shape) != 0
    return np.frombuffer(raw, dtype=d).reshape(shape).copy()


def typed_values(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    """Any non-tensor value a batch may hold: JSON scalars, bytes, numpy scalars and arrays of any
    dtype trajstore keeps (object arrays of any shape included), tensors, and lists, tuples and dicts
    with str, int, tuple or None keys (``"$t"`` too) nested in each other."""
    keys = st.text(max_size=4) | st.just("$t") | st.integers(-5, 5) | st.none() | st.tuples(st.integers(0, 3))
    scalar_arrays = st.builds(lambda a: a[()], _np_arrays(()))
    leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6)
            | st.binary(max_size=6) | scalar_arrays
            | st.lists(st.integers(0, 3), max_size=2).map(tuple).flatmap(_np_arrays)
            | tensors((2,), [torch.float32, torch.bfloat16, torch.int64]))

    def extend(children: st.SearchStrategy) -> st.SearchStrategy:
        def obj_array(items: list) -> np.ndarray:
            a = _object_array(items)
            return a.reshape((len(items) // 2, 2)) if len(items) % 2 == 0 and items else a

        return (st.lists(children, max_size=3) | st.lists(children, max_size=3).map(tuple)
                | st.dictionaries(keys, children, max_size=3) | st.lists(children, max_size=4).map(obj_array))

    return st.recursive(leaf, extend, max_leaves=max_leaves)


@st.composite
def typed_batches(draw: st.DrawFn, max_batch: int = 4, dataproto: bool = False) -> Any:
    """Batches whose non-tensor fields hold ``typed_values``: per trajectory (object arrays of one and
    two dimensions, lists, datetime64 / bytes / str arrays of any shape), batch-wide values, and
    with ``dataproto``, sometimes the ``meta_info`` of a DataProto-like batch (format/batch/containers.py)."""
    B = draw(st.integers(1, max_batch))
    vals = st.lists(typed_values(), min_size=B, max_size=B)
    batch: dict[str, Any] = {"rewards": draw(tensors((B,), [torch.float32])),
                             "nt": _object_array(draw(vals)), "lst": draw(vals),
                             "arr": draw(st.sampled_from([(B,), (B, 2), (B, 1, 2)]).flatmap(_np_arrays)),
                             "wide": draw(st.dictionaries(st.integers(0, 3), typed_values(), min_size=1, max_size=3)
                                          | st.binary(max_size=4)), "scalar": draw(st.builds(lambda a: a[()], _np_arrays(())))}
    obj2 = np.empty((B, 2), dtype=object)
    for i, v in enumerate(draw(st.lists(typed_values(), min_size=2 * B, max_size=2 * B))):
        obj2.reshape(-1)[i] = v
    batch["nt2"] = obj2
    if not dataproto or not draw(st.booleans()):
        return batch
    meta = draw(st.dictionaries(st.text(max_size=4) | st.integers(0, 3), typed_values(), max_size=3))
    return DataProtoLike(batch=None, non_tensor_batch={k: v for k, v in batch.items() if isinstance(v, np.ndarray)
                                                       and v.ndim and len(v) == B}, meta_info=meta)
