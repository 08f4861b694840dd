"""Batch container adapters: turn container types (TensorDict, DataProto-like objects)
into the plain dict forms ``schema`` stores, and back.

``unwrap(batch)`` returns ``(plain, tag)``; ``tag`` is a JSON-able description of the
container (None for plain batches) stored in the spec; ``wrap(plain, tag)`` rebuilds it.

* ``tensordict.TensorDict`` (and any ``TensorDictBase``): stored as a dict of its
  tensors (nested TensorDicts become nested dicts, non-tensor entries become values);
  it comes back as a ``TensorDict`` on CPU with the same ``batch_size`` (nested ones
  too) and the same non-tensor entries.  Reading it needs ``tensordict`` installed.
* A verl-style ``DataProto`` (duck typed, verl is never imported): any object with a
  ``batch`` (TensorDict or None), a ``non_tensor_batch`` (dict of numpy arrays, one
  entry per trajectory) and a ``meta_info`` dict (plain JSON is stored as such; anything else
  a batch may hold, numpy scalars, tuples, int keys, tensors, as a typed document under
  ``meta_info_t``, format/typed.py, format version 2).  The tensors and the
  non-tensor arrays are stored side by side as top-level fields, so ``attention_mask``
  and friends get the unpadded per-token layout.  It comes back as the original class
  when that class's module is imported by the reading process and the class is a
  dataclass with those three fields (verl's is).  The frameworks' own classes
  (``integrations.verl.DATAPROTO_CLASSES``: verl's and ROLL's ``DataProto``) are imported when their package
  is installed, whatever the import order of the reading process; a file can name no
  other module to import.  Otherwise the step comes back as :class:`DataProtoLike`, a
  small dataclass of the same shape.
* The RL frameworks' own classes (OpenRLHF's and SkyRL's ``Experience``, SkyRL's training batches
  with their ``metadata``, lists of ``Experience``) and the refusal of what would be stored only
  in part: ``format/batch/classes.py``.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import BatchError, ConfigError, FormatError, MissingDependencyError, UnsupportedTypeError
from ...integrations import verl
from . import classes
from .. import typed

__all__ = ["unwrap", "wrap", "version", "DataProtoLike", "is_tensordict", "is_dataproto"]


@dataclass
class DataProtoLike:
    """What a DataProto-shaped step comes back as when its own class is not loaded."""

    batch: Any = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __len__(self) -> int:
        if self.batch is not None and len(self.batch.batch_size):
            return int(self.batch.batch_size[0])
        for v in self.non_tensor_batch.values():
            return len(v)
        return 0


def _td_base():
    mod = sys.modules.get("tensordict")  # a TensorDict can only exist if tensordict is imported
    return getattr(mod, "TensorDictBase", None) if mod is not None else None


def is_tensordict(x: Any) -> bool:
    """A ``tensordict.TensorDictBase`` (never imports tensordict)."""
    base = _td_base()
    return base is not None and isinstance(x, base)


def is_dataproto(x: Any) -> bool:
    """A verl-style DataProto, duck typed: ``batch`` (TensorDict or None), ``non_tensor_batch`` and
    ``meta_info`` dicts."""
    return (not isinstance(x, dict) and hasattr(x, "batch") and hasattr(x, "non_tensor_batch")
            and hasattr(x, "meta_info") and (x.batch is None or is_tensordict(x.batch))
            and isinstance(x.non_tensor_batch, dict) and isinstance(x.meta_info, dict))


def _td_plain(td, where: str) -> tuple[dict, dict]:
    """(plain nested dict, tag describing batch sizes and non-tensor keys)."""
    out, nested, non_tensor = {}, {}, {}
    for k in td.keys():
        v = td.get(k)
        if is_tensordict(v) and not _is_non_tensor(v):
            out[k], nested[k] = _td_plain(v, f"{where}.{k}")
        elif isinstance(v, torch.Tensor):
            out[k] = v
        elif _is_non_tensor(v):
            stack = type(v).__name__ == "NonTensorStack"
            out[k] = v.tolist() if stack else v.data
            non_tensor[k] = "stack" if stack else "data"
        else:
            raise UnsupportedTypeError(f"field {where}.{k}: TensorDict entry of type {type(v).__name__} "
                                       "cannot be stored; use tensors, nested TensorDicts or non-tensor data")
    tag = {"batch_size": list(td.batch_size)}
    if nested:
        tag["nested"] = nested
    if non_tensor:
        tag["non_tensor"] = non_tensor
    if td.device is not None:
        tag["device"] = str(td.device)  # informational: batches come back on CPU
    return out, tag


def _is_non_tensor(v: Any) -> bool:
    return type(v).__name__ in ("NonTensorData", "NonTensorStack")


def _td_build(plain: dict, tag: dict, where: str):
    try:
        from tensordict import NonTensorStack, TensorDict
    except ImportError:
        raise MissingDependencyError("this step was recorded from a tensordict.TensorDict; install "
                                     "tensordict (pip install tensordict) to read it") from None
    nested = tag.get("nested", {})
    non_tensor = tag.get("non_tensor", {})
    td = TensorDict({}, batch_size=tag["batch_size"])
    for k, v in plain.items():
        try:
            if k in nested:
                td.set(k, _td_build(v, nested[k], where))
            elif non_tensor.get(k) == "stack":
                td.set(k, NonTensorStack.from_list(list(v)))
            elif k in non_tensor:
                td.set_non_tensor(k, v)
            else:
                td.set(k, v)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ConfigError(f"{where}field {k!r} does not fit the recorded TensorDict batch_size "
                              f"{tag['batch_size']} ({e}); read without layout= to get it back as recorded") from None
    return td


def unwrap(batch: Any) -> tuple[Any, dict | None]:
    """(plain batch, container tag or None) of a batch of any supported container type."""
    if type(batch) is dict:
        return batch, None
    got = classes.unwrap(batch)  # a framework's own class; refuses what would be stored in part
    if got is not None:
        return got
    if isinstance(batch, dict | list | tuple):
        return batch, None
    if is_tensordict(batch):
        plain, tag = _td_plain(batch, "<batch>")
        return plain, {"type": "tensordict", **tag}
    if is_dataproto(batch):
        plain, tag = ({}, None) if batch.batch is None else _td_plain(batch.batch, "batch")
        for k, v in batch.non_tensor_batch.items():
            if k in plain:
                raise BatchError(f"field {k!r} is in both batch and non_tensor_batch; rename one of them")
            plain[k] = v
        cls = type(batch)
        out = {"type": "dataproto", "td": tag, "non_tensor_keys": list(batch.non_tensor_batch)}
        if typed.needs_typed(batch.meta_info, "meta_info"):  # encoded now: the caller may change it after
            out["meta_info_t"] = typed.encode(batch.meta_info)
        else:
            out["meta_info"] = copy.deepcopy(batch.meta_info)  # the caller may change it after append
        out["cls"] = f"{cls.__module__}:{cls.__qualname__}"
        return plain, out
    return batch, None


def version(tag: dict) -> int:
    """The lowest format version that reads a container tag (2 for a typed ``meta_info``)."""
    if tag.get("type") in classes.KINDS:
        return max(classes.version(tag), typed.version(tag["attrs_t"]) if "attrs_t" in tag else 1)
    return typed.version(tag["meta_info_t"]) if "meta_info_t" in tag else 1  # 3 with a NaN / inf inside


_FIELDS = {"batch", "non_tensor_batch", "meta_info"}
def _loaded_class(path: str):
    """The class named ``module:qualname`` if its module is imported (one of ``integrations.verl.DATAPROTO_CLASSES``
    is imported here if installed) and it is a dataclass with ``batch``, ``non_tensor_batch`` and
    ``meta_info`` fields, else None. A file names the class, so only such DataProto-shaped classes
    are ever instantiated, and only the framework modules of this library's list are imported."""
    mod_name, _, qual = path.partition(":")
    verl.load_dataproto_module(path)
    obj = sys.modules.get(mod_name)
    for part in qual.split(".") if obj is not None else ():
        obj = getattr(obj, part, None)
    if not isinstance(obj, type) or obj is DataProtoLike:
        return None
    return obj if _FIELDS <= set(getattr(obj, "__dataclass_fields__", ())) else None


def _unbatched(tag: dict) -> dict:
    """A TensorDict tag with ``batch_size`` [] (nested ones too): a packed read's flat fields no
    longer share the trajectory dimension."""
    return {**tag, "batch_size": [], "nested": {k: _unbatched(v) for k, v in tag.get("nested", {}).items()}}


def wrap(plain: Any, tag: dict | None, where: str = "", packed: bool = False) -> Any:
    """The container ``tag`` describes (``unwrap``) rebuilt around ``plain``; ``where`` (the file)
    starts error messages. ``packed``: ``plain`` was read with ``layout="packed"``, so its
    TensorDicts get ``batch_size`` [] (their flat fields have no common leading dimension)."""
    if tag is None:
        return plain
    if packed and tag.get("type") == "tensordict":
        tag = _unbatched(tag)
    elif packed and tag.get("type") == "dataproto" and tag.get("td") is not None:
        tag = {**tag, "td": _unbatched(tag["td"])}
    where = f"{where}: " if where else ""
    kind = tag.get("type")
    if kind == "tensordict":
        return _td_build(plain, tag, where)
    if kind in classes.KINDS:  # a packed read's fields are not the class's: the plain dict
        return plain if packed else classes.wrap(plain, tag, where)
    if kind == "dataproto":
        keys = set(tag["non_tensor_keys"])
        non_tensor = {k: plain[k] for k in tag["non_tensor_keys"] if k in plain}
        rest = {k: v for k, v in plain.items() if k not in keys}
        batch = None if tag["td"] is None else _td_build(rest, tag["td"], where)
        meta = typed.decode(tag["meta_info_t"], where + "meta_info") if "meta_info_t" in tag else tag["meta_info"]
        cls = _loaded_class(tag.get("cls", ""))
        if cls is not None:
            try:
                return cls(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)
            except Exception:  # noqa: BLE001 - a class of another shape: fall back to the plain one
                pass
        return DataProtoLike(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)
    raise FormatError(f"{where}unknown batch container {kind!r} in the spec; upgrade trajstore")
