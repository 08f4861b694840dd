"""Padded replay to CUDA against packed replay, same dump, same run (issue 16: padded >= 0.9x packed
at prefetch 2 and 8), and each against the decoder ceiling of the same files (``replay_cpu.ceiling``),
measured before each pair of passes: the median of the per-pass ratios (issue 23: >= 0.9x at prefetch 4
and 8), steadier than two figures measured apart on a host whose speed drifts between calls. An extra
line gives each ratio against the same ceiling verifying every page's CRC32 (``replay_cpu.ceiling(checks=True)``),
the integrity check each trajstore read makes and the ceiling does not (benchmarks/RESULTS.md, fifteenth round),
and at prefetch 4 and 8 the rate of the least replay that stages through pinned memory with as many steps at once
(``benchmarks/least.py``: the read, one host copy and one device copy a step, one after the other), against the
ceiling and against packed replay. Where the pinned decode can be had (``trajstore/device/decode_pool.py``,
a C++ compiler on the host; the default since the eighteenth round, built before any pass is timed), each pass also
times both layouts with ``TRAJSTORE_PINNED_DECODE=0``, the replay staging through the pinned arena (the default
before): extra lines against the same ceiling (benchmarks/RESULTS.md, seventeenth and eighteenth rounds).
``Reader.iter(device="cuda")`` of a padded step (as recorded: what the Recorder's replay returns)
stages the unpadded values and builds the padding on the GPU (trajstore/device/pad.py);
``layout="packed"`` stages the same values and builds nothing.

Without CUDA the GPU rows are skipped; the host side of both (decode + staging of one step, what
each prefetch thread does) is measured on any machine.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import trajstore
from trajstore.device import bridge as torch_bridge, decode_pool

from . import least as least_replay
from . import replay_cpu


def host_work(rep, d: Path, repeat: int) -> None:
    """Decode + stage of one step on this thread, as a prefetch worker does it for CUDA."""
    r = trajstore.Reader(d)
    pool = torch_bridge.PinnedPool()

    def one(layout: str | None) -> None:
        arena = torch_bridge.Arena(pool, defer=True)
        torch_bridge.stage(r._read(0, None, layout, arena), pool, arena).release()

    t = {None: [], "packed": []}
    for _ in range(repeat + 1):  # interleaved, the first pass warms the pool
        for layout in t:
            t0 = time.perf_counter()
            one(layout)
            t[layout].append(time.perf_counter() - t0)
    packed = statistics.median(t["packed"][1:])
    padded = statistics.median(t[None][1:])
    rep.add("replay host work per step (decode + stage), packed", packed * 1e3, "ms")
    rep.add("replay host work per step (decode + stage), padded for the GPU", padded * 1e3, "ms",
            packed * 1e3, "packed")


def run(rep, d: Path, raw: int, n: int, repeat: int, gpu: bool) -> None:
    host_work(rep, d, repeat)
    if not gpu:
        print("  replay to CUDA, padded vs packed: skipped (no CUDA device)", flush=True)
        return
    dev = torch.device("cuda")
    r = trajstore.Reader(d)
    steps = list(range(n)) * max(1, 48 // n)  # a pass: 48 steps (about 2 GB of raw tensors)

    def replay(prefetch: int, layout: str | None) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in r.iter(steps=steps, device=dev, prefetch=prefetch, layout=layout):
            pass
        torch.cuda.synchronize()
        return len(steps) * raw / (time.perf_counter() - t0) / 1e9

    files = [r.file(s) for s in steps]
    with pinned_decode(True):
        built = decode_pool.pinned() is not None  # (built here, before any pass is timed)
    for k in (2, 4, 8):
        for layout in ("packed", None):  # warm the pinned pools and the allocator
            replay(k, layout)
            if built:
                with pinned_decode(False):
                    replay(k, layout)
        rates: dict = {"packed": [], None: []}
        staged: dict = {"packed": [], None: []}  # the same staged through the pinned arena (=0)
        ceil: list[float] = []
        checked: list[float] = []  # the same ceiling verifying each page's CRC32, as trajstore's reads do
        least: list[float] = []  # the least replay staging through pinned memory, k steps at once (least.py)
        for _ in range(PASSES):  # interleaved: drift hits both alike, and the ceiling
            ceil.append(replay_cpu.ceiling_gbps(files, raw))  # the decoder ceiling of the same files
            checked.append(replay_cpu.ceiling_gbps(files, raw, checks=True))
            if k in (4, 8):
                least.append(least_replay.gbps(files, raw, k, dev))
            for layout in rates:
                rates[layout].append(replay(k, layout))
                if built:
                    with pinned_decode(False):
                        staged[layout].append(replay(k, layout))
        packed, padded = statistics.median(rates["packed"]), statistics.median(rates[None])
        pairs = sorted(a / b for a, b in zip(rates[None], rates["packed"]))
        target = k in (2, 8)
        print(f"  prefetch={k}: padded/packed of each pass {' '.join(f'{x:.2f}' for x in pairs)}", flush=True)
        rep.add(f"replay to CUDA, iter(prefetch={k}), padded as recorded (median of {PASSES} passes)", padded,
                "GB/s", packed, f"packed, prefetch={k}", ">= 0.9x packed (issue 16)" if target else "",
                padded / packed >= 0.9 if target else None)
        for name, layout in (("packed", "packed"), ("padded as recorded", None)):
            x = statistics.median(g / c for g, c in zip(rates[layout], ceil))
            rep.add(f"replay to CUDA, iter(prefetch={k}), {name} / decoder ceiling (median of {PASSES} pairs)", x, "x",
                    target=">= 0.9x (issue 23)" if k in (4, 8) else "", ok=x >= 0.9 if k in (4, 8) else None)
            y = statistics.median(g / c for g, c in zip(rates[layout], checked))
            rep.add(f"  prefetch={k}, {name} / the ceiling with page checksums verified, as trajstore's reads do",
                    y, "x")
            if staged[layout]:
                z = statistics.median(g / c for g, c in zip(staged[layout], ceil))
                rep.add(f"  prefetch={k}, {name}, staged through the pinned arena (TRAJSTORE_PINNED_DECODE=0) / "
                        "decoder ceiling", z, "x")
        if least:
            x = statistics.median(g / c for g, c in zip(least, ceil))
            rep.add(f"  prefetch={k}: the least replay staging through pinned memory, {k} steps at once "
                    "(benchmarks/least.py) / decoder ceiling", x, "x")
            x = statistics.median(g / c for g, c in zip(rates["packed"], least))
            rep.add(f"  prefetch={k}: packed replay / that least replay", x, "x")
        print(f"  prefetch={k}: decoder ceiling of each pass {' '.join(f'{c:.2f}' for c in ceil)} GB/s; with page "
              f"checksums verified {' '.join(f'{c:.2f}' for c in checked)}", flush=True)


PASSES = 7  # interleaved passes per layout and depth; single passes vary by +-10% on the GPU host


@contextmanager
def pinned_decode(on: bool):
    """``$TRAJSTORE_PINNED_DECODE`` set to ``on`` inside the block (``trajstore/device/decode_pool.py``), restored
    after."""
    old = os.environ.get(decode_pool.ENV)
    os.environ[decode_pool.ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(decode_pool.ENV, None)
        else:
            os.environ[decode_pool.ENV] = old
