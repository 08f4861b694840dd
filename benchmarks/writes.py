"""The writer's figures (``python -m benchmarks``): ``append`` blocking time with the safe default
(``copy=True``: the batch copied into reused host buffers) and with the ``copy=False`` opt-in, and the
background write throughput with 1 worker, the default number of workers and one per core, in the
same run on the same steps (issue 16)."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import trajstore


def _fsize(p: Path) -> int:
    return p.stat().st_size


def append_loop(d: Path, batches: list[dict], n: int, warm: bool = False,
                **kw: Any) -> tuple[list[float], float, dict, list[float]]:
    """Append ``n`` steps (the batches in turn) and flush: (append seconds per step, wall seconds
    from the first append to the end of the flush, the writer's stats, and with ``warm`` the append
    seconds of ``n`` steps appended and flushed before, while the writer's pool of host buffers filled)."""
    w = trajstore.Writer(d, **kw)
    cold: list[float] = []
    first = 0
    if warm:  # the first steps allocate the buffers later steps reuse (an RL loop's steady state)
        for s in range(n):
            a0 = time.perf_counter()
            w.append(s, batches[s % len(batches)])
            cold.append(time.perf_counter() - a0)
        w.flush()
        first = n
    blocks = []
    t0 = time.perf_counter()
    for s in range(first, first + n):
        a0 = time.perf_counter()
        w.append(s, batches[s % len(batches)])
        blocks.append(time.perf_counter() - a0)
    w.flush()
    wall = time.perf_counter() - t0
    st = w.stats
    w.close()
    return blocks, wall, st, cold


def writer_figures(rep: Any, tmp: Path, batches: list[dict], raw: int, n: int, b: dict) -> Path:
    """Append blocking, per-step background time and bytes on disk; then ``throughput``. Returns the dump."""
    d = tmp / "dump"
    blocks, wall, st, cold = append_loop(d, batches, n, warm=True)
    nocopy = append_loop(tmp / "dump_nocopy", batches, min(n, 4), copy=False)[0]
    blk, save = statistics.median(blocks), b["save_padded"]
    rep.add("append blocking time, safe default copy=True (median, buffers reused)", blk * 1e3, "ms",
            save * 1e3, "padded torch.save", "<= 0.05x (issue 16)", blk / save <= 0.05)
    rep.add("append blocking time, copy=True, max", max(blocks) * 1e3, "ms", save * 1e3, "padded torch.save")
    rep.add(f"append blocking time, copy=True, first {n} steps (median, buffers allocated)",
            statistics.median(cold) * 1e3, "ms", save * 1e3, "padded torch.save")
    rep.add("append(copy=False) blocking time (median), opt-in", statistics.median(nocopy) * 1e3, "ms",
            save * 1e3, "padded torch.save")
    rep.add("background time per step (encode+write+commit, default workers)", st["write_s"] / st["written"] * 1e3,
            "ms", save * 1e3, "padded torch.save")
    rep.add(f"append {n} steps + flush, raw bytes", n * raw / wall / 1e9, "GB/s")
    size = statistics.mean(_fsize(d / "train" / f"step_{s:08d}.parquet") for s in range(2 * n))
    rep.add("bytes on disk / raw unpadded bytes", size / raw, "x", None, "", "<= 0.30 (issue 2)", size / raw <= 0.30)
    rep.add("bytes on disk", size / 1e6, "MB", b["bytes_padded"] / 1e6, "padded torch.save")
    rep.add("bytes on disk ", size / 1e6, "MB", b["bytes_pickle"] / 1e6, "padded pickle")
    rep.add("bytes on disk  ", size / 1e6, "MB", b["bytes_flat"] / 1e6, "flat torch.save")
    rep.add("bytes on disk   ", size / 1e6, "MB", b["bytes_st"] / 1e6, "flat safetensors")
    throughput(rep, tmp, batches, raw, n)
    return d


def throughput(rep: Any, tmp: Path, batches: list[dict], raw: int, n: int) -> None:
    """Steps per second through the background writer (append + flush of ``max(n, 2 x cores)`` steps,
    enough pending steps for every worker), with 1 worker (the writer before issue 16), the default
    and one worker per core."""
    cores = os.cpu_count() or 1
    with trajstore.Writer(tmp / "probe") as w:
        default = w.workers
    steps = max(n, 2 * cores)
    one = None
    for i, (label, workers) in enumerate((("1 worker", 1), (f"default, {default} workers", default),
                                          (f"all cores, {cores} workers", cores))):
        wall = append_loop(tmp / f"tp{i}", batches, steps, workers=workers,
                                 max_pending_steps=max(8, 2 * workers), max_pending_bytes=1 << 40)[1]
        rate = steps / wall
        one = one or rate
        ok = rate / one >= 3 if workers > 1 and cores >= 16 else None
        rep.add(f"background write throughput, {label}", rate, "steps/s", one if workers > 1 else None,
                "1 worker", ">= 3x 1 worker on 16 cores (issue 16)" if workers > 1 else "", ok)
        rep.add(f"background write throughput, {label}, raw bytes", rate * raw / 1e9, "GB/s")
    sustained(rep, tmp, batches, raw, steps, default)


def sustained(rep: Any, tmp: Path, batches: list[dict], raw: int, steps: int, workers: int) -> float:
    """The default writer's sustained rate: ``passes(steps, workers)`` steps appended and flushed twice by one
    writer, the second pass timed (an RL run's writer after its first steps: its host buffers already allocated
    and written once). The rows above time a new writer's first steps, whose ``append`` copies write every
    staging buffer for the first time (page faults). The main row's pass holds ``PER_WORKER`` steps for each
    worker: a worker takes a step's whole encode and write (about 0.65 s on the 16-core GPU host), so in a pass
    of two steps a worker the workers wait for a step about a sixth of their time, at the pass's start and end,
    and it measured 4-12% below passes of four to eight a worker (benchmarks/RESULTS.md, sixteenth round); that
    pass (``steps``) stays an extra line. Returns the main row's GB/s."""
    cores = os.cpu_count() or 1
    n = passes(steps, workers)
    rates = {}
    for k in sorted({steps, n}):
        wall = append_loop(tmp / f"tp_sustained{k}", batches, k, warm=True, workers=workers,
                           max_pending_steps=max(8, 2 * workers), max_pending_bytes=1 << 40)[1]
        rates[k] = k * raw / wall / 1e9
    gbs = rates[n]
    rep.add(f"background write throughput, default, {workers} workers, sustained (second pass of {n} steps), raw "
            "bytes", gbs, "GB/s", None, "", ">= 1 GB/s on 16 cores (issue 23)" if cores >= 16 else "",
            gbs >= 1 if cores >= 16 else None)
    if steps != n:
        rep.add(f"  the same, a pass of {steps} steps ({steps / workers:.3g} a worker; the row before the sixteenth "
                "round)", rates[steps], "GB/s")
    return gbs


PER_WORKER = 8  # steps a worker takes in the sustained pass


def passes(steps: int, workers: int) -> int:
    """The sustained pass's steps: ``PER_WORKER`` a worker, at least ``steps``."""
    return max(steps, PER_WORKER * workers)
