"""Where a sustained background write's worker time goes (``python -m benchmarks.write_stages``; issue 23).

The writer of ``benchmarks/writes.py``'s sustained row (the default workers, ``--steps`` steps appended and
flushed, then the same steps again, the second pass timed) with each stage of every job timed on its worker
thread: its wall time and the worker's own CPU time (``time.thread_time``; the threads a stage hands work to
are not counted). A stage whose wall time grows past its CPU time waits: for the GIL (an encode beside 15
others), for its turn (``fit`` and ``commit`` run in append order: ``turn waits``), or for memory. The last
lines: the worker-seconds the pass offered (workers x wall) against those spent in stages, and the process's CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import trajstore

from . import workload as W
from .writes import passes

STAGES = ("encode", "fit", "write", "commit")


class Timeline:
    """Wall and thread-CPU seconds of each stage call while ``on``, by stage name."""

    def __init__(self) -> None:
        self.on, self.calls = False, {}
        self._lock = threading.Lock()

    def wrap(self, name: str, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                if self.on:
                    with self._lock:
                        self.calls.setdefault(name, []).append((time.perf_counter() - t0, time.thread_time() - c0))
        return timed


def run(d: Path, batches: list[dict], steps: int, workers: int | None) -> dict[str, Any]:
    """One writer, ``steps`` steps appended and flushed twice; the second pass timed stage by stage."""
    w = trajstore.Writer(d, workers=workers, max_pending_steps=max(8, steps), max_pending_bytes=1 << 40)
    tl = Timeline()
    for name in STAGES:  # the writer's own stage functions, wrapped on its instances
        setattr(w._steps, name, tl.wrap(name, getattr(w._steps, name)))
    for turns in (w._workers._fits, w._workers._commits):
        turns.wait = tl.wrap("turn waits", turns.wait)
    try:
        for s in range(steps):
            w.append(s, batches[s % len(batches)])
        w.flush()
        tl.on = True
        c0, t0 = os.times(), time.perf_counter()
        for s in range(steps, 2 * steps):
            w.append(s, batches[s % len(batches)])
        w.flush()
        wall, c1 = time.perf_counter() - t0, os.times()
        tl.on = False
        n = w.workers
    finally:
        w.close()
    return {"wall": wall, "workers": n, "user": c1.user - c0.user, "sys": c1.system - c0.system, "calls": tl.calls}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.write_stages", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--workers", type=int, default=None, help="background workers (default: the writer's)")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps a pass (default: the sustained row's, max(32, 8 x workers): writes.passes)")
    a = ap.parse_args(argv)
    batches = [W.padded_batch(B=a.batch, max_len=a.max_len, seed=i) for i in range(3)]
    raw = W.raw_bytes(batches[0])
    with tempfile.TemporaryDirectory(prefix="trajstore-write-stages-") as tmp:
        probe = trajstore.Writer(Path(tmp) / "probe")
        workers = a.workers or probe.workers
        probe.close()
        steps = a.steps or passes(32, workers)
        r = run(Path(tmp) / "dump", batches, steps, workers)
    print(f"# {os.cpu_count()} cores, {r['workers']} workers, {steps} steps a pass: sustained "
          f"{steps * raw / r['wall'] / 1e9:.3f} GB/s of raw tensor bytes, the pass {r['wall']:.2f} s")
    print(f"{'stage':12s} {'calls':>6s} {'wall, median':>13s} {'CPU, median':>12s} {'wall, sum':>10s} {'CPU, sum':>9s}")
    spent = 0.0
    for name in (*STAGES, "turn waits"):
        calls = r["calls"].get(name, [])
        if not calls:
            continue
        walls, cpus = [c[0] for c in calls], [c[1] for c in calls]
        spent += sum(walls)
        print(f"{name:12s} {len(calls):6d} {statistics.median(walls) * 1e3:10.1f} ms {statistics.median(cpus) * 1e3:9.1f} ms"
              f" {sum(walls):8.2f} s {sum(cpus):7.2f} s")
    print(f"worker-seconds offered {r['workers'] * r['wall']:.2f}, in stages and turn waits {spent:.2f}; "
          f"process CPU user {r['user']:.2f} s, system {r['sys']:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
