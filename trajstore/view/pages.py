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
from ..inspection.diff import diff
from ..inspection.traces import decode_ids, load_tokenizer
from ..reader import Reader
from . import data

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
            row = {"index": i, "reward": _f(t["reward"][i]), "length": _f(t["length"][i]),
                   "version": _f(t["version"][i]) if "version" in t else None}
            for k, s in extra.items():
                row[k] = _f(c.scal[s][i])
            rows.append(row)
        return {"path": str(self.path), "split": r.split, "step": step, "columns": cols, "rows": rows,
                "fields": {"reward": f.reward, "mask": f.mask, "versions": f.versions}}

    # -- trajectory page
    def traj(self, split: str | None, step: int, index: int, reader: Reader | None = None) -> dict:
        r = reader or self.reader(split)
        f = data.fields_of(r, step)
        ids = f.ids or (f.tokens[0] if f.tokens else None)
        lone = None if f.pair else next((n for n in LONE_LOGPROBS if n in f.tokens), None)  # one alone still colours
        want = [w for w in dict.fromkeys([ids, f.mask, f.versions, *(f.pair or ()), lone]) if w]
        c = data.read(r, step, want, f.scalars, row=index)
        if c.n != 1:
            raise ConfigError(f"step {step} of split {r.split!r} has no trajectory {index}")
        lp_name = f.pair[0] if f.pair else lone
        cols = {k: c.row(k, 0) for k in want}
        n_tok = int(c.counts[0]) if ids is None else len(cols[ids])
        tid = cols[ids] if ids else np.arange(n_tok)
        mask = (_last(cols[f.mask], n_tok, 0) != 0).astype(int) if f.mask else np.ones(n_tok, int)
        lp = _last(cols[lp_name], n_tok, np.nan) if lp_name else None
        other = _last(cols[f.pair[1]], n_tok, np.nan) if f.pair else None
        ver = _last(cols[f.versions], n_tok, -1) if f.versions else None
        first = {k: n_tok - len(v) for k, v in cols.items()}  # a field of the last tokens has none before
        text = [decode_ids(self.tokenizer, [int(x)]) for x in tid] if self.tokenizer else [str(int(x)) for x in tid]
        toks = []
        for j in range(n_tok):
            lps = "" if lp is None or j < first[lp_name] else repr(float(lp[j]))
            vs = "" if ver is None or j < first[f.versions] else str(int(ver[j]))
            title = f"id={int(tid[j])} text={text[j]!r} logprob={lps} mask={int(mask[j])} version={vs}"
            t = {"id": int(tid[j]), "text": text[j], "logprob": lps, "mask": int(mask[j]), "version": vs}
            if other is not None:
                t["other"] = "" if j < first[f.pair[1]] else repr(float(other[j]))
                title += f" other={t['other']}"
            t["title"] = title
            toks.append(t)
        scal = {k: _f(v[0]) for k, v in c.scal.items()}
        return {"path": str(r.path), "split": r.split, "step": step, "index": index, "tokens": toks,
                "fields": {"ids": ids, "mask": f.mask, "versions": f.versions, "logprob": lp_name,
                           "other": f.pair[1] if f.pair else None}, "values": scal}

    # -- diff page
    def diff(self) -> dict:
        if self.other is None:
            raise ConfigError("the diff page needs two dumps: trajstore view PATH PATH2")
        rb = Reader(self.other, self.split)
        ra = self.reader(None)
        rep = diff(ra, rb, split=self.split, first=True)  # only the first divergence is shown
        first = rep.first_divergence
        out = {"a": str(ra.path), "b": str(rb.path), "split": self.split, "first": first and
               {k: _f(v) if not isinstance(v, list | dict) else v for k, v in first.items()}}
        if first and first.get("trajectory") is not None and first["step"] in ra.steps and first["step"] in rb.steps:
            out["tokens_a"] = self.traj(None, first["step"], first["trajectory"], ra)["tokens"]
            out["tokens_b"] = self.traj(None, first["step"], first["trajectory"], rb)["tokens"]
        return out


def dump_name(path: Any) -> str:
    return Path(str(path)).name or str(path)
