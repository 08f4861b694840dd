"""The RL frameworks' own batch classes (``integrations/openrlhf.py``, ``integrations/skyrl.py``) as
the plain dicts and lists ``schema`` stores, and back; and the rule that nothing is stored in part.

A class of ``REGISTRY`` is stored as:

* kind ``dataclass`` (OpenRLHF's and SkyRL's ``Experience``): the dict of its dataclass fields, in
  field order; a list (or tuple) of such objects is a list batch of those dicts. Container tag
  ``{"type": "dataclass", "cls": "module:qualname"}``, with ``"each": true`` for a list.
* kind ``dict`` (SkyRL's ``TrainingInputBatch`` / ``TrainingOutputBatch``): its dict items, and the
  attributes the integration keeps (``metadata``) as a typed document (docs/FORMAT.md 3.8) in the
  tag ``{"type": "dict", "cls": ..., "attrs_t": {...}}``; attributes its constructor recomputes
  (``derived``) are not stored.

On replay the class comes back when its package is installed (imported if needed, only for the
classes of ``REGISTRY``); otherwise the plain dict (or list of dicts) is returned and a warning
logged once per class. An object that has an attribute the integration does not list is refused.

Nothing is lost silently: a dict, list or tuple subclass (the batch, an element of a list batch, or
a field's value, ``check.plan``) carrying instance attributes that no integration keeps is refused at ``append`` with a ``BatchError`` naming the class and what would
be lost (``refuse_partial``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ...errors import BatchError, UnsupportedTypeError
from ...integrations import class_path, load_class, openrlhf, skyrl
from .. import typed

__all__ = ["REGISTRY", "unwrap", "wrap", "version", "refuse_partial", "KINDS"]

REGISTRY: dict[str, dict] = {**openrlhf.CLASSES, **skyrl.CLASSES}
KINDS = ("dataclass", "dict")
log = logging.getLogger("trajstore.reader")
_warned: set[str] = set()


def _attrs(obj: Any) -> list[str]:
    """Instance attributes of ``obj`` (its ``__dict__``; a class with ``__slots__`` has none here)."""
    return list(getattr(obj, "__dict__", None) or ())


def _lost(obj: Any, names: list[str], what: str = "the batch") -> BatchError:
    t = type(obj)
    return BatchError(
        f"{what} is a {t.__module__}.{t.__qualname__} carrying attribute{'s' if len(names) > 1 else ''} "
        f"{', '.join(repr(n) for n in names[:8])}{'...' if len(names) > 8 else ''} that trajstore does not "
        "keep: replay would return it without them; pass it as a plain dict or list and record what the "
        "attributes hold as step meta (append(..., meta=...)) or as fields")


def _fields(obj: Any, path: str, what: str) -> dict:
    names = [f.name for f in dataclasses.fields(obj)]
    extra = [k for k in _attrs(obj) if k not in set(names)]
    if extra:
        raise _lost(obj, extra, what)
    return {n: getattr(obj, n) for n in names}


def _dict_items(obj: dict, path: str, known: dict) -> tuple[dict, dict]:
    keep, derived = known["keep"], set(known["derived"])
    extra = [k for k in _attrs(obj) if k not in keep and k not in derived]
    if extra:
        raise _lost(obj, extra)
    attrs = {k: getattr(obj, k, None) for k in keep}
    typed.needs_typed(attrs, f"{type(obj).__name__} attributes")  # what cannot be stored, named
    plain = {k: dict.__getitem__(obj, k) for k in dict.keys(obj)}  # the raw items, not __getitem__'s
    return plain, {"type": "dict", "cls": path, "attrs_t": typed.encode(attrs)}


def refuse_partial(batch: Any, what: str = "the batch") -> None:
    """BatchError for a dict / list / tuple subclass (the batch, ``what``; or an element of a list
    batch) with instance attributes no integration keeps (other objects are refused by ``check.plan``)."""
    if type(batch) not in (dict, list, tuple) and isinstance(batch, dict | list | tuple) and _attrs(batch):
        raise _lost(batch, _attrs(batch), what)
    if what != "the batch":
        return
    if isinstance(batch, list | tuple):
        for i, e in enumerate(batch):
            if type(e) is not dict and isinstance(e, dict) and _attrs(e):
                raise _lost(e, _attrs(e), f"element {i} of the list batch")


def unwrap(batch: Any) -> tuple[Any, dict] | None:
    """(plain batch, container tag) of an object of a ``REGISTRY`` class or a list of them; None for
    anything else (after ``refuse_partial``)."""
    t = type(batch)
    if t is not dict and t is not list and t is not tuple:
        path = class_path(t)
        known = REGISTRY.get(path)
        if known is not None and known["kind"] == "dataclass" and dataclasses.is_dataclass(batch):
            return _fields(batch, path, "the batch"), {"type": "dataclass", "cls": path}
        if known is not None and known["kind"] == "dict" and isinstance(batch, dict):
            return _dict_items(batch, path, known)
    if isinstance(batch, list | tuple) and batch:
        first = next((e for e in batch if e is not None), None)
        path = class_path(type(first))
        if REGISTRY.get(path, {}).get("kind") == "dataclass":
            if t not in (list, tuple) and _attrs(batch):
                raise _lost(batch, _attrs(batch))
            if any(e is not None and class_path(type(e)) != path for e in batch):
                raise UnsupportedTypeError(f"a list batch of {path.partition(':')[2]} objects also holds "
                                           f"{sorted({type(e).__name__ for e in batch})}; pass one class per list")
            out = [None if e is None else _fields(e, path, f"element {i} of the list batch")
                   for i, e in enumerate(batch)]
            return (tuple(out) if isinstance(batch, tuple) else out), {"type": "dataclass", "cls": path, "each": True}
    refuse_partial(batch)
    return None


def version(tag: dict) -> int:
    """The lowest format version that reads such a tag: 4."""
    return 4


def _plain(path: str, what: str) -> None:
    if path not in _warned:
        _warned.add(path)
        log.warning("trajstore: this step was recorded from %s, which is not installed here (or cannot be "
                    "imported): it comes back as %s", path, what)


def _build(cls: type | None, fields: dict, path: str) -> Any:
    if cls is None:
        _plain(path, "a dict of its fields")
        return fields
    try:
        return cls(**fields)
    except TypeError:  # a read of some columns only, or another version of the class
        _plain(path, "a dict of its fields (this version of the class does not take them)")
        return fields


def wrap(plain: Any, tag: dict, where: str) -> Any:
    """The object ``tag`` (``unwrap``) describes, rebuilt around ``plain``."""
    path = tag["cls"]
    cls = load_class(path, REGISTRY)
    if tag["type"] == "dataclass":
        if tag.get("each"):
            return type(plain)(None if e is None else _build(cls, e, path) for e in plain)
        return _build(cls, plain, path)
    attrs = typed.decode(tag["attrs_t"], f"{where}the attributes of {path}")
    if cls is None:
        _plain(path, "a plain dict, without its attributes " + ", ".join(attrs))
        return plain
    obj = cls(plain)
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj
