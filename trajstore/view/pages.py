"""The JSON of each page of ``trajstore view`` (``/api/run``, ``/api/step``, ``/api/traj``, ``/api/diff``).

``View`` holds the Readers of one dump (one per split) and the run metrics of the steps already read
(a committed step file does not change), so a page reload reads only steps committed since.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, StepNotFoundError, TrajstoreError
from ..base.text import format_ranges, runs
from ..inspection.diff import diff
from ..inspection.diff_field import OK
from ..inspection.traces import load_tokenizer
from ..read.reader import Reader
from . import data
from .tokens import number, token_texts

CHUNK = 256  # steps read per batch of the run page's metrics
READERS = 2  # step files read at once (pyarrow's reads release the GIL)


LONE_LOGPROBS = ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs", "rollout_log_probs", "action_log_probs")


def _last(a: Any, n: int, fill: Any) -> np.ndarray:
    """A per-token field of the LAST ``len(a)`` of a trajectory's ``n`` tokens (OpenRLHF's action fields:
    tokens 1..n-1; SkyRL's response fields) aligned to all ``n``: ``fill`` in front."""
    a = np.asarray(a)
    if len(a) >= n:
        return a
    return np.concatenate([np.full(n - len(a), fill, dtype=np.result_type(a.dtype, np.asarray(fill).dtype)), a])


def _f(v: Any) -> Any:
    """A value as JSON: NaN as None, infinities as the text ``inf`` / ``-inf``."""
    if isinstance(v, float | np.floating):
        return None if math.isnan(v) else float(v) if math.isfinite(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, np.integer):
        return int(v)
    return v


class View:
    """The data behind the pages of one dump (``path``) and, for the diff page, a second (``other``)."""

    def __init__(self, path: Any, split: str | None = None, tokenizer: Any = None, other: Any = None):
        first = Reader(path, split)
        self.path, self.split = first.path, first.split
        self.splits = first.splits
        self._readers = {first.split: first}
        self.tokenizer = load_tokenizer(tokenizer)
        self.other = other
        self._cache: dict[tuple, dict] = {}  # (split, fields) -> step -> metrics
        self._jobs: dict[tuple, threading.Thread] = {}
        self._errors: dict[tuple, dict] = {}
        self._lock = threading.Lock()

    def reader(self, split: str | None) -> Reader:
        split = self.split if split in (None, "") else split
        with self._lock:
            if split not in self._readers:
                if split not in self.splits:
                    raise StepNotFoundError(f"dump {self.path} has no split {split!r}; splits: {self.splits}")
                self._readers[split] = Reader(self.path, split)
            return self._readers[split]

    # -- run page
    def run(self, split: str | None = None, pair: tuple[str, str] | None = None, wait: float | None = None) -> dict:
        """The run page's curves. Each step's metrics come from the split's column index where it holds
        the step's digests (``store/digest.py``), else from its file, read on a thread of their own
        (``CHUNK`` steps at a time); this waits ``wait`` seconds for those (None: until all are in)
        and says how many are ``pending``."""
        r = self.reader(split)
        with self._lock:
            r.refresh()
            steps = r.steps
        f = data.fields_of(r, steps[-1], pair) if steps else data.pick([], [], set(), None)
        key = (r.split, f.reward, f.mask, f.versions, f.pair)
        with self._lock:
            done = self._cache.setdefault(key, {})
            todo = [s for s in steps if s not in done]
        if todo:
            done.update(self._indexed(r, f, todo))
        with self._lock:
            todo = [s for s in steps if s not in done]
            job = self._jobs.get(key)
            if todo and (job is None or not job.is_alive()):
                job = self._jobs[key] = threading.Thread(target=self._work, args=(r.split, f, todo, done),
                                                         name="trajstore-view", daemon=True)
                job.start()
        if todo and job is not None:
            job.join(wait)
        series: dict[str, list] = {m: [] for m in data.METRICS}
        pending = 0
        for s in steps:
            st = done.get(s)
            if st is None:
                pending += 1
                st = {}
            for m in data.METRICS:
                series[m].append(st.get(m))
        missing = [{"step": s, "why": "skipped", "detail": why} for s, why in sorted(r.skipped.items())]
        missing += [{"step": s, "why": "incomplete", "detail": f"{n} ranks, missing {ranks}"}
                    for s, (n, ranks) in sorted(r._listing.incomplete.items())]
        if f.pair is None:
            series.pop("logprob_mismatch")
        return {"path": str(self.path), "split": r.split, "default_split": self.split, "splits": self.splits,
                "steps": steps, "series": series, "pending": pending,
                "errors": [{"step": s, "error": e} for s, e in sorted(self._errors.get(key, {}).items())],
                "missing": sorted(missing, key=lambda m: m["step"]),
                "fields": {"reward": f.reward, "mask": f.mask, "versions": f.versions,
                           "pair": list(f.pair) if f.pair else None}}

    def _work(self, split: str, f: data.Fields, todo: list[int], done: dict) -> None:
        r = Reader(self.path, split)  # a reader of its own: the request threads keep theirs
        errors = self._errors.setdefault((split, f.reward, f.mask, f.versions, f.pair), {})
        toks, scal = data.needs(f, True), [f.reward] if f.reward else []
        def one(s: int) -> Any:
            try:
                return data.run_traj(data.read(r, s, toks, scal), f)
            except (TrajstoreError, OSError) as e:
                return e

        with ThreadPoolExecutor(READERS, thread_name_prefix="trajstore-view") as ex:
            for lo in range(0, len(todo), CHUNK):
                chunk = todo[lo:lo + CHUNK]
                parts, got = [], []
                for s, t in zip(chunk, ex.map(one, chunk)):
                    if isinstance(t, dict):
                        parts.append(t)
                        got.append(s)
                    else:
                        errors[s] = f"{type(t).__name__}: {t}"
                        done[s] = dict.fromkeys(data.METRICS)
                ms = data.metrics(*data.join(parts))
                for g, s in enumerate(got):
                    done[s] = {m: ms[m][g] for m in data.METRICS}

    def _indexed(self, r: Reader, f: data.Fields, steps: list[int]) -> dict[int, dict]:
        """The metrics of the steps of ``steps`` whose per-trajectory figures the split's column index
        holds (the others are left out)."""
        try:
            have, bounds, cols = r._index.table(data.index_keys(f), steps, r._listing.shards)
        except (TrajstoreError, OSError):
            return {}
        if not have:
            return {}
        ms = data.metrics(data.from_index(f, cols), bounds)
        return {s: {m: ms[m][g] for m in data.METRICS} for g, s in enumerate(have)}

    # -- step page
    def step(self, split: str | None, step: int) -> dict:
        r = self.reader(split)
        f = data.fields_of(r, step)
        c = data.read(r, step, data.needs(f, False), f.scalars)
        t = data.per_traj(c, f)
        base = ["index", "reward", "length", "version"]
        extra = {(s if s not in base else f"field:{s}"): s for s in f.scalars if s != f.reward}
        cols = base + list(extra)
        rows = []
        for i in range(c.n):
            row = {"index": i, "reward": _f32(t["reward"][i], f.reward in c.f32), "length": _f(t["length"][i]),
                   "version": _f(t["version"][i]) if "version" in t else None}
            for k, s in extra.items():
                row[k] = _f32(c.scal[s][i], s in c.f32)
            rows.append(row)
        empty = [k for k in cols[1:] if all(row[k] in (None, "") for row in rows)]  # hidden: no values
        cols = [k for k in cols if k not in empty]
        text = [k for k in cols if any(isinstance(row[k], str) and row[k] not in ("inf", "-inf") for row in rows)]
        return {"path": str(self.path), "split": r.split, "step": step, "columns": cols, "rows": rows,
                "empty": empty, "text": text,
                "fields": {"reward": f.reward, "mask": f.mask, "versions": f.versions}}

    # -- trajectory page
    def traj(self, split: str | None, step: int, index: int, reader: Reader | None = None) -> dict:
        r = reader or self.reader(split)
        f = data.fields_of(r, step, lists=True)
        ids = f.ids or (f.tokens[0] if f.tokens else None)
        lone = None if f.pair else next((n for n in LONE_LOGPROBS if n in f.tokens), None)  # one alone still colours
        want = [w for w in dict.fromkeys([f.prompt, ids, f.mask, f.versions, *(f.pair or ()), lone]) if w]
        c = data.read(r, step, want, f.scalars, row=index)
        if c.n != 1:
            raise ConfigError(f"step {step} of split {r.split!r} has no trajectory {index}")
        lp_name = f.pair[0] if f.pair else lone
        cols = {k: c.row(k, 0) for k in want}
        if f.prompt:  # number lists (SkyRL's GeneratorOutput): the prompt's tokens, then the response's
            cols[ids] = np.concatenate([cols.pop(f.prompt), cols[ids]])
        n_tok = int(c.counts[0]) if ids is None else len(cols[ids])
        tid = [int(x) for x in (cols[ids] if ids else np.arange(n_tok))]
        mask = (_last(cols[f.mask], n_tok, 0) != 0).astype(int) if f.mask else np.ones(n_tok, int)
        lp = _last(cols[lp_name], n_tok, np.nan) if lp_name else None
        other = _last(cols[f.pair[1]], n_tok, np.nan) if f.pair else None
        ver = _last(cols[f.versions], n_tok, -1) if f.versions else None
        first = {k: n_tok - len(v) for k, v in cols.items()}  # a field of the last tokens has none before
        kind = {k: np.asarray(v).dtype for k, v in cols.items()}  # its stored dtype (the fill may widen)
        texts = token_texts(self.tokenizer, tid) if self.tokenizer else [{"text": str(x)} for x in tid]
        toks = []
        for j in range(n_tok):
            t = {"id": tid[j], **texts[j], "mask": int(mask[j]),
                 "logprob": "" if lp is None or j < first[lp_name] else number(lp[j], kind[lp_name]),
                 "version": "" if ver is None or j < first[f.versions] else str(int(ver[j]))}
            if other is not None:
                t["other"] = "" if j < first[f.pair[1]] else number(other[j], kind[f.pair[1]])
            t["title"] = _title(t, f, lp_name)
            toks.append(t)
        scal = {k: _f32(v[0], k in c.f32) for k, v in c.scal.items()}
        return {"path": str(r.path), "split": r.split, "step": step, "index": index, "tokens": toks,
                "fields": {"ids": ids, "mask": f.mask, "versions": f.versions, "logprob": lp_name,
                           "other": f.pair[1] if f.pair else None}, "values": scal}

    # -- diff page
    def diff(self) -> dict:
        """The diff page: what is identical and what differs (steps, fields; ``summary``), the first
        divergence of every diverging field (``fields``), and both sides' tokens of the first one."""
        if self.other is None:
            raise ConfigError("the diff page needs two dumps: trajstore view PATH PATH2")
        rb = Reader(self.other, self.split)
        ra = self.reader(None)
        rep = diff(ra, rb, split=self.split)
        first, fields = rep.first_divergence, rep.fields()
        out = {"a": str(ra.path), "b": str(rb.path), "split": self.split, "first": first and _first(ra, rb, first),
               "summary": _summary(rep.entries, fields, ra.steps, rb.steps),
               "fields": [{"field": k, **_plain(v), "first": v["first"] and _first(ra, rb, {"field": k, **v["first"]}),
                           "differ_steps": format_ranges(runs(
                               [e.step for e in rep.entries if e.field == k and e.status not in OK]))}
                          for k, v in fields.items() if k != "*"]}
        if first and first.get("trajectory") is not None and first["step"] in ra.steps and first["step"] in rb.steps:
            for side, r in (("a", ra), ("b", rb)):
                t = self.traj(None, first["step"], first["trajectory"], r)
                out[f"tokens_{side}"], out[f"token_fields_{side}"] = t["tokens"], t["fields"]
        return out


def _first(ra: Reader, rb: Reader, first: dict) -> dict:
    """A first difference as JSON, its values ``a`` and ``b`` at the precision of their stored dtype
    (float32 as ``-0.61626863``, not ``-0.6162686347961426``)."""
    out = _plain(first)
    for side, r in (("a", ra), ("b", rb)):
        v = out.get(side)
        if isinstance(v, float) and first.get("step") in r.steps:
            spec = r.info(first["step"])["batch"]
            keys = spec.get("keys") if isinstance(spec, dict) and isinstance(spec.get("keys"), list) else []
            node = dict(keys).get(first.get("field"))
            if isinstance(node, dict) and str(node.get("dtype")) in ("float32", "float16", "bfloat16"):
                out[side] = number(v, np.float32)
    return out


def _plain(d: dict) -> dict:
    return {k: _plain(v) if isinstance(v, dict) else v if isinstance(v, list) else _f(v) for k, v in d.items()}


def _summary(entries: list, fields: dict, steps_a: list[int], steps_b: list[int]) -> dict:
    """Steps identical, within tolerance, differing and in one dump only (as ranges ``0-3, 7``), and
    the fields identical at every step compared and those that differ somewhere."""
    rank = lambda st: 0 if st == "identical" else 1 if st in OK else 2  # noqa: E731
    worst: dict[int, str] = {}
    for e in entries:
        if e.field != "*":
            worst[e.step] = max(worst.get(e.step, "identical"), e.status, key=rank)
    ranges = lambda xs: format_ranges(runs(sorted(xs)))  # noqa: E731
    both = sorted(set(steps_a) & set(steps_b))
    by = {k: [s for s in both if rank(worst.get(s, "identical")) == i]
          for i, k in enumerate(("identical", "close", "differ"))}
    return {"compared": len(both), **{f"{k}_steps": ranges(v) for k, v in by.items()},
            **{f"n_{k}": len(v) for k, v in by.items()},
            "only_a": ranges(set(steps_a) - set(steps_b)), "only_b": ranges(set(steps_b) - set(steps_a)),
            "identical_fields": [k for k, v in fields.items() if k != "*" and v["status"] == "identical"],
            "close_fields": [k for k, v in fields.items() if k != "*" and v["status"] == "close"],
            "differ_fields": [k for k, v in fields.items() if k != "*" and v["status"] not in OK]}


def _f32(v: Any, narrow: bool) -> Any:
    """``_f``, a float32 value as the float64 nearest its shortest float32 repr (JSON ``0.2``, not
    ``0.20000000298023224``; read back as float32 it is the stored value, bit for bit)."""
    if narrow and isinstance(v, float | np.floating) and math.isfinite(v):
        return float(number(v, np.float32))
    return _f(v)


def _title(t: dict, f: data.Fields, lp_name: str | None) -> str:
    """A token's tooltip: its id, text (or bytes) and each per-token value under its field's name."""
    out = [f"id={t['id']}", f"text={t['text']!r}"]
    if "part" in t:
        out.append(f"bytes={t['part']}")
    if "whole" in t:
        out.append(f"with the next {t['span'] - 1} token(s): {t['whole']!r}")
    if lp_name:
        out.append(f"{lp_name}={t['logprob']}")
    if "other" in t:
        out.append(f"{f.pair[1]}={t['other']}")
    out.append(f"{f.mask}={t['mask']}" if f.mask else "mask=1 (no mask field)")
    if f.versions:
        out.append(f"{f.versions}={t['version']}")
    return " ".join(out)


def dump_name(path: Any) -> str:
    return Path(str(path)).name or str(path)
