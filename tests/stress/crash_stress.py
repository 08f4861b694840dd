"""Crash-safety stress: SIGKILL a writing process at random moments, then check the dump.

    python tests/stress/crash_stress.py --trials 200 [--seed 1] [--dir /tmp/x]

Every trial starts a writer in a fresh process (forked from a preloaded fork server) on the
same dump, appends steps (or overwrites earlier ones), and kills it with SIGKILL: in half the
trials after a random delay from the writer's creation, in the other half at a random os-level call (fsync, link, replace,
write, unlink, open; just before or just after it), which lands kills inside every commit window.  After each kill it checks that
  * every visible step reads back (checksum verified) exactly as one version that was appended;
  * leftovers of the interrupted step (temporary files) are invisible to readers;
  * reopening the dump for writing removes every leftover and leaves a checksum for every step.
Exit status 0 when all trials pass; prints the figures reported in docs/RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import trajstore
from trajstore.store import checksums, paths
from trajstore.testing import assert_batch_equal


def batch_for(step: int, version: int):
    """A deterministic batch (padded dict, or a list of trajectories) for ``step`` / ``version``."""
    g = torch.Generator().manual_seed(step * 1000 + version)
    B = 4 + (step + version) % 5
    T = 32 + 16 * ((step * 7 + version) % 4)
    if (step + version) % 3 == 2:
        return [None if i == 1 else {"input_ids": torch.randint(0, 50000, (T - i,), generator=g),
                                     "logprobs": torch.randn(T - i, generator=g),
                                     "uid": f"s{step}v{version}r{i}"} for i in range(B)]
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return {
        "input_ids": torch.randint(0, 150000, (B, T), generator=g).masked_fill(~mask, 0),
        "attention_mask": mask,
        "logprobs": torch.randn(B, T, generator=g).masked_fill(~mask, 0.0).to(torch.bfloat16),
        "rewards": torch.randn(B, generator=g),
        "uid": [f"s{step}v{version}r{i}" for i in range(B)],
        "version": version,
    }


_HOOKED = ("fsync", "link", "replace", "write", "unlink", "open")


def _kill_at(k: int, after: bool) -> None:
    """SIGKILL this process at the k-th call of an os function the commit uses (before or after it)."""
    count = [0]

    def wrap(fn):
        def hooked(*a, **kw):
            count[0] += 1
            if count[0] == k and not after:
                os.kill(os.getpid(), signal.SIGKILL)
            r = fn(*a, **kw)
            if count[0] == k and after:
                os.kill(os.getpid(), signal.SIGKILL)
            return r
        return hooked

    for name in _HOOKED:
        setattr(os, name, wrap(getattr(os, name)))


def _child(path: str, steps: list[int], version: int, overwrite: bool, kill_at=None, ready=None) -> None:
    if kill_at is not None:
        _kill_at(*kill_at)
    w = trajstore.Writer(path, overwrite=overwrite)
    if ready is not None:  # a timed kill counts from here: the process's start-up is not what is tested
        ready.set()
    for s in steps:
        w.append(s, batch_for(s, version), meta={"version": version})
    w.close()


def _leftovers(split_dir: Path) -> list[str]:
    """Temporaries in the split folder and its side folder (``_trajstore/<split>/``)."""
    return sorted(n for d in paths.places(split_dir) if d.is_dir() for n in os.listdir(d) if n.startswith("."))


def check_dump(path: Path, attempted: dict[int, set[int]], focus: list[int] | None = None,
               sample: int = 0, rng: random.Random | None = None) -> dict:
    """Check the dump after a kill; returns counters. Raises AssertionError on any violation.

    Every visible step is listed and checksum-verified; ``focus`` (the steps the killed writer
    touched) plus ``sample`` random others are also decoded and compared (None: decode all)."""
    d = path / "train"
    left = _leftovers(d) if d.exists() else []
    stats = {"leftovers": len(left), "pending_sums": sum(".sha256.tmp-" in n for n in left), "steps": 0}
    if not (path / paths.MANIFEST).exists():
        return stats  # killed before the dump existed
    if not d.exists():
        return stats
    r = trajstore.Reader(path, verify=True)
    assert not any(n.startswith(".") for n in map(str, r.steps)), r.steps
    steps = r.steps
    if focus is not None:
        others = [s for s in steps if s not in set(focus)]
        steps = [s for s in steps if s in set(focus)] + (rng or random).sample(others, min(sample, len(others)))
    for s in r.steps:
        assert s in attempted, f"step {s} visible but never appended"
    for s in steps:
        got = r.read(s)
        v = r.meta(s)["version"]
        assert v in attempted[s], f"step {s}: version {v} never appended"
        assert_batch_equal(got, batch_for(s, v), f"step {s}")
        stats["steps"] += 1
    rep = trajstore.verify(path)
    assert rep.ok, rep.summary()
    # reopen for writing: leftovers go, every step keeps a matching checksum
    trajstore.Writer(path).close()
    assert _leftovers(d) == [], _leftovers(d)
    for s in r.steps:
        f = d / paths.step_name(s)
        assert checksums.read_sum(checksums.sum_path(f)) == checksums.file_sha256(f), f"step {s} checksum"
    assert all(paths.STEP_RE.match(n) for n in os.listdir(d)), os.listdir(d)  # the split folder: steps only
    side = paths.side_dir(d)  # made with the first temporary: a writer killed before that has none
    for n in os.listdir(side) if side.is_dir() else []:
        if n.endswith(checksums.SUM_SUFFIX):
            assert (d / n).with_suffix(".parquet").exists(), f"orphan checksum {n}"
    return stats


def run(trials: int, seed: int = 0, workdir: str | None = None, max_delay: float = 0.45,
        log=print) -> dict:
    rng = random.Random(seed)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "pyarrow.parquet", "trajstore", "trajstore.write.writer", "trajstore.read.reader"])  # the package root loads lazily
    own = workdir is None
    root = Path(workdir or tempfile.mkdtemp(prefix="trajstore-crash-"))
    path = root / "dump"
    attempted: dict[int, set[int]] = {}
    nxt = 0
    totals = {"trials": 0, "killed": 0, "killed_in_commit": 0, "finished_before_kill": 0, "with_leftovers": 0,
              "pending_sums": 0, "steps_checked": 0, "failures": 0}
    try:
        for t in range(trials):
            overwrite = bool(attempted) and rng.random() < 0.3
            version = t + 1
            if overwrite:
                steps = rng.sample(sorted(attempted), min(len(attempted), rng.randint(1, 6)))
            else:
                steps = list(range(nxt, nxt + 12))
                nxt += 12
            for s in steps:
                attempted.setdefault(s, set()).add(version)
            # half the trials: a kill at a random time; half: at a random os call of a commit
            kill_at = (rng.randint(1, 12 * len(steps)), rng.random() < 0.5) if rng.random() < 0.5 else None
            ready = ctx.Event() if kill_at is None else None
            p = ctx.Process(target=_child, args=(str(path), steps, version, overwrite, kill_at, ready), daemon=True)
            p.start()
            if kill_at is None:
                # the delay runs from the writer's creation (a kill at the k-th os call covers the
                # start-up), so a slow machine's start-up does not eat every timed trial's window
                ready.wait(timeout=60)
                time.sleep(rng.uniform(0, max_delay))
                if p.exitcode is None:
                    os.kill(p.pid, signal.SIGKILL)
            p.join()
            if p.exitcode not in (0, -signal.SIGKILL):
                raise AssertionError(f"trial {t}: the writer failed by itself (exit {p.exitcode})")
            totals["killed"] += p.exitcode == -signal.SIGKILL
            totals["killed_in_commit"] += p.exitcode == -signal.SIGKILL and kill_at is not None
            totals["finished_before_kill"] += p.exitcode == 0
            try:
                st = check_dump(path, attempted, focus=steps, sample=8, rng=rng)
            except AssertionError as e:
                totals["failures"] += 1
                log(f"trial {t}: FAILED: {e}")
                keep = root / f"failed-{t}"
                shutil.copytree(path, keep, dirs_exist_ok=True)
                log(f"  dump kept at {keep}")
                continue
            totals["trials"] += 1
            totals["with_leftovers"] += st["leftovers"] > 0
            totals["pending_sums"] += st["pending_sums"] > 0
            totals["steps_checked"] += st["steps"]
        if totals["trials"]:
            totals["final_full_check_steps"] = check_dump(path, attempted)["steps"]  # every step, decoded
    finally:
        if own and totals["failures"] == 0:
            shutil.rmtree(root, ignore_errors=True)
    return totals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="work directory (kept); default: a temporary one")
    ap.add_argument("--max-delay", type=float, default=0.45, help="longest wait before the kill, seconds")
    a = ap.parse_args(argv)
    t0 = time.time()
    tot = run(a.trials, a.seed, a.dir, a.max_delay)
    tot["seconds"] = round(time.time() - t0, 1)
    print(" ".join(f"{k}={v}" for k, v in tot.items()))
    return 1 if tot["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
