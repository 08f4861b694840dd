"""What the pages of ``trajstore view`` show, as plain JSON-able dicts, reading only what a page needs.

Definitions (also in README.md and docs/CLI.md):

* **reward**: the per-trajectory field ``rewards`` (else ``reward``, ``scores``, else the first float
  per-trajectory field); ``reward_std`` is the population standard deviation (``numpy.std``).
* **length**: a trajectory's response tokens: the count of its non-zero loss-mask tokens (the first of
  ``loss_mask``, ``response_mask``, ``completion_mask``, ``action_mask``), else its tokens (those of the
  attention mask). ``length_p95``: ``numpy.percentile(lengths, 95)`` (linear).
* **tokens**: the total tokens of the step (every trajectory's tokens).
* **version_lag**: over the step, the largest (max policy version of the step's response tokens - min
  version of a trajectory's response tokens), from the per-token ``versions`` (else ``version``).
* **logprob_mismatch**: the mean over the step's loss-mask tokens of ``|a - b|`` for the first logprob
  pair present (``PAIRS``), or the pair asked for.

A step appended as a padded or packed dict is read column by column straight from its file(s) (only
the columns a page needs; one row group for a trajectory), each file opened and checked as every reader
opens it (``Reader._open``: its description against its columns, the decode budget of
``format/limits.py`` before pyarrow decompresses a page); any other form (lists of trajectories,
several masks, nested fields) is decoded and cut by ``format.rows`` (``tables.step_rows``). The run
page takes a step's per-trajectory figures (``run_traj``) from the split's column index instead where
it holds them: the Writer computes them there with the functions of ``store/digest.py`` that
``run_traj`` uses on the step's file, so both give the same curves, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import ConfigError
from ..format.spec import is_dict_batch, is_plain_sample, is_token
from ..store.digest import MASKS, PAIRS, VERSIONS, absdiff, count, extremes, keep_of, seg
from ..store.digest import fast as _fast
from ..store.digest import lists as _lists
from ..read.tables import step_rows

REWARDS = ("rewards", "reward", "scores")
TOKENS = ("input_ids", "tokens", "token_ids", "sequences")
# a trajectory page's tokens from per-trajectory number lists (SkyRL's GeneratorOutput): prompt, then response
LIST_PROMPTS = ("prompt_token_ids", "prompt_ids")
LIST_RESPONSES = ("response_ids", "completion_ids", "output_ids")
LIST_MASKS = ("loss_masks",)
METRICS = ("reward_mean", "reward_std", "reward_min", "reward_max", "length_mean", "length_p95", "tokens",
           "version_lag", "logprob_mismatch")


@dataclass
class Cols:
    """Some columns of one step (or one trajectory of it): ragged token fields as offsets + values."""

    n: int  # trajectories
    counts: np.ndarray  # tokens of each trajectory
    tok: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # name -> (offsets, values)
    scal: dict[str, list] = field(default_factory=dict)  # name -> one value per trajectory (None: absent)
    f32: set[str] = field(default_factory=set)  # scalar fields stored as float32 or narrower (shown as float32)

    def row(self, name: str, i: int) -> np.ndarray | None:
        got = self.tok.get(name)
        return None if got is None else got[1][got[0][i]:got[0][i + 1]]


@dataclass
class Fields:
    """The fields of a split the pages use (None where the dump has none)."""

    tokens: list[str]  # per-token 1-D fields
    scalars: list[str]  # per-trajectory scalar fields (numbers or text), in spec order
    reward: str | None = None
    mask: str | None = None
    versions: str | None = None
    ids: str | None = None
    pair: tuple[str, str] | None = None
    prompt: str | None = None  # a number-list field of the tokens before ``ids`` (``ids`` a list of the response's)


def _is_list(node: Any) -> bool:
    """A per-trajectory list of numbers (an ``ilist`` / ``flist`` column: SkyRL's ``response_ids``...)."""
    return isinstance(node, dict) and node.get("t") == "seq" and isinstance(node.get("elem"), dict) \
        and node["elem"].get("t") == "value" and node["elem"].get("ptype") in ("ilist", "flist")


def _spec_fields(spec: Any, lists: bool = False) -> tuple[list[str], list[str], set[str]]:
    """(1-D token fields, scalar per-trajectory fields, float scalar fields) of a step spec; ``lists``:
    per-trajectory number lists count as token fields (the trajectory page)."""
    toks, scal, floats = [], [], set()
    if is_dict_batch(spec):
        for k, n in spec["keys"]:
            if is_token(n) and n.get("trail") == [] or lists and _is_list(n):
                toks.append(k)
            elif is_plain_sample(n):
                scal.append(k)
                if str(n.get("dtype")).startswith(("float", "bfloat")):
                    floats.add(k)
            elif isinstance(n, dict) and n.get("t") == "seq" and isinstance(n.get("elem"), dict) \
                    and n["elem"].get("t") == "value" and n["elem"].get("ptype") in ("str", "int", "float"):
                scal.append(k)
                if n["elem"]["ptype"] == "float":
                    floats.add(k)
    return toks, scal, floats


def _row_fields(rows: list) -> tuple[list[str], list[str], set[str]]:
    toks: dict = {}
    scal: dict = {}
    floats = set()
    for r in rows:
        if r is None:
            continue
        for k, v in r.items():
            a = v if isinstance(v, np.ndarray) else None
            if a is not None and a.ndim == 1 and a.dtype.kind in "biuf":
                toks.setdefault(k, None)
            elif a is not None and a.ndim == 0 or isinstance(v, int | float | str | np.generic):
                scal.setdefault(k, None)
                if np.asarray(v).dtype.kind == "f":
                    floats.add(k)
    return list(toks), list(scal), floats


def pick(toks: list[str], scal: list[str], floats: set[str], pair: tuple[str, str] | None = None) -> Fields:
    first = lambda names, have: next((n for n in names if n in have), None)  # noqa: E731
    f = Fields(toks, scal)
    f.reward = first(REWARDS, scal) or next((s for s in scal if s in floats), None)
    f.mask, f.versions, f.ids = first(MASKS + LIST_MASKS, toks), first(VERSIONS, toks), first(TOKENS, toks)
    if f.ids is None and first(LIST_RESPONSES, toks):  # number lists: the prompt's, then the response's
        f.ids, f.prompt = first(LIST_RESPONSES, toks), first(LIST_PROMPTS, toks)
    if pair is not None:
        missing = [p for p in pair if p not in toks]
        if missing:
            raise ConfigError(f"logprob pair {list(pair)}: no per-token field {missing[0]!r}; per-token fields: {toks}")
        f.pair = (pair[0], pair[1])
    else:
        f.pair = next((p for p in PAIRS if p[0] in toks and p[1] in toks), None)
    return f


def fields_of(reader: Any, step: int, pair: tuple[str, str] | None = None, lists: bool = False) -> Fields:
    """The fields of ``step`` (its spec, or its decoded rows for forms read through ``rows``); ``lists``:
    per-trajectory number lists as token fields too (the trajectory page)."""
    doc = reader._open(step, True, reader.files(step)[0]).doc  # checked as every reader checks a file
    if _fast(doc):
        return pick(*_spec_fields(doc["batch"], lists), pair)
    return pick(*_row_fields(step_rows(reader, step)), pair)


def read(reader: Any, step: int, toks: list[str], scal: list[str], row: int | None = None) -> Cols:
    """Columns ``toks`` (per-token) and ``scal`` (per-trajectory) of ``step``; ``row``: only that trajectory."""
    files = reader.files(step)
    parts = []
    first = 0
    for f in files:
        sf = reader._open(step, True, f)  # the spec against its columns, the decode budget (limits.check_pages)
        if not _fast(sf.doc):
            return _from_rows(reader, step, toks, scal, row)
        keys = dict(sf.doc["batch"]["keys"])
        nrows = sf.pf.metadata.num_rows
        if row is not None and not first <= row < first + nrows:
            first += nrows
            continue
        want = [n for n in toks if is_token(keys.get(n)) or _is_list(keys.get(n))] + [n for n in scal if n in keys]
        cnt = next((n for n in toks if is_token(keys.get(n)) or _is_list(keys.get(n))), None)
        if cnt is None:  # the token counts come from any token column (the length column of padded form)
            cnt = next((k for k, n in keys.items() if is_token(n)), None)
            if cnt is not None:
                want.append(cnt)
        cols = [keys[n]["col"] if "col" in keys[n] else keys[n]["elem"]["col"] for n in want]
        len_col = sf.doc["batch"].get("len_col") if cnt is None else None
        cols += [len_col] if len_col else []
        if row is None:
            t = sf.pf.read(columns=cols)
        else:
            k, lo = 0, first
            while lo + sf.pf.metadata.row_group(k).num_rows <= row:
                lo += sf.pf.metadata.row_group(k).num_rows
                k += 1
            t = sf.pf.read_row_group(k, columns=cols).slice(row - lo, 1)
        parts.append((want, t, cnt, len_col))
        first += nrows
    return _join(parts, toks, scal)


def _join(parts: list, toks: list[str], scal: list[str]) -> Cols:
    n = sum(t.num_rows for _, t, _, _ in parts)
    counts = []
    tok: dict[str, list] = {k: [] for k in toks}
    sc: dict[str, list] = {k: [] for k in scal}
    f32: set[str] = set()
    for want, t, cnt, len_col in parts:
        got = dict(zip(want, t.columns))
        if cnt is not None:
            counts.append(np.diff(_lists(got[cnt])[0]))
        elif len_col:
            counts.append(t.column(len_col).to_numpy().astype(np.int64))
        else:
            counts.append(np.zeros(t.num_rows, np.int64))
        for k in toks:
            tok[k].append(_lists(got[k]) if k in got else None)
        for k in scal:
            sc[k] += got[k].to_pylist() if k in got else [None] * t.num_rows
            if k in got and pa.types.is_floating(got[k].type) and got[k].type.bit_width <= 32:
                f32.add(k)
    out = Cols(n, np.concatenate(counts) if counts else np.zeros(0, np.int64), scal=sc, f32=f32)
    for k, ps in tok.items():
        if ps and all(p is not None for p in ps):
            vals = [p[1][p[0][0]:p[0][-1]] for p in ps]
            lens = np.concatenate([np.diff(p[0]) for p in ps])
            out.tok[k] = (np.concatenate([[0], np.cumsum(lens)]), np.concatenate(vals))
    return out


def _from_rows(reader: Any, step: int, toks: list[str], scal: list[str], row: int | None) -> Cols:
    rows = step_rows(reader, step)
    if row is not None:
        if not 0 <= row < len(rows):
            raise ConfigError(f"step {step} has {len(rows)} trajectories; there is no trajectory {row}")
        rows = [rows[row]]
    counts = []
    for r in rows:
        if r is None:
            counts.append(0)
            continue
        base = next((r[k] for k in ("attention_mask", *MASKS, *TOKENS, *toks) if isinstance(r.get(k), np.ndarray)
                     and r[k].ndim >= 1), None)
        counts.append(0 if base is None else len(base))
    out = Cols(len(rows), np.asarray(counts, np.int64))
    for k in toks:
        vals = [np.asarray(r[k]).reshape(-1) if r is not None and k in r else np.zeros(0) for r in rows]
        lens = np.asarray([len(v) for v in vals], np.int64)
        if any(r is not None and k in r for r in rows):
            out.tok[k] = (np.concatenate([[0], np.cumsum(lens)]), np.concatenate(vals) if vals else np.zeros(0))
    for k in scal:
        out.scal[k] = [_plain(r.get(k)) if r is not None else None for r in rows]
        if any(isinstance(r.get(k), np.ndarray | np.generic) and np.asarray(r[k]).dtype.kind == "f"
               and np.asarray(r[k]).dtype.itemsize <= 4 for r in rows if r is not None):
            out.f32.add(k)
    return out


def _plain(v: Any) -> Any:
    if isinstance(v, np.ndarray | np.generic):
        return v.item() if np.ndim(v) == 0 else None
    return v


def per_traj(c: Cols, f: Fields) -> dict[str, np.ndarray]:
    """reward, length, version (max), version min (response tokens) of each trajectory (NaN: none)."""
    out = {"reward": np.asarray([np.nan if v is None else float(v) for v in c.scal.get(f.reward, [None] * c.n)]
                                if f.reward else [np.nan] * c.n, dtype=np.float64)}
    keep = None
    if f.mask in c.tok:
        offs, m = c.tok[f.mask]
        keep = keep_of(m)
        out["length"] = count(offs, keep)
    else:
        out["length"] = c.counts.astype(np.float64)
    if f.versions in c.tok:
        offs, v = c.tok[f.versions]
        ok = keep is not None and len(keep) == len(v) and np.array_equal(offs, c.tok[f.mask][0])
        out["version"], out["version_min"] = extremes(offs, v, keep if ok else None)
    return out


def run_traj(c: Cols, f: Fields) -> dict[str, np.ndarray]:
    """What ``metrics`` needs of each trajectory of one step: ``per_traj``'s figures, ``tokens`` (int64)
    and ``lp_sum`` / ``lp_n`` (the logprob pair's masked ``|a - b|`` sum and token count), NaN where
    the step has no such value. ``View`` builds the same from the column index (``store/digest.py``)."""
    t = per_traj(c, f)
    t["tokens"] = c.counts.astype(np.int64)
    nan = np.full(c.n, np.nan)
    t.setdefault("version", nan)
    t.setdefault("version_min", nan)
    t["lp_sum"] = t["lp_n"] = nan
    if f.pair and f.pair[0] in c.tok and f.pair[1] in c.tok:
        got = absdiff(c.tok[f.pair[0]], c.tok[f.pair[1]], c.tok.get(f.mask) if f.mask else None)
        if got is not None:
            t["lp_sum"], t["lp_n"] = got[0], got[1]
    return t


def index_keys(f: Fields) -> list:
    """The column-index entries whose values make a step's ``run_traj`` (``from_index``): the reward
    field, then the digests of ``store/digest.py`` for the fields ``f`` names."""
    need = needs(f, True)
    keys: list = [f.reward] if f.reward else []
    keys.append(("tokens", (need[0],) if need else ()))  # as ``read`` counts a step's tokens
    if f.mask:
        keys.append(("length", (f.mask,)))
    if f.versions:
        by = (f.versions, f.mask) if f.mask else (f.versions,)
        keys += [("version_max", by), ("version_min", by)]
    if f.pair:
        by = (*f.pair, f.mask) if f.mask else tuple(f.pair)
        keys += [("absdiff", by), ("absdiff_n", by)]
    return keys


def from_index(f: Fields, got: list[np.ndarray]) -> dict[str, np.ndarray]:
    """``run_traj`` of a step (or ``join`` of several) from the values of ``index_keys(f)`` (in that order)."""
    it = iter(got)
    rew = next(it).astype(np.float64) if f.reward else None
    tokens = next(it).astype(np.int64)
    n = len(tokens)
    nan = np.full(n, np.nan)
    t = {"reward": nan if rew is None else rew, "tokens": tokens,
         "length": next(it).astype(np.float64) if f.mask else tokens.astype(np.float64)}
    t["version"], t["version_min"] = (next(it), next(it)) if f.versions else (nan, nan)
    t["lp_sum"], t["lp_n"] = (next(it), next(it).astype(np.float64)) if f.pair else (nan, nan)
    return t


def join(parts: list[dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Several steps' ``run_traj`` as one (rows in order) and the row bounds of each step (``[G + 1]``)."""
    bounds = np.concatenate([[0], np.cumsum([len(p["tokens"]) for p in parts])]).astype(np.int64)
    keys = ("reward", "length", "tokens", "version", "version_min", "lp_sum", "lp_n")
    out = {k: np.concatenate([p[k] for p in parts]) if parts else np.zeros(0) for k in keys}
    if not parts:
        out["tokens"] = np.zeros(0, np.int64)
    return out, bounds


def _pct(x: np.ndarray, bounds: np.ndarray, q: float) -> np.ndarray:
    """``numpy.percentile(x[lo:hi], q)`` (linear) of each group, vectorized (numpy's own interpolation)."""
    G = len(bounds) - 1
    n = np.diff(bounds)
    gid = np.repeat(np.arange(G), n)
    xs = x[np.lexsort((x, gid))]
    out = np.full(G, np.nan)
    ok = n > 0
    pos = (q / 100) * (n[ok] - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, n[ok] - 1)
    t = pos - lo
    a, b = xs[bounds[:-1][ok] + lo], xs[bounds[:-1][ok] + hi]
    d = b - a
    out[ok] = np.where(t >= 0.5, b - d * (1 - t), a + d * t)
    return out


def metrics(t: dict[str, np.ndarray], bounds: np.ndarray) -> dict[str, list]:
    """The run-page metrics (``METRICS``) of each step of ``t`` (``join``'s ``run_traj`` of several
    steps, rows ``bounds[g]:bounds[g + 1]``): a list per metric, None where the step has no such value."""
    G = len(bounds) - 1
    n = np.diff(bounds)
    gid = np.repeat(np.arange(G), n)
    out: dict[str, np.ndarray] = {}
    rew = t["reward"]
    ok = ~np.isnan(rew)
    rn = seg(bounds, ok, np.add, 0.0)
    with np.errstate(all="ignore"):
        mean = seg(bounds, np.where(ok, rew, 0.0), np.add, 0.0) / rn
        dev = np.where(ok, rew - mean[gid], 0.0) if len(rew) else rew
        out["reward_mean"] = mean
        out["reward_std"] = np.sqrt(seg(bounds, dev * dev, np.add, 0.0) / rn)
        out["reward_min"] = np.where(rn > 0, seg(bounds, np.where(ok, rew, np.inf), np.minimum, np.nan), np.nan)
        out["reward_max"] = np.where(rn > 0, seg(bounds, np.where(ok, rew, -np.inf), np.maximum, np.nan), np.nan)
        ln = t["length"]
        out["length_mean"] = seg(bounds, ln, np.add, 0.0) / np.where(n > 0, n, np.nan)
        out["length_p95"] = _pct(ln, bounds, 95)
        out["tokens"] = seg(bounds, t["tokens"], np.add, 0.0)
        top = seg(bounds, np.nan_to_num(t["version"], nan=-np.inf), np.maximum, -np.inf)
        lag = np.where(np.isnan(t["version_min"]), -np.inf, top[gid] - t["version_min"]) if len(gid) else gid
        out["version_lag"] = seg(bounds, lag, np.maximum, -np.inf)
        out["logprob_mismatch"] = seg(bounds, t["lp_sum"], np.add, 0.0) / seg(bounds, t["lp_n"], np.add, 0.0)
    return {k: [None if not np.isfinite(x) else float(x) for x in v] for k, v in out.items()}


def step_stats(c: Cols, f: Fields) -> dict[str, float | None]:
    """The run-page metrics of one step."""
    return {k: v[0] for k, v in metrics(run_traj(c, f), np.asarray([0, c.n])).items()}


def needs(f: Fields, run: bool) -> list[str]:
    """The token columns a page reads: the mask and versions (+ the logprob pair for the run page)."""
    want = [f.mask, f.versions] + (list(f.pair) if run and f.pair else [])
    return [w for w in dict.fromkeys(want) if w]
