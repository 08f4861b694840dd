"""The one walk over a batch's structure, shared by ``Writer.append`` and the encoder.

``plan(batch)`` asks ``layout.structure`` once what a dict batch is (its form, its mask groups, what
each tensor field follows) and walks down from there: every field is classified from that answer
(which node kind it becomes, which columns it takes; value checks are leaves in ``format/values.py``),
and every error that types, dtypes, keys, shapes, lengths and Python values can show is raised; it never
syncs a GPU, and reads only the few integers that give row counts (a packed batch's ``cu_seqlens``,
a VLM batch's ``image_grid_thw``, ``integrations.trl``) when they are in CPU memory. ``check(batch)``
is that walk alone, run by ``Writer.append`` on the caller's thread so a batch that cannot be stored
fails at its own ``append``; the encoder (``format/codec/encoder.py``) runs the same walk first and encodes from its
result, so the same batch gives the same error on both paths. What only values can show (an
attention mask of other values than 0/1, a ``cu_seqlens`` on the GPU that decreases) is found by the
encoder afterwards, in the background (raised as ``BatchWriteError``, a ``WriterError`` and a
``BatchError``, naming the step).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...errors import BatchError, BatchWarning, UnsupportedTypeError, warn
from ...integrations import areal
from ...integrations import trl
from . import classes, layout
from ..arrow import ColumnNames
from .layout import FLAT, GLOBAL, SAMPLE, SEGMENTS, TOKENS, Layout
from ..limits import MAX_DIMS, MAX_SPEC_DEPTH
from ..spec import SHAPE_PREFIX, where
from ..typed import check_np_dtype, needs_typed
from ..values import check_json, check_str, cycle_error, describe, has_tensor, is_tensorlike, number_lists

__all__ = ["check", "plan", "Plan", "Tensor", "Json", "TValue", "Group", "Seq", "Empty", "Cells", "Struct", "Values",
           "MISSING", "GLOBAL", "TOKENS", "FLAT", "SAMPLE", "SEGMENTS"]

MISSING = object()  # a key absent from one element of a sequence of dicts
EXACT = 2**53  # Python ints up to this magnitude are exact in a float64 column (the "num" value type)


# ----------------------------------------------------------------------------- the plan
@dataclass
class Tensor:
    path: tuple
    value: Any
    lib: str
    dtype: str
    role: str | None  # GLOBAL, TOKENS, FLAT, SAMPLE; None: a packed batch's N is not known yet
    group: int | None = None  # TOKENS: the index of the mask group it follows (masks.MaskGroup)
    counts: list[int] | None = None  # SEGMENTS: leading-dimension rows per trajectory, once read
    last: bool = False  # TOKENS: the token axis is the last dimension ([B, C, T]: mrope position_ids)

    @property
    def col(self) -> str:
        return ".".join(self.path)


@dataclass
class Json:
    value: Any


@dataclass
class TValue:
    """A batch-wide value that plain JSON cannot hold exactly (format/typed.py)."""

    value: Any


@dataclass
class Group:
    keys: list[tuple[str, Any]]  # (name, field plan)


@dataclass
class Seq:
    path: tuple
    container: str  # "list", "tuple" or "ndarray"
    np_dtype: str | None
    elem: Any  # an element plan
    trail: list[int] | None = None  # ndarray of more than one dimension: the shape of each row


@dataclass
class _Rows:
    path: tuple
    elems: list  # one value per row (None, MISSING, or the value)

    @property
    def col(self) -> str:
        return ".".join(str(p) for p in self.path)

    @property
    def present(self) -> list[tuple[int, Any]]:
        return [(i, e) for i, e in enumerate(self.elems) if e is not None and e is not MISSING]


@dataclass
class Empty(_Rows):
    pass


@dataclass
class Cells(_Rows):
    lib: str = ""
    dtype: str = ""


@dataclass
class Struct(_Rows):
    keys: list[tuple[str, Any]] = field(default_factory=list)  # (name, element plan)


@dataclass
class Values(_Rows):
    ptype: str = ""  # "str", "bool", "float", "num", "int", "json" or "tjson" (typed, format/typed.py)


@dataclass
class Plan:
    """A batch classified: a dict batch (``layout``, ``keys``) or a list of trajectory dicts
    (``container``, ``elem``); ``n`` rows; ``names`` the columns claimed."""

    n: int
    names: ColumnNames
    layout: Layout | None = None
    keys: list[tuple[str, Any]] = field(default_factory=list)
    container: str | None = None
    elem: Any = None
    suspects: list[str] = field(default_factory=list)  # per-token-looking fields stored per sample


# ----------------------------------------------------------------------------- errors
def entries_error(path: tuple, n: int, B: int) -> BatchError:
    """A per-trajectory list whose length is not the batch size."""
    return BatchError(
        f"field {where(path)!r}: has {n} entries, the batch has {B} trajectories; "
        "every per-trajectory list must have one entry per trajectory"
    )


# ----------------------------------------------------------------------------- the walk
class _Walk:
    def __init__(self, n: int, lay: Layout | None, splits: Mapping[str, trl.Split] | None = None) -> None:
        self.names = ColumnNames()
        self.lay = lay
        self.n = n
        self.deferred: list[Tensor] = []  # packed-batch tensors, classified once N is known
        self.splits = splits or {}  # top-level fields stored per trajectory by counts (integrations)
        self.segmented: list[tuple[Tensor, trl.Split]] = []
        self.suspects: list[str] = []  # names of per-token-looking fields of another width than the mask
        self.open: set[int] = set()  # ids of the dicts on the path being walked (a cycle is an error)

    def field(self, v: Any, path: tuple) -> Any:
        if len(path) > MAX_SPEC_DEPTH:  # a field at depth len(path): what the reader accepts (validate)
            raise _too_deep(path)
        if is_tensorlike(v):
            return self.tensor(v, path)
        if type(v) not in (dict, list, tuple) and isinstance(v, dict | list | tuple):
            classes.refuse_partial(v, f"field {where(path)!r}")  # its attributes would be lost
        if isinstance(v, Mapping):
            if all(type(k) is str for k in v):
                if id(v) in self.open:  # a group inside itself: no walk would end
                    raise cycle_error(f"field {where(path)!r}")
                self.open.add(id(v))
                g = Group([(k, self.field(x, path + (k,))) for k, x in v.items()])
                self.open.discard(id(v))
                return g
            needs_typed(v, f"field {where(path)!r}")  # not str keys: a batch-wide value, typed
            return TValue(v)
        trail = None
        if isinstance(v, np.ndarray) and v.ndim >= 1:  # not tensor-like: object, str, bytes, datetime64...
            check_np_dtype(v, f"field {where(path)!r}")  # an object array's items: checked per row below
            if v.ndim == 1 and v.dtype.kind in "US":
                elems = [x.item() for x in v]
            else:
                elems, trail = list(v), (list(v.shape[1:]) if v.ndim > 1 else None)
            container = "ndarray"
        elif isinstance(v, list | tuple):
            container, elems = "tuple" if isinstance(v, tuple) else "list", list(v)
        else:
            if v is None or type(v) in (bool, int, str) or type(v) is float and math.isfinite(v):
                check_json(v, f"field {where(path)!r}")
                return Json(v)  # NaN / inf are not strict JSON: typed below
            needs_typed(v, f"field {where(path)!r}")  # raises for what cannot be stored at all
            return TValue(v)
        if len(elems) != self.n:
            raise entries_error(path, len(elems), self.n)
        return Seq(path, container, v.dtype.str if container == "ndarray" else None, self.elems(path, elems), trail)

    def tensor(self, v: Any, path: tuple) -> Tensor:
        lib, name = describe(v, path)
        lay, shape = self.lay, list(v.shape)
        if len(shape) > MAX_DIMS:  # the reader's limit on a shape in the spec (format/limits.py)
            raise BatchError(f"field {where(path)!r} has {len(shape)} dimensions, over the limit of {MAX_DIMS} "
                             "a reader accepts (trajstore/format/limits.py); reshape it")
        t = Tensor(path, v, lib, name, None)
        if not shape or (lay.form == "packed" and path == ("cu_seqlens",)):
            t.role = GLOBAL
            return t
        if len(path) == 1 and path[0] in self.splits:
            t.role = SEGMENTS
            self.segmented.append((t, self.splits[path[0]]))
            self.names.claim(t.col, path)
            return t
        f = lay.follows[path]  # what the structure decided of the field
        if f.role == TOKENS:
            t.role, t.group, t.last = TOKENS, f.group, f.last
        elif lay.form == "packed":
            self.deferred.append(t)  # per-token if its leading dimension is N: checked once all fields are
        elif f.error is not None:
            raise f.error
        else:
            t.role = SAMPLE
            if f.suspect:
                self.suspects.append(where(path))
        self.names.claim(t.col, path)
        return t

    def classify_packed(self) -> None:
        """The packed batch's tensors, once N is known: leading dimension N or B."""
        for t in self.deferred:
            f = self.lay.follows[t.path]
            if f.error is not None:
                raise f.error
            t.role = f.role

    def count_segments(self, batch: Mapping, read: bool) -> None:
        """Rows per trajectory of each segmented field: read from the fields its split reads where
        ``read`` (the encoder) or they are in CPU memory (``Writer.append``), and checked."""
        for t, split in self.segmented:
            if not read and any(_on_gpu(batch[k]) for k in split.reads):
                continue  # the encoder reads and checks them, in the background
            counts = split.rows(batch)
            if len(counts) != self.n or sum(counts) != t.value.shape[0] or min(counts, default=0) < 0:
                raise BatchError(f"field {where(t.path)!r}: {sum(counts)} rows in {len(counts)} segments do not "
                                 f"cover its leading dimension {t.value.shape[0]} in {self.n} trajectories")
            t.counts = counts

    def elems(self, path: tuple, elems: list) -> Any:
        """Per-row values (one per trajectory) of one field: cells, columns or nested dicts."""
        if len(path) + 1 > MAX_SPEC_DEPTH:  # a per-row node sits one level below its field
            raise _too_deep(path, len(path) + 1)
        rows = _Rows(path, elems)
        present = rows.present
        if not present:
            return Empty(path, elems)
        tens = [is_tensorlike(e) for _, e in present]
        if all(tens):
            return self.cells(rows, present)
        dicts = [isinstance(e, Mapping) for _, e in present]
        nested = any(d and has_tensor(e, f"field {where(path)!r} row {i}")
                     for d, (i, e) in zip(dicts, present))  # a tensor in a dict
        str_keys = all(type(k) is str for d, (_, e) in zip(dicts, present) if d for k in e)
        if all(dicts) and nested and str_keys:
            keys: dict[str, None] = {}
            for _, e in present:
                keys.update(dict.fromkeys(e))
            return Struct(path, elems, [(k, self.elems(path + (k,), [
                e.get(k, MISSING) if isinstance(e, Mapping) else MISSING for e in elems])) for k in keys])
        return self.values(rows, present)  # mixed kinds: typed values (format/typed.py)

    def cells(self, rows: _Rows, present: list) -> Cells | Values:
        libs, names, seen = set(), set(), set()
        for i, e in present:
            kind = (type(e), e.dtype, e.layout, e.device.type) if isinstance(e, torch.Tensor) else (type(e), e.dtype)
            if kind in seen:  # described already: the same answer
                continue
            seen.add(kind)
            lib, name = describe(e, rows.path + (i,))
            libs.add(lib)
            names.add(name)
        if len(libs) > 1 or len(names) > 1:  # not one column: each row a typed value
            return self.values(rows, present)
        self.names.claim(rows.col, rows.path)
        self.names.claim(SHAPE_PREFIX + rows.col, rows.path, companion=True)
        return Cells(rows.path, rows.elems, libs.pop(), names.pop())

    def values(self, rows: _Rows, present: list) -> Values:
        path, types = rows.path, {type(e) for _, e in present}
        label = f"field {where(path)!r}"
        if types == {str}:
            for i, e in present:
                if not e.isascii():  # the message is built only where it may be needed
                    check_str(e, f"{label} row {i}")
            ptype = "str"
        elif types == {bool}:
            ptype = "bool"
        elif types == {float}:
            ptype = "float"
        elif types <= {int, float} and all(type(e) is float or -EXACT <= e <= EXACT for _, e in present):
            ptype = "num"  # one float64 column for every Python number (docs/FORMAT.md 3.3, "num")
        elif types == {int} and all(-(2**63) <= e < 2**63 for _, e in present):
            ptype = "int"  # beyond float64's exact ints: int64, under another name where the split has a double
        elif types == {list} and (lt := number_lists(e for _, e in present)) is not None:
            ptype = lt  # per-sample ragged token lists (SkyRL's response_ids, loss_masks...): large_list columns
        else:
            typed = False
            for i, e in present:
                typed |= needs_typed(e, f"{label} row {i}")
            ptype = "tjson" if typed else "json"
        self.names.claim(rows.col, path)
        return Values(path, rows.elems, ptype)


def _on_gpu(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.device.type != "cpu"


def _too_deep(path: tuple, depth: int | None = None) -> BatchError:
    return BatchError(f"field {where(path)[:200]!r} nests {depth or len(path)} levels deep, over the limit of "
                      f"{MAX_SPEC_DEPTH} a reader accepts (trajstore/format/limits.py); flatten it")


def _list_batch_error(batch: list | tuple) -> UnsupportedTypeError:
    return UnsupportedTypeError("a list batch must hold one dict (or None) per trajectory; "
                                f"got {sorted({type(e).__name__ for e in batch})}")


def plan(batch: Any, read: bool = True, masks: Mapping | None = None, known: Mapping | None = None) -> Plan:
    """Classify ``batch``; raise BatchError / UnsupportedTypeError for what cannot be stored.
    ``read``: read a packed batch's ``cu_seqlens`` and the masks' values wherever they are (the
    encoder: the plan it encodes from holds every mask's side and row lengths); False reads only a
    ``cu_seqlens`` in CPU memory (``check``): on a GPU its values are the encoder's to check. ``masks``
    declares which fields follow which mask, ``known`` gives mask values (``layout.structure``)."""
    if isinstance(batch, Mapping):
        for k in batch:
            if type(k) is not str:
                raise UnsupportedTypeError(f"batch key {k!r} is a {type(k).__name__}; keys must be str")
        lay = layout.structure(batch, masks, read, known)
        w = _Walk(lay.B, lay, trl.splits(batch, lay.B))
        keys = [(k, w.field(v, (k,))) for k, v in batch.items()]
        w.count_segments(batch, read)
        if lay.error is not None:  # what the values of cu_seqlens or a mask show: after every field
            raise lay.error
        if lay.N is not None:
            w.classify_packed()
        return Plan(lay.B, w.names, layout=lay, keys=keys, suspects=w.suspects)
    if isinstance(batch, list | tuple):
        if not all(e is None or isinstance(e, Mapping) for e in batch):
            raise _list_batch_error(batch)
        if masks:  # the declared groups are a dict batch's; never silently not applied
            raise BatchError(f"Writer(masks={dict(masks)!r}) declares mask groups of a dict batch, but this step "
                             f"is a list batch of {len(batch)} trajectories, whose per-token fields follow each "
                             "element's own attention_mask; write list batches with a Writer without masks=")
        w = _Walk(len(batch), None)
        elem = w.elems((), list(batch))
        if not isinstance(elem, Struct | Empty):  # dicts of plain values only: one JSON value each
            raise _list_batch_error(batch)
        return Plan(len(batch), w.names, container="tuple" if isinstance(batch, tuple) else "list", elem=elem)
    raise UnsupportedTypeError(
        f"batch of type {type(batch).__name__} is not supported; pass a dict of tensors, "
        "a list of per-trajectory dicts, a TensorDict or a DataProto-like object"
    )


def check(batch: Any, masks: Mapping | None = None) -> None:
    """Raise BatchError / UnsupportedTypeError for what can be seen without reading tensor values
    (``Writer.append``; the encoder runs the same walk). A batch refused for holding AReaL
    RTensors is checked again with each one's shape and dtype in its place, nothing fetched
    (``integrations.areal.check_view``; the snapshot localizes them), so other batches pay nothing.
    A field named like a per-token one (``input_ids``, ``*_mask``, ``*logprobs``...) ``[B, W]`` next to an
    ``attention_mask`` ``[B, T]`` of another width is stored per sample: a ``BatchWarning`` says so
    (shapes only, on the caller's thread)."""
    try:
        p = plan(batch, read=False, masks=masks)
    except BatchError:
        view = areal.check_view(batch)
        if view is batch:
            raise
        p = plan(view, read=False, masks=masks)
    if p.suspects:
        _warn_widths(batch, p)


def _warn_widths(batch: Mapping, p: Plan) -> None:
    def shape(col: str) -> list[int]:
        v: Any = batch
        for k in col.split("."):
            v = v[k]
        return list(v.shape)

    T, m = p.layout.T, list(batch["attention_mask"].shape)
    fields = ", ".join(f"{c!r} {shape(c)}" for c in p.suspects)
    warn(
        f"{fields} {'is' if len(p.suspects) == 1 else 'are'} not as wide as 'attention_mask' {m}, so "
        f"{'it is' if len(p.suspects) == 1 else 'they are'} stored as one per-sample value per trajectory (whole "
        f"rows, padding included), not per token; if per-token, pad to width {T} like 'attention_mask' (or pass "
        "Writer(masks={'<its mask>': [fields]}) for a mask of its own width); if per-sample, rename it or "
        "silence trajstore.errors.BatchWarning", BatchWarning)
