"""What is in a dump: splits, steps (range, gaps), rows/tokens/bytes/meta per step, fields, environment.

Only each step's Parquet footer is read (checksums are not verified here), plus one per-token
column for the token count (``tokens`` is None for steps without a per-token field). A step written
by N ranks is described whole (its shards' rows, tokens and bytes added up, rank 0's meta) with
``ranks`` N; steps whose shards are not all committed are listed under ``incomplete``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import DumpNotFoundError, foreign_errors
from ..format import typed
from ..format.spec import counted_masks, is_dict_batch, is_token, is_token_cell, is_tokenlike
from ..format.values import is_tensor
from ..store import columns, listing, manifest, paths, stepfile
from ..store.fs import resolve

__all__ = ["describe", "fields_of", "gaps", "jsonable", "short"]


def gaps(steps: list[int]) -> list[list[int]]:
    """Missing step ranges ``[first, last]`` between the first and last step."""
    out = []
    for a, b in zip(steps, steps[1:]):
        if b > a + 1:
            out.append([a + 1, b - 1])
    return out


def plain(v: Any) -> Any:
    """A numpy value as Python numbers and lists, a float32 or float16 one at its own precision:
    the shortest decimal that reads back as the same float32 (``0.2``, not ``0.20000000298023224``)."""
    if isinstance(v, np.ndarray | np.generic) and v.dtype.kind == "f" and v.dtype.itemsize < 8:
        v = np.asarray(v).astype(str).astype(np.float64)  # numpy's shortest repr of each value
    return v.tolist() if isinstance(v, np.ndarray | np.generic) else v


def jsonable(v: Any) -> Any:
    """A step's meta (or any typed value) as JSON, for display: numpy scalars and arrays and tensors
    become numbers and lists, tuples lists, non-str keys and other values (bytes...) their repr."""
    if type(v) is dict:
        return {k if type(k) is str else repr(k): jsonable(x) for k, x in v.items()}
    if type(v) is list or type(v) is tuple:
        return [jsonable(x) for x in v]
    if isinstance(v, np.ndarray | np.generic):
        return jsonable(plain(v))
    if is_tensor(v):
        return jsonable(v.tolist())
    return v if v is None or type(v) in (bool, int, float, str) else repr(v)


def short(v: Any, n: int = 60) -> str:
    """Compact JSON of a ``jsonable`` value, cut to ``n`` characters, for a table cell or a head line."""
    text = json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    return text if len(text) <= n else text[:n - 3] + "..."


def fields_of(spec: dict) -> list[dict]:
    """The fields of a step spec: dotted name, dtype, kind (token / sample / cell / value / json /
    global), shape of one token or one sample."""
    out: list[dict] = []

    def walk(name: str, node: dict, per_row: bool) -> None:
        t = node.get("t")
        if t in ("group", "struct"):
            for k, child in node["keys"]:
                walk(f"{name}.{k}" if name else k, child, per_row or t == "struct")
        elif t == "seq":
            walk(name, node["elem"], True)
        elif t == "tensor":
            kind = "token" if is_tokenlike(node) else "sample"
            out.append({"name": name, "dtype": node["dtype"], "kind": kind, "shape": node.get("trail", [])})
        elif t == "segtensor":  # one run of rows per trajectory (pixel_values): a row's shape varies
            out.append({"name": name, "dtype": node["dtype"], "kind": "segment", "shape": node["trail"]})
        elif t == "cell":
            out.append({"name": name, "dtype": node["dtype"], "kind": "token" if is_token_cell(node)
                        else "cell", "shape": None})
        elif t == "value":
            out.append({"name": name, "dtype": node["ptype"], "kind": "json" if node["ptype"] == "json"
                        else "sample", "shape": []})
        elif t == "gtensor":
            out.append({"name": name, "dtype": node["dtype"], "kind": "global", "shape": node["shape"]})
        elif t == "json":
            out.append({"name": name, "dtype": type(node["v"]).__name__, "kind": "global", "shape": []})
        elif t == "empty":
            out.append({"name": name, "dtype": "none", "kind": "sample", "shape": []})

    if is_dict_batch(spec):
        for k, node in spec["keys"]:
            walk(k, node, False)
    else:
        walk("", spec.get("elem", {}), True)
    return out


def _column(pf: pq.ParquetFile, name: str) -> Any:
    return pf.read(columns=[name]).column(0).combine_chunks()


def _nonzero(col: Any) -> int:
    """The non-zero values of a list column (a mask stored whole: its valid entries). Counted by
    Arrow: pyarrow's ``to_numpy`` loads pandas, which `trajstore info` does without."""
    v = col.values
    zero = pa.scalar(False if pa.types.is_boolean(v.type) else 0, v.type)
    return int(pc.sum(pc.not_equal(v, zero)).as_py() or 0)


def _tokens(f: pq.ParquetFile, spec: dict) -> int | None:
    """Token count of a dict batch: the lengths of its first per-token column (of each counted mask)."""
    counted = counted_masks(spec)
    if counted is not None:  # several masks: the tokens of the counted ones, one field each
        total = 0
        for i in counted:
            node = next((n for _, n in spec["keys"] if n.get("mask") == i and n.get("t") == "tensor"), None)
            if node is None:
                continue
            col = _column(f, node["col"])
            if is_token(node):
                total += int(col.offsets[-1].as_py() - col.offsets[0].as_py()) // max(1, math.prod(node["trail"]))
            elif node is dict(spec["keys"]).get(spec["masks"][i]["src"]):  # the mask itself, stored whole
                total += _nonzero(col)
        return total
    for _, node in spec["keys"]:
        if is_token(node):
            off = _column(f, node["col"]).offsets
            return int(off[-1].as_py() - off[0].as_py()) // max(1, math.prod(node["trail"]))
    am = dict(spec["keys"]).get("attention_mask", {})
    if spec.get("form") == "padded" and am.get("t") == "tensor" and len(am.get("trail", [])) == 1:
        return _nonzero(_column(f, am["col"]))  # a mask with holes is stored whole
    return None


def _counts(f: pq.ParquetFile, spec: dict, num_rows: int) -> tuple[int, int | None]:
    """(trajectories, tokens) of a step. In a list batch an element whose ``attention_mask`` is
    ``[g, T]`` (a group of rollouts) counts ``g`` trajectories, and tokens are its mask's valid
    entries (``[T]``, ``[1, T]`` or ``[g, T]``); both come from one read of that mask. ``f`` is the
    step file as the reader opened it (page checksums verified), so its footer is parsed once."""
    if is_dict_batch(spec):
        return num_rows, _tokens(f, spec)
    keys = dict(spec.get("elem", {}).get("keys", []))
    am = keys.get("attention_mask", {})
    if am.get("t") == "cell":
        t = f.read(columns=[am["col"], am["shape_col"]])
        shapes = t.column(1).to_pylist()
        rows = sum(s[0] if s is not None and len(s) == 2 and s[0] > 1 else 1 for s in shapes)
        return rows, _nonzero(t.column(0).combine_chunks())
    for node in keys.values():
        if is_token_cell(node):
            shapes = _column(f, node["shape_col"]).to_pylist()
            return num_rows, int(sum(s[1] if len(s) > 1 and s[0] == 1 else s[0] for s in shapes if s))
    return num_rows, None


def describe(path: str | Path, split: str | None = None,
             progress: Callable[[Iterable], Iterable] | None = None) -> dict:
    """A JSON-able description of the dump at ``path`` (every split, or only ``split``)."""
    root = resolve(path, "describe")
    info = manifest.read_manifest(root)
    splits = [paths.check_split(split)] if split else listing.list_splits(root)
    if split and not (root / split).is_dir():
        raise DumpNotFoundError(f"dump {root} has no split {split!r}; splits present: "
                                f"{listing.list_splits(root) or 'none'}")
    out: dict[str, Any] = {
        "path": str(root),
        "format_version": info.get("format_version"),
        "library_version": info.get("library_version"),
        "created": info.get("created"),
        "environment": info.get("environment", {}),
        "splits": {},
    }
    for sp in splits:
        listed = listing.scan(root / sp)  # what a Reader lists
        steps = [s for s in listed.steps if s not in listed.ambiguous]  # listed apart: reading one is an error
        per_step, fields = [], {}
        it = progress(steps, f"{sp}") if progress else steps
        for s in it:
            fs = listing.step_files(root / sp, listed, s)  # one file, or the shards of N ranks
            p = {"step": s, "format": 0, "rows": 0, "tokens": None, "bytes": 0}
            for f in fs:
                sf = stepfile.open_step(f, s)  # footer only (`trajstore verify` checks the bytes), parsed once
                doc, spec = sf.doc, sf.doc["batch"]
                with foreign_errors(f, "counting the trajectories of step {}", s, then="the step is damaged"):
                    rows, tokens = _counts(sf.pf, spec, doc.get("num_rows"))
                p["format"], p["rows"], p["bytes"] = max(p["format"], doc["format_version"]), p["rows"] + rows, \
                    p["bytes"] + f.stat().st_size
                p["tokens"] = tokens if p["tokens"] is None else p["tokens"] + (tokens or 0)
                if f is fs[0]:
                    p["meta"], spec0 = jsonable(typed.step_meta(doc, str(f))), spec
            per_step.append(p if len(fs) == 1 else {**p, "ranks": len(fs)})
            for fd in fields_of(spec0):
                cur = fields.setdefault(fd["name"], {**fd, "steps": 0})
                cur["steps"] += 1
                if cur["dtype"] != fd["dtype"] or cur["kind"] != fd["kind"]:
                    cur["varies"] = True
        tok = [p["tokens"] for p in per_step if p["tokens"] is not None]
        out["splits"][sp] = {
            "steps": {"count": len(steps), "first": steps[0] if steps else None,
                      "last": steps[-1] if steps else None, "gaps": gaps(steps)},
            "rows": sum(p["rows"] or 0 for p in per_step),
            "tokens": sum(tok) if tok else None,
            "bytes": sum(p["bytes"] for p in per_step),
            "formats": sorted({p["format"] for p in per_step}),
            "per_step": per_step,
            "fields": list(fields.values()),
            "columns": columns.read(root / sp),  # the split's column types (docs/FORMAT.md 3.11), or None
            "incomplete": [{"step": k, "ranks": n, "missing": miss} for k, (n, miss) in listed.incomplete.items()],
            "ambiguous": [{"step": k, "files": names} for k, names in sorted(listed.ambiguous.items())],
        }
    return out
