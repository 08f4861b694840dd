"""Batch -> Arrow table: the walk that turns a classified batch (``format.check.plan``) into one
column set per field and the spec that rebuilds it (each node kind's encoder: ``format/codec/tensors.py``,
``format/codec/sequences.py``), wrapped in the step envelope (``format.spec.step_doc``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ..batch import containers
from ..batch.masks import MaskGroup, len_col, start_col
from . import grouped, sequences, tensors
from .unpadded import Unpadding, encode as unpadded_field
from .. import typed
from ..arrow import TableBuilder
from ..batch.check import Group, Json, Plan, Seq, Tensor, TValue, plan
from ..batch.layout import Layout
from ..spec import BatchNode, FieldNode, SeqNode, step_doc

__all__ = ["encode_plain"]


def _field(enc: TableBuilder, lay: Layout, f: Any, unpadded: Unpadding | None = None) -> FieldNode:
    if isinstance(f, Tensor):
        u = unpadded.fields.get(f.path[0]) if unpadded is not None and len(f.path) == 1 else None
        return tensors.encode(enc, lay, f) if u is None else unpadded_field(enc, lay, f, u)
    if isinstance(f, Group):
        return {"t": "group", "keys": [[k, _field(enc, lay, child)] for k, child in f.keys]}
    if isinstance(f, Seq):
        return sequences.encode_seq(enc, f)
    if isinstance(f, TValue):  # format/typed.py; older readers refuse the node type
        doc = typed.encode(f.value)
        enc.needs(typed.version(doc))
        return {"t": "tvalue", "v": doc}
    assert isinstance(f, Json)
    return {"t": "json", "v": f.value}


def _encode_starts(enc: TableBuilder, g: MaskGroup) -> None:
    """A span group's first valid position per row: int64 column ``start_col`` (kind ``start``)."""
    name = start_col(g)
    enc.names.claim(name, (g.src,), companion=True)
    enc.add(name, pa.array(np.asarray(g.starts, dtype=np.int64)), {"dtype": "int64", "kind": "start"}, (g.src,))


def _encode_lengths(enc: TableBuilder, g: MaskGroup) -> str | None:
    """A mask group's valid token count per row: int64 column ``len_col`` (kind ``length``), for
    readers without trajstore (``len(input_ids)`` is the padded width where a mask has holes).
    None for a mask that is not 0/1 (its fields are stored whole)."""
    if g.lengths is None:
        return None
    name = len_col(g)
    enc.names.claim(name, (g.src,), companion=True)
    enc.add(name, pa.array(np.asarray(g.lengths, dtype=np.int64)), {"dtype": "int64", "kind": "length"}, (g.src,))
    return name


def _dict_batch(enc: TableBuilder, p: Plan, unpadded: Unpadding | None) -> BatchNode:
    lay = p.layout  # read: the masks' sides and row lengths, the form they make (format/batch/layout.py)
    assert lay is not None
    spec: Any = {"t": "batch", "form": lay.form, "B": lay.B}
    if lay.form == "padded":
        spec.update(T=lay.T, side=lay.side)
    lens = [_encode_lengths(enc, g) if lay.form in ("padded", "masked") else None
            for g in lay.groups]  # per-row token counts as plain columns (docs/FORMAT.md 3.4)
    if lay.form == "padded" and lens and lens[0]:
        spec["len_col"] = lens[0]
    if lay.form == "masked":
        enc.needs(5 if any(g.holes for g in lay.groups) else 2)  # holes inside runs: version 5 (3.4)
        spec["masks"] = [g.node() | ({"len_col": c} if c else {}) for g, c in zip(lay.groups, lens)]
        for g in lay.groups:
            if g.side == "span":
                _encode_starts(enc, g)
    spec["keys"] = [[k, _field(enc, lay, f, unpadded)] for k, f in p.keys]
    return spec


def _list_batch(enc: TableBuilder, p: Plan, batch: list | tuple) -> SeqNode:
    runs = grouped.plan(p.elem)  # groups [g, T] with padding: their token cells unpadded (version 3)
    elem: Any = sequences.encode_elems(enc, p.elem)
    if runs is not None:
        grouped.encode_runs(enc, runs)
    sequences.mark_list_tokens(elem, batch)
    return {"t": "seq", "container": p.container, "elem": elem}  # type: ignore[typeddict-item]


def encode_plain(batch: Any, container: dict | None, *, step: int, split: str, meta: dict | None = None,
                 extra: dict | None = None, masks: dict | None = None, unpadded: Unpadding | None = None) -> pa.Table:
    """``encode`` of a batch already unwrapped by ``containers.unwrap`` (``container`` is its tag).
    The batch is first walked by ``format.check.plan``, the walk ``Writer.append`` runs: a batch
    that cannot be stored fails there with the same error. ``masks``: which fields follow which
    mask, as declared to ``Writer`` (docs/FORMAT.md 3.4). ``unpadded``: the fields of a dict batch whose
    tokens were selected on the GPU, held in ``batch`` by placeholders (``unpadded.py``)."""
    p = plan(batch, read=True, masks=masks, known=unpadded.masks if unpadded is not None else None)
    enc = TableBuilder(p.n, p.names)
    spec: BatchNode | SeqNode = _dict_batch(enc, p, unpadded) if p.layout is not None else _list_batch(enc, p, batch)
    if container is not None:
        spec["wrapper"] = container
        enc.needs(containers.version(container))
    return enc.table(step, step_doc(step, split, enc.n, meta, spec, extra, enc.version))
