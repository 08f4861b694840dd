"""Two runs side by side in ``trajstore view A B`` (docs/PRECISION.md): the JSON of

* ``/api/compare/run``: both runs' per-step curves of the split, overlaid on the run page: the mean of
  each numeric field over a step's trajectories (and tokens), and the numbers of the step metadata
  (``meta.loss``, ``meta.grad_norm``); each step is read once (kept on the ``View``);
* ``/api/compare/diff``: every (step, field) of the diff beyond tolerance (``trajstore diff``, joined on
  trajectory ids where a dump holds them), with the worst trajectory's id and token;
* ``/api/compare/traj``: one trajectory of both runs, found by its id ``(step, row)`` in each (whatever
  its row there), one field's values token by token, their ``|a - b|`` and the colour scale fitted to
  them (0 to the largest difference).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import ConfigError, StepNotFoundError
from ..format.batch import containers
from ..format.codec.rows import rows
from ..inspection.diff import diff
from ..inspection.diff_field import OK
from ..inspection.traces import decode_ids
from ..read.reader import Reader
from .pages import _f, dump_name

__all__ = ["curves", "diverging", "aligned", "TOKEN_FIELDS"]

TOKEN_FIELDS = ("input_ids", "responses", "prompts", "completion_ids", "prompt_ids")  # where token ids come from


def _readers(view: Any, split: str | None = None) -> tuple[Reader, Reader]:
    if view.other is None:
        raise ConfigError("comparing runs needs two dumps: trajstore view PATH PATH2")
    ra = view.reader(split)
    return ra, Reader(view.other, ra.split)


def _rows(r: Reader, step: int) -> list[dict | None]:
    spec = r.info(step)["batch"]
    return rows(containers.unwrap(r.read(step))[0], spec)


def _means(r: Reader, step: int) -> dict[str, float]:
    """The mean of each numeric field over the step's trajectories (their own tokens), and the step
    metadata's numbers."""
    sums: dict[str, list[float]] = {}
    for row in _rows(r, step):
        for k, v in (row or {}).items():
            a = np.asarray(v) if isinstance(v, np.ndarray | np.generic | int | float) else None
            if a is None or a.dtype.kind not in "biuf" or isinstance(v, bool) or k == "attention_mask":
                continue
            x = a.astype(np.float64).reshape(-1)
            x = x[np.isfinite(x)]
            s = sums.setdefault(k, [0.0, 0.0])
            s[0] += float(x.sum())
            s[1] += len(x)
    out = {k: s[0] / s[1] for k, s in sums.items() if s[1]}
    for k, v in r.meta(step).items():
        vals = v if isinstance(v, list) else [v]
        if vals and all(isinstance(x, int | float) and not isinstance(x, bool) for x in vals):
            out[f"meta.{k}"] = float(np.mean(vals))
    return out


def curves(view: Any, split: str | None = None) -> dict:
    """Both runs' curves of ``split``: ``{"runs": [name a, name b], "steps": [...], "series": {metric:
    [ys of a, ys of b]}}`` over the steps of either run (None where a run has no such step)."""
    ra, rb = _readers(view, split)
    ra.refresh()
    steps = sorted(set(ra.steps) | set(rb.steps))
    cache = view.__dict__.setdefault("_compare_means", {})  # a committed step does not change
    per = [{s: cache[k] if (k := (str(r.path), r.split, s)) in cache else cache.setdefault(k, _means(r, s))
            for s in steps if s in r.steps} for r in (ra, rb)]
    names: dict[str, None] = {}
    for p in per:
        for m in p.values():
            names.update(dict.fromkeys(m))
    series = {k: [[_f(p.get(s, {}).get(k)) for s in steps] for p in per] for k in names}
    a, b = dump_name(ra.path), dump_name(rb.path)
    if a == b:
        a, b = str(ra.path), str(rb.path)
    return {"split": ra.split, "runs": [a, b], "paths": [str(ra.path), str(rb.path)], "steps": steps,
            "series": series}


def _loc(loc: dict | None) -> dict | None:
    return None if loc is None else {k: _f(v) if not isinstance(v, list | dict) else v for k, v in loc.items()}


def diverging(view: Any, split: str | None = None, atol: float = 0.0, rtol: float = 0.0) -> dict:
    """Every (step, field) of the diff of the two runs beyond tolerance, and each field's summary."""
    ra, rb = _readers(view, split)
    rep = diff(ra, rb, split=ra.split, atol=atol, rtol=rtol)
    entries = []
    for e in rep.entries:
        if e.status in OK:
            continue
        entries.append({"step": e.step, "field": e.field, "status": e.status, "max_abs": _f(e.max_abs),
                        "mean_abs": _f(e.mean_abs), "max_rel": _f(e.max_rel), "mean_rel": _f(e.mean_rel),
                        "worst": _loc(e.worst), "first": _loc(e.first), "beyond": e.beyond, "note": e.note})
    fields = {k: {"status": f["status"], "steps": f["steps"], "n_exceed": f["n_exceed"], "max_abs": _f(f["max_abs"]),
                  "max_rel": _f(f["max_rel"])} for k, f in rep.fields().items()}
    return {"a": str(ra.path), "b": str(rb.path), "split": ra.split, "runs": [dump_name(ra.path), dump_name(rb.path)],
            "atol": atol, "rtol": rtol, "ok": rep.ok, "fields": fields, "entries": entries}


def _row_of(r: Reader, step: int, row: int) -> int:
    ids = r.ids(step)
    hit = np.flatnonzero((ids[:, 0] == step) & (ids[:, 1] == row))
    if not len(hit):
        raise StepNotFoundError(f"step {step} of {r.path} split {r.split!r} holds no trajectory of id ({step}, {row})",
                                step=step)
    return int(hit[0])


def _token_ids(view: Any, r: Reader, step: int, row: int, n: int) -> list[int] | None:
    """The token ids of trajectory ``(step, row)``: from the row itself, else from the dump's other splits
    (the inputs of outputs recorded next to them), where one holds ``n`` of them."""
    for split in [r.split] + [s for s in r.splits if s != r.split]:
        try:
            rr = r if split == r.split else Reader(r.path, split)
            got = _rows(rr, step)[_row_of(rr, step, row)] or {}
        except (StepNotFoundError, ConfigError, OSError):
            continue
        for k in TOKEN_FIELDS:
            v = got.get(k)
            if isinstance(v, np.ndarray) and v.ndim == 1 and len(v) == n:
                return [int(x) for x in v]
    return None


def aligned(view: Any, step: int, row: int, field: str | None = None, split: str | None = None) -> dict:
    """Trajectory ``(step, row)`` of both runs: ``field``'s values token by token (default: the first
    per-token float field they share), ``|a - b|`` per token, and the colour scale fitted to those."""
    ra, rb = _readers(view, split)
    got = [_rows(r, step)[_row_of(r, step, row)] or {} for r in (ra, rb)]
    if field is None:
        field = next((k for k, v in got[0].items() if isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind == "f"
                      and isinstance(got[1].get(k), np.ndarray)), None)
    if field is None or field not in got[0] or field not in got[1]:
        raise ConfigError(f"trajectory ({step}, {row}) has no field {field!r} in both runs; fields: {sorted(got[0])}")
    a = np.asarray(got[0][field], dtype=np.float64).reshape(-1)
    b = np.asarray(got[1][field], dtype=np.float64).reshape(-1)
    n = min(len(a), len(b))
    d = np.abs(a[:n] - b[:n])
    d[np.isnan(a[:n]) & np.isnan(b[:n])] = 0.0
    finite = d[np.isfinite(d)]
    hi = float(finite.max()) if len(finite) else 0.0
    ids = _token_ids(view, ra, step, row, n)
    text = None
    if ids is not None and view.tokenizer is not None:
        text = [decode_ids(view.tokenizer, [i]) for i in ids]
    toks = [{"pos": j, "id": None if ids is None else ids[j], "text": str(j) if ids is None else (
             text[j] if text else str(ids[j])), "a": _f(float(a[j])), "b": _f(float(b[j])), "diff": _f(float(d[j]))}
            for j in range(n)]
    return {"split": ra.split, "step": step, "row": row, "field": field, "runs": [dump_name(ra.path), dump_name(rb.path)],
            "index": [_row_of(ra, step, row), _row_of(rb, step, row)], "tokens": toks,
            "lengths": [len(a), len(b)], "scale": {"min": 0.0, "max": hi if math.isfinite(hi) else None}}
