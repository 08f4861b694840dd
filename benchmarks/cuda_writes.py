"""A padded CUDA batch dumped by ``Writer.append`` (issue 23: "a padded CUDA batch leaves the GPU unpadded"):
the tokens selected on the GPU and only they copied to pinned memory (``trajstore/device/unpad.py``, the
default) against the whole padded tensors copied (``write.snapshot.UNPAD = False``, the path before), same
steps, same run, interleaved. Figures: ``append``'s blocking time; how long the caller's stream is held
after ``append`` (its next kernel waits for the copy, or for the GPU selection pass); append + flush
throughput in raw (unpadded) tensor bytes; the writer's pinned memory after the run; and that both
paths wrote the same file bytes. Needs CUDA."""

from __future__ import annotations

import hashlib
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import trajstore
from trajstore.write import snapshot


def _digest(d: Path) -> str:
    h = hashlib.sha256()
    for p in sorted((d / "train").glob("step_*.parquet")):
        h.update(p.read_bytes())
    return h.hexdigest()


def _run(d: Path, batches: list[dict], n: int) -> dict[str, Any]:
    w = trajstore.Writer(d)
    warm = max(len(batches), n)
    for s in range(warm):  # warm: the pinned pool holds the buffers of a full backlog
        w.append(s, batches[s % len(batches)])
    w.flush()
    blocks, held = [], []
    t0 = time.perf_counter()
    for s in range(warm, warm + n):
        a0 = time.perf_counter()
        w.append(s, batches[s % len(batches)])
        a1 = time.perf_counter()
        torch.cuda.current_stream().synchronize()  # the caller's stream: free once the pass or copy is done
        blocks.append(a1 - a0)
        held.append(time.perf_counter() - a0)
    w.flush()
    wall = time.perf_counter() - t0
    pinned, st = w._pool.cached_bytes, w.stats
    w.close()
    return {"append": statistics.median(blocks), "held": statistics.median(held), "wall": wall, "pinned": pinned,
            "waited": st["wait_s"] / max(1, st["appended"])}


def run(rep: Any, tmp: Path, batches: list[dict], raw: int, n: int) -> None:
    if not torch.cuda.is_available():
        print("  padded CUDA batch dumped: skipped (no CUDA device)", flush=True)
        return
    cuda = [{k: v.cuda() for k, v in b.items()} for b in batches]
    padded = sum(v.numel() * v.element_size() for v in cuda[0].values())
    torch.cuda.synchronize()
    res: dict[bool, list[dict]] = {True: [], False: []}
    digests = {}
    try:
        for i in range(2):
            for on in (True, False):
                snapshot.UNPAD = on
                d = tmp / f"cuda_writes_{on}_{i}"
                res[on].append(_run(d, cuda, max(n, 16)))
                digests[on] = _digest(d)
    finally:
        snapshot.UNPAD = True
    best = {on: min(r, key=lambda x: x["wall"]) for on, r in res.items()}
    u, whole = best[True], best[False]
    rep.add("padded CUDA batch: append blocking time, unpadded on the GPU", u["append"] * 1e3, "ms",
            whole["append"] * 1e3, "whole tensors copied")
    rep.add("padded CUDA batch: of which waiting at the pending limit (mean)", u["waited"] * 1e3, "ms",
            whole["waited"] * 1e3, "whole tensors copied")
    rep.add("padded CUDA batch: caller's stream held after append", u["held"] * 1e3, "ms",
            whole["held"] * 1e3, "whole tensors copied")
    n = max(n, 16)
    rep.add("padded CUDA batch: append + flush, raw bytes", n * raw / u["wall"] / 1e9, "GB/s",
            n * raw / whole["wall"] / 1e9, "whole tensors copied")
    rep.add("padded CUDA batch: writer's pinned memory", u["pinned"] / 1e6, "MB", whole["pinned"] / 1e6,
            "whole tensors copied")
    rep.add("padded CUDA batch: padded / raw bytes of a step", padded / raw, "x")
    same = digests[True] == digests[False]
    rep.add("padded CUDA batch: step files byte-identical to the whole-tensor path", float(same), "bool",
            target="1 (issue 23)", ok=same)
