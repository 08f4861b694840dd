"""``python -m benchmarks.diff [--steps N] [--batch B] [--scale S] [--repeat R]``: ``trajstore diff`` against
reading the two dumps once (issue 16).

The dump: ``--steps`` (6) steps of benchmarks/workload.py's padded batch with ``--batch`` (4,096)
trajectories at length ``--scale`` (0.05: about 110 tokens each, many short trajectories, where
comparing trajectory by trajectory cost the most), plus ``logprobs`` = ``old_logprobs`` + noise on
the loss-mask tokens, written by the Writer (about 25 MB at the defaults). Three dumps: ``a``; ``copy``,
a byte copy of ``a`` (same recorded checksums); ``b``, written again from the same batches with one
``logprobs`` value changed in every step (so no step file is byte-identical and every value is compared).

Figures (median of ``--repeat`` of the wall time and of the CPU time, all threads counted, warm page
cache, in one process unless said): reading both dumps
once (``Reader.read`` of every step of ``a`` and ``b``); ``diff(a, b)``, ``diff(a, copy)``,
``diff(a, b, first=True)``, ``diff(a, pair=("logprobs", "old_logprobs"), mask="loss_mask")``; the
same ``diff(a, b)`` on the decode path (``inspection.diff.FAST = False``: every step decoded and
compared trajectory by trajectory, as before issue 16); and the ``trajstore diff a b`` command
(a fresh process, its start-up included).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import trajstore
from trajstore.inspection import diff as diff_mod

from . import workload as W


def write(path: Path, steps: int, B: int, scale: float, plant: bool) -> None:
    with trajstore.Writer(path) as w:
        for s in range(steps):
            b = W.padded_batch(B=B, seed=s, scale=scale)
            g = torch.Generator().manual_seed(s)
            noise = torch.randn(b["old_logprobs"].shape, generator=g) * 1e-3
            b["logprobs"] = b["old_logprobs"] + noise * b["loss_mask"]
            if plant:
                i = B // 2
                t = int(b["attention_mask"][i].sum()) - 1
                b["logprobs"][i, t] += 0.5
            w.append(s, b)


def med(fn, repeat: int) -> tuple[float, float]:
    """(median wall time, median CPU time of this process, every thread counted; for a command run in
    a child process, the child's CPU time)."""
    ws, cs = [], []
    for _ in range(repeat):
        c0, k0, t0 = time.process_time(), _child_cpu(), time.perf_counter()
        fn()
        ws.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0 + _child_cpu() - k0)
    return statistics.median(ws), statistics.median(cs)


def _child_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def read_all(*paths: Path) -> None:
    for p in paths:
        r = trajstore.Reader(p)
        for s in r.steps:
            r.read(s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--scale", type=float, default=0.05)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        a, copy, b = Path(d, "a"), Path(d, "copy"), Path(d, "b")
        write(a, args.steps, args.batch, args.scale, plant=False)
        shutil.copytree(a, copy)
        write(b, args.steps, args.batch, args.scale, plant=True)
        size = sum(f.stat().st_size for f in (a / "train").glob("*.parquet"))
        read_all(a, b, copy)  # warm the page cache
        base = med(lambda: read_all(a, b), args.repeat)
        rows = [("read both dumps once (Reader.read, every step)", base)]
        rep = trajstore.diff(a, b)
        assert not rep.ok and rep.first_divergence["field"] == "logprobs", rep.first_divergence
        rows.append(("diff(a, b): one value differs in every step", med(lambda: trajstore.diff(a, b), args.repeat)))
        assert trajstore.diff(a, copy).identical
        rows.append(("diff(a, copy): byte-identical step files", med(lambda: trajstore.diff(a, copy), args.repeat)))
        rows.append(("diff(a, b, first=True)", med(lambda: trajstore.diff(a, b, first=True), args.repeat)))
        rows.append(("diff(a, pair=(logprobs, old_logprobs), mask=loss_mask)",
                     med(lambda: trajstore.diff(a, pair=("logprobs", "old_logprobs"), mask="loss_mask"), args.repeat)))
        diff_mod.FAST = False
        rows.append(("diff(a, b) on the decode path (before issue 16)", med(lambda: trajstore.diff(a, b), 1)))
        rows.append(("diff(a, pair=...) on the decode path",
                     med(lambda: trajstore.diff(a, pair=("logprobs", "old_logprobs"), mask="loss_mask"), 1)))
        diff_mod.FAST = True
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent.parent),
                                                                         os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "trajstore.cli", "diff", str(a), str(b)]
        rows.append(("`trajstore diff a b` command (fresh process, start-up included)",
                     med(lambda: subprocess.run(cmd, env=env, capture_output=True, check=False), args.repeat)))
    print(f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}")
    print(f"dump: {args.steps} steps x {args.batch} trajectories, {size / 1e6:.1f} MB of step files per dump\n")
    print("| figure | wall | / read once | CPU | / read once |\n|---|---|---|---|---|")
    for name, (t, c) in rows:
        print(f"| {name} | {t:.3f} s | {t / base[0]:.2f}x | {c:.3f} s | {c / base[1]:.2f}x |")


if __name__ == "__main__":
    main()
