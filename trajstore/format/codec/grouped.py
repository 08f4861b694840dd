"""The groups of a list batch stored unpadded (docs/FORMAT.md 3.10; format version 3), encode and
decode side by side.

AReaL's ``GroupedRolloutWorkflow`` hands the trainer one dict per prompt whose tensors are ``[g, T]``
groups (``concat_padded_tensors``: each trajectory right-padded to the group's longest, its
``attention_mask`` 0 there). An element stays one row of the list batch (its ``none`` / ``missing``
rows, shapes and every other column keep that row), but where its ``[g, T]`` mask holds padding and
each trajectory's tokens are one run, the token cells of that row (the cells shaped ``[g, T, ...]``
like the mask, the mask itself included) hold only each trajectory's run, trajectory after
trajectory. The runs are in ``__runs__attention_mask`` (starts, then lengths); the padded
positions' values are one ``pad`` value, or their own values in ``__pad__<column>``.

A list of OpenRLHF ``Experience``s (elements with ``sequences``) has action cells ``[g, T-1]``: the
tokens after the first, columns 1..T-1 of the mask. Those cells hold the runs of the shifted mask,
recorded in ``__runs__attention_mask__action`` (the same rule as a single batch, format/batch/layout.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from ...errors import FormatError
from .. import dtypes as dt
from ..arrow import Columns, TableBuilder, list_array
from ..batch.check import MISSING, Cells, Struct
from ..batch.masks import classify, span_mask, token_mask
from ..spec import PAD_PREFIX, RUNS_ACTION, RUNS_COL, SHAPE_PREFIX
from .. import limits
from .fill_job import FillJob
from ..values import as_cpu, bits, storage

__all__ = ["RunCells", "RUNS_COL", "RUNS_ACTION", "plan", "encode_runs", "encode_cells", "decode_cells"]


@dataclass
class RunCells(Cells):
    """Token cells of a list batch, unpadded in the rows whose group mask has runs."""

    masks: list = field(default_factory=list)  # per row: the [g, T] bool token mask, or None (stored whole)
    runs: str = RUNS_COL  # the column of the runs its rows follow


@dataclass
class _Runs:
    masks: list  # per row: [g, T] bool mask or None
    runs: list  # per row: [starts..., lengths...] or None
    action: list | None = None  # per row: the runs of the mask's columns 1..T-1 (OpenRLHF's action cells)

    def shifted(self) -> tuple[list, list]:
        """Per row: the ``[g, T-1]`` mask of the tokens after the first, and its runs (None: whole)."""
        masks: list = [None] * len(self.runs)
        runs: list = [None] * len(self.runs)
        for i, (m, r) in enumerate(zip(self.masks, self.runs)):
            if r is None:
                continue
            g = len(r) // 2
            s, ln = np.asarray(r[:g], dtype=np.int64), np.asarray(r[g:], dtype=np.int64)
            s1 = np.maximum(s - 1, 0)
            ln1 = np.maximum(s + ln - 1 - s1, 0)
            masks[i] = span_mask(s1, ln1, m.shape[1] - 1)
            runs[i] = [int(x) for x in s1] + [int(x) for x in ln1]
        return masks, runs


def _read(elem: Struct) -> _Runs | None:
    """The runs of each row's ``[g, T]`` attention mask; None when no row has padding in runs."""
    am = dict(elem.keys).get("attention_mask")
    if type(am) is not Cells:
        return None
    masks: list = [None] * len(am.elems)
    runs: list = [None] * len(am.elems)
    for i, e in am.present:
        if len(e.shape) != 2:
            continue
        _, name, a = as_cpu(e, ("attention_mask", i))
        m = token_mask(torch.as_tensor(a) if isinstance(a, np.ndarray) else a)
        if bool(m.all()):
            continue
        side, lengths, starts = classify(m)
        if side is None:  # holes: the row is stored whole
            continue
        if starts is None:
            starts = torch.zeros_like(lengths) if side == "right" else m.shape[1] - lengths
        masks[i] = m
        runs[i] = [int(x) for x in starts] + [int(x) for x in lengths]
    return _Runs(masks, runs) if any(r is not None for r in runs) else None


def plan(elem: Any) -> _Runs | None:
    """Turn the token cells of a list batch of groups (``elem``, the batch's struct plan) into
    ``RunCells`` in place; the runs to store, or None when nothing changes."""
    if not isinstance(elem, Struct):
        return None
    r = _read(elem)
    if r is None:
        return None
    shapes = [None if m is None else tuple(m.shape) for m in r.masks]
    am = dict(elem.keys)["attention_mask"]
    rows = [i for i, _ in am.present]
    action = type(dict(elem.keys).get("sequences")) is Cells  # OpenRLHF's Experience: [g, T-1] action cells
    amasks, aruns = r.shifted() if action else ([], [])
    keys = []
    for k, c in elem.keys:
        if type(c) is Cells and c.present and {i for i, _ in c.present} <= set(rows):  # rows without the field: absent
            if all(tuple(e.shape[:2]) == tuple(am.elems[i].shape) for i, e in c.present):
                c = RunCells(c.path, c.elems, c.lib, c.dtype, masks=[s and r.masks[i] for i, s in enumerate(shapes)])
            elif action and all(len(am.elems[i].shape) == 2 and tuple(e.shape[:2]) == (
                    am.elems[i].shape[0], am.elems[i].shape[1] - 1) for i, e in c.present):
                c = RunCells(c.path, c.elems, c.lib, c.dtype, masks=amasks, runs=RUNS_ACTION)
                r.action = aruns
        keys.append((k, c))
    elem.keys = keys
    return r


def encode_runs(enc: TableBuilder, r: _Runs) -> None:
    """Column ``RUNS_COL`` (kind ``runs``): row *i* the starts then the lengths of its trajectories'
    runs, null for a row stored whole."""
    enc.names.claim(RUNS_COL, ("attention_mask",), companion=True)
    enc.add(RUNS_COL, pa.array(r.runs, type=pa.list_(pa.int64())), {"kind": "runs"}, ("attention_mask",))
    if r.action is not None:
        enc.names.claim(RUNS_ACTION, ("attention_mask",), companion=True)
        enc.add(RUNS_ACTION, pa.array(r.action, type=pa.list_(pa.int64())), {"kind": "runs"}, ("attention_mask",))
    enc.needs(3)


def _uint(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}")


def encode_cells(enc: TableBuilder, node: dict, p: RunCells) -> None:
    """A token cell column whose grouped rows hold their runs only (``"runs"``), with ``pad`` or
    ``pad_col`` for the padded positions; its shapes stay the rows' full shapes."""
    n = len(p.elems)
    vals, pads, shapes = [], [], []
    plen = np.zeros(n, dtype=np.int64)
    absent = np.array([e is None or e is MISSING for e in p.elems], dtype=bool)
    for i, e in enumerate(p.elems):
        if absent[i]:
            shapes.append(None)
            vals.append(np.empty(0, dt.storage_numpy(p.dtype)))
            continue
        _, _, x = as_cpu(e, p.path + (i,))
        s = storage(x)
        shapes.append(list(x.shape))
        m = p.masks[i]
        if m is None:
            vals.append(s.reshape(-1))
            continue
        w = math.prod(x.shape[2:])
        xr, mm = s.reshape(x.shape[0], x.shape[1], w), m.numpy()
        vals.append(xr[mm].reshape(-1))
        pads.append(xr[~mm].reshape(-1))
        plen[i] = pads[-1].size
    sdt = dt.storage_numpy(p.dtype)
    flat = np.concatenate(vals) if vals else np.empty(0, sdt)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([v.size for v in vals], out=offsets[1:])
    pv = np.concatenate(pads) if pads else np.empty(0, sdt)
    node.update(t="cell", col=p.col, lib=p.lib, dtype=p.dtype, shape_col=SHAPE_PREFIX + p.col, kind="token",
                runs=p.runs, pad=None)
    enc.add(p.col, list_array(offsets, flat, absent), {"dtype": p.dtype, "kind": "cell"}, p.path)
    enc.add(node["shape_col"], pa.array(shapes, type=pa.list_(pa.int64())), {"kind": "shape"}, p.path)
    u = _uint(pv)
    if u.size and not bool((u != u[0]).any()):
        node["pad"] = int(u[0]) if pv.dtype.itemsize == 1 else int(u[:1].view(f"i{pv.dtype.itemsize}")[0])
    elif u.size:
        node["pad_col"] = PAD_PREFIX + p.col
        enc.names.claim(node["pad_col"], p.path, companion=True)
        poff = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(plen, out=poff[1:])
        enc.add(node["pad_col"], list_array(poff, pv), {"dtype": p.dtype, "kind": "pad"}, p.path)
    enc.needs(3)


def decode_cells(cols: Columns, node: dict, n: int, budget: int | None = None) -> list:
    """The rows of a token cell column with runs: each grouped row rebuilt at its full shape, its
    runs' values at their positions and the pad value (or ``pad_col`` values) elsewhere. A row
    MUST hold exactly its runs' values and its runs MUST lie within the row's width; the padded
    outputs and their masks together MUST stay within ``budget`` bytes (default: the decode limit,
    ``limits.MAX_DECODED_BYTES``), checked before each is allocated."""
    budget = limits.MAX_DECODED_BYTES if budget is None else budget
    off, v = cols.list_parts(node["col"], node["dtype"])
    shapes, runs = cols.pylist(node["shape_col"]), cols.pylist(node["runs"])
    pv = cols.list_parts(node["pad_col"], node["dtype"]) if "pad_col" in node else None
    where = f"{cols.where}: column {node['col']!r}"
    if len(off) != n + 1 or len(shapes) != n or len(runs) != n or (pv is not None and len(pv[0]) != n + 1):
        raise FormatError(f"{where} has {len(off) - 1} rows, expected {n}")
    size = dt.storage_numpy(node["dtype"]).itemsize
    out: list = [None] * n
    for i, (shp, r) in enumerate(zip(shapes, runs)):
        if shp is None:
            continue
        x = v[off[i] - off[0]: off[i + 1] - off[0]]
        if any(type(d) is not int or d < 0 for d in shp) or (r is None and math.prod(shp) != len(x)):
            raise FormatError(f"{where} row {i} has shape {shp} but {len(x)} values")
        if r is None:
            out[i] = dt.as_value(x.reshape(shp), node)
            continue
        g, T = (shp[0], shp[1]) if len(shp) >= 2 else (0, 0)
        w = math.prod(shp[2:])
        s, ln = np.asarray(r[:g], dtype=np.int64), np.asarray(r[g:], dtype=np.int64)
        budget -= g * T * (w * size + 4) + 8 * T  # the row, its span mask (two comparisons), its inverse, arange(T)
        if len(shp) < 2 or len(r) != 2 * g or bool((s < 0).any() or (ln < 0).any() or (s + ln > T).any()) \
                or int(ln.sum()) * w != len(x) or budget < 0:
            if budget < 0 and len(shp) >= 2:
                raise limits.over(cols.where, limits.MAX_DECODED_BYTES - budget,
                                  f"the grouped rows of column {node['col']!r} (row {i}: {shp})")
            raise FormatError(f"{where} row {i}: its runs {r[:8]} do not fit its shape {shp} and "
                              f"{len(x)} values")
        m = span_mask(s, ln, T).numpy()
        a = np.empty((g, T, w), dtype=x.dtype)
        if cols.defer is not None and node["lib"] == "torch":  # filled by the caller (trajstore/device/pad.py)
            _defer(cols, node, i, a, m, x, ln, T, w, pv)
            out[i] = dt.as_value(a.reshape(shp), node)
            continue
        if pv is None:
            (_uint(a) if size == 1 else a.view(f"i{size}")).fill(node.get("pad") or 0)
        else:
            p = pv[1][pv[0][i] - pv[0][0]: pv[0][i + 1] - pv[0][0]]
            if len(p) != (g * T - int(ln.sum())) * w:
                raise FormatError(f"{cols.where}: column {node['pad_col']!r} row {i} does not hold the "
                                  f"padded positions of {node['col']!r}")
            a[~m] = p.reshape(-1, w)
        a[m] = x.reshape(int(ln.sum()), w)
        out[i] = dt.as_value(a.reshape(shp), node)
    return out


def _defer(cols: Columns, node: dict, i: int, a: np.ndarray, m: np.ndarray, x: np.ndarray, ln: np.ndarray,
           T: int, w: int, pv: Any) -> None:
    """Row ``i``'s output ``a`` left unfilled, its fill job (``tensors.FillJob``) handed to ``cols.defer``."""
    off = np.zeros(len(ln) + 1, dtype=np.int64)
    np.cumsum(ln * w, out=off[1:])
    pads = None
    if pv is not None:
        p = pv[1][pv[0][i] - pv[0][0]: pv[0][i + 1] - pv[0][0]]
        if len(p) != (len(ln) * T - int(ln.sum())) * w:
            raise FormatError(f"{cols.where}: column {node['pad_col']!r} row {i} does not hold the "
                              f"padded positions of {node['col']!r}")
        poff = np.zeros(len(ln) + 1, dtype=np.int64)
        np.cumsum((T - ln) * w, out=poff[1:])
        pads = (poff, bits(dt.as_value(p, node)).reshape(-1))
    cols.defer.append(FillJob(dt.as_value(a, node), torch.from_numpy(m), bits(dt.as_value(x, node)).reshape(-1), off,
                              node.get("pad") or 0, 0, len(ln), pads))  # type: ignore[union-attr]
