"""The envelope of a step's description, checked by ``format/file/validate.py``: a shard's rank, a container
wrapper (TensorDict, DataProto), a struct's per-row key orders, a packed step's inline
``cu_seqlens``. Each raises ``Bad`` with what does not fit; ``validate.check`` names the file."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pyarrow as pa

from .. import dtypes as dt
from .. import typed
from ...errors import FormatError
from ..limits import MAX_DIMS, MAX_SPEC_DEPTH


class Bad(Exception):
    """What does not fit, said without the file (``validate.check`` adds it)."""


def shape(v, what: str) -> list[int]:
    if type(v) is not list or len(v) > MAX_DIMS:
        raise Bad(f"{what} is {v!r}, expected a list of at most {MAX_DIMS} sizes")
    for x in v:
        if type(x) is not int or x < 0:
            raise Bad(f"a size in {what} is {x!r}, expected an int >= 0")
    return v


def typed_doc(doc, what: str):
    """A typed document (format/typed.py) decoded: its size bounds what it allocates."""
    try:
        return typed.decode(doc, what)
    except FormatError as e:
        raise Bad(str(e).split("; the file")[0]) from None


def check_orders(ch: Any, node: dict) -> None:
    """A struct's ``orders`` (version 3): ``[[row, [key index...]], ...]``, rows unique, each a
    permutation of the indices of the keys present in that row (not ``missing`` there)."""
    if type(ch.version) is int and ch.version < 3:
        raise Bad(f"a struct with per-row key orders in a file of format version {ch.version} (it needs 3)")
    orders, kids = node["orders"], [c for _, c in node["keys"]]
    if type(orders) is not list:
        raise Bad("a struct's 'orders' is not a list")
    none, rows = set(node.get("none", ())), set()
    for o in orders:
        if type(o) is not list or len(o) != 2 or type(o[0]) is not int or not 0 <= o[0] < ch.n or o[0] in rows \
                or o[0] in none or type(o[1]) is not list:
            raise Bad(f"a struct key order {str(o)[:60]} is not a [row, [key index, ...]] of a row with a dict")
        rows.add(o[0])
        present = [j for j, c in enumerate(kids) if o[0] not in c.get("missing", ())]
        if any(type(j) is not int for j in o[1]) or sorted(o[1]) != present:  # ints first: sorted() of None fails
            raise Bad(f"the key order of row {o[0]} is not an order of the keys the row holds")


def longest(cu: dict) -> int:
    """The longest row of a packed batch's inline ``cu_seqlens`` (checked like the encoder does)."""
    if len(cu["shape"]) != 1 or not cu["dtype"].startswith(("int", "uint")):
        raise Bad("cu_seqlens is not a 1-D integer tensor")
    c = np.frombuffer(base64.b64decode(cu["data"]), dt.storage_numpy(cu["dtype"])).astype(np.int64)
    d = np.diff(c)
    if not len(c) or c[0] != 0 or bool((d < 0).any()):
        raise Bad("cu_seqlens does not start at 0 and never decrease")
    return int(d.max(initial=0))


def td_tag(tag, keys: dict, depth: int = 0) -> None:
    """A TensorDict's tag (format/batch/containers.py) that fits the fields ``keys`` it wraps."""
    if type(tag) is not dict or depth > MAX_SPEC_DEPTH:
        raise Bad("a TensorDict wrapper is not an object")
    shape(tag.get("batch_size"), "TensorDict batch_size")
    nested, non_tensor = tag.get("nested", {}), tag.get("non_tensor", {})
    if type(nested) is not dict or type(non_tensor) is not dict:
        raise Bad("a TensorDict wrapper's nested / non_tensor entries are not objects")
    for k, sub in nested.items():
        node = keys.get(k)
        if type(node) is not dict or node.get("t") != "group":
            raise Bad(f"the TensorDict wrapper nests field {k!r}, which is not a group of fields")
        td_tag(sub, dict(node["keys"]), depth + 1)
    if any(v not in ("stack", "data") for v in non_tensor.values()):
        raise Bad("a TensorDict wrapper's non-tensor entry is neither 'stack' nor 'data'")


def class_tag(w, each: bool) -> None:
    """The tag of a framework class (format/batch/classes.py, format version 4): ``each`` for a list batch."""
    if type(w) is not dict or type(w.get("cls")) is not str or bool(w.get("each")) != each:
        raise Bad(f"a {'list' if each else 'dict'} batch's class wrapper is malformed")
    if w.get("type") == "dict" and type(typed_doc(w.get("attrs_t"), "class attributes")) is not dict:
        raise Bad("a class wrapper's attributes are not a dict")
    if w.get("type") not in ("dataclass", "dict") or (each and w["type"] != "dataclass"):
        raise Bad(f"class wrapper type {str(w.get('type'))[:40]!r} is unknown here")


def wrapper(w, keys: dict) -> None:
    """The container tag of a dict batch (an unknown type is left to ``containers.wrap``)."""
    if type(w) is not dict:
        raise Bad("wrapper is not an object")
    if w.get("type") in ("dataclass", "dict"):
        class_tag(w, False)
    elif w.get("type") == "tensordict":
        td_tag(w, keys)
    elif w.get("type") == "dataproto":
        names = w.get("non_tensor_keys")
        if type(names) is not list or any(type(k) is not str for k in names):
            raise Bad("a DataProto wrapper's non_tensor_keys is not a list of names")
        if "meta_info_t" in w:
            if "meta_info" in w or type(typed_doc(w["meta_info_t"], "meta_info")) is not dict:
                raise Bad("a DataProto wrapper's typed meta_info is not a dict")
        elif type(w.get("meta_info")) is not dict or type(w.get("cls", "")) is not str:
            raise Bad("a DataProto wrapper's meta_info or class name is malformed")
        if w.get("td") is not None:
            td_tag(w["td"], {k: v for k, v in keys.items() if k not in names})
        else:  # no TensorDict: every field is a non-tensor entry (else wrap would drop it)
            left = [k for k in keys if k not in names]
            if left:
                raise Bad(f"the DataProto wrapper has no TensorDict and does not list field {left[0]!r} "
                          "among its non_tensor_keys")


def shard(doc: dict, schema: pa.Schema) -> None:
    """The envelope of one rank's shard of a logical step (docs/FORMAT.md section 1, format version 3):
    ``{"shard": {"rank": r, "world_size": N}}`` and an int32 ``rank`` column."""
    sh = doc["shard"]
    if type(sh) is not dict or set(sh) != {"rank", "world_size"} or type(sh["rank"]) is not int \
            or type(sh["world_size"]) is not int or not 0 <= sh["rank"] < sh["world_size"]:
        raise Bad(f"shard {sh!r} is not {{'rank': r, 'world_size': N}} with 0 <= r < N")
    if type(doc.get("format_version")) is int and doc["format_version"] < 3:
        raise Bad(f"a shard file of format version {doc['format_version']} (it needs 3)")
    i = schema.get_field_index("rank")
    if i < 0 or schema.field(i).type != pa.int32():
        raise Bad("a shard file without its int32 'rank' column")
