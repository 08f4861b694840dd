"""Many ranks, one logical dump: aggregate write and replay throughput, and replay on another layout.

Run under torchrun, one process per GPU (NCCL is not needed: ranks only meet at barriers, over gloo; ranks
beyond the host's GPUs share them, rank ``i`` on GPU ``i % count``, so a one-GPU host runs the phases too, its
cores and its one GPU shared by the ranks)::

    torchrun --standalone --nproc-per-node=4 -m benchmarks.ranks write  --dump /tmp/d
    torchrun --standalone --nproc-per-node=2 -m benchmarks.ranks replay --dump /tmp/d --dumped 4
    torchrun --standalone --nproc-per-node=1 -m benchmarks.ranks replay --dump /tmp/d --dumped 4

(``python -m benchmarks.ranks_suite`` launches every phase of issue 23's many-rank rows so, in rounds, and tabulates
them.)

``write``: each rank makes its shard of every step on its GPU (benchmarks/workload.py, padded to
``--max-len`` so every shard has one width, as a batch chunked before dispatch has), then the timed
part: ``Writer(rank=, world_size=).append`` of every step and ``close`` (everything committed), from a
barrier to a barrier. ``replay``: ``Reader(rank=, world_size=).iter(device=cuda)`` over every step,
one warm pass, then ``--passes`` timed passes (the median reported), barrier to barrier; afterwards each rank checks every slice it
got against the slice of the logical batch rebuilt from the generator (the dumped shards joined in
rank order; the rows ``format.shard.shards.partition`` gives the rank: equal contiguous chunks, or with
``--balance tokens`` token-balanced ones) and prints ``bit-exact`` or the first difference.
Throughput is unpadded tensor bytes of all ranks together per second (GB/s), rank 0 prints one
JSON line. ``replay`` also prints the decoder's ceiling (``pq.read_table`` of every file of the steps by
one process with all the host's cores, Arrow's pool set to them for that) and the largest share, over
the ranks, of the Arrow bytes a whole-step read decodes that one rank decodes for its slices; both
phases print each rank's thread budget (README, Threads). Launch with plain ``torchrun``: no thread
variables (torchrun sets ``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

import trajstore
from trajstore.device import decode_pool, pinned
from trajstore.format.file import parquet
from trajstore.format.shard.shards import partition
from trajstore.write import snapshot

from . import workload as W


def shard(step: int, rank: int, B: int, max_len: int, scale: float = 1.0) -> dict:
    """Rank ``rank``'s part of ``step``: a padded batch of its own, widened on the right to ``max_len``
    with each field's padding value, so the shards of one step share the padded width."""
    b = W.padded_batch(B=B, max_len=max_len, seed=10_000 * step + rank, scale=scale)
    T = b["input_ids"].shape[1]
    out = {}
    for k, v in b.items():
        if v.dim() == 2 and T < max_len:
            pad = W.PAD_ID if k == "input_ids" else 0
            v = torch.nn.functional.pad(v.to(torch.int64) if v.dtype == torch.bool else v, (0, max_len - T),
                                        value=pad).to(v.dtype)
        out[k] = v
    return out


def logical(step: int, dumped: int, B: int, max_len: int, scale: float = 1.0) -> dict:
    parts = [shard(step, r, B, max_len, scale) for r in range(dumped)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _all(x: float, op=dist.ReduceOp.SUM) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t.item())


def write(a, rank: int, world: int, dev: torch.device) -> dict:
    batches = {s: {k: v.to(dev) for k, v in shard(s, rank, a.batch, a.max_len, a.scale).items()} for s in range(a.steps)}
    raw = sum(W.raw_bytes(b) for b in batches.values())
    snapshot.UNPAD = not a.whole_copy
    _sync(dev)
    dist.barrier()
    t0 = time.perf_counter()
    with trajstore.Writer(a.dump, rank=rank, world_size=world) as w:
        for s, b in batches.items():
            w.append(s, b)
    dist.barrier()
    t = time.perf_counter() - t0
    return {"phase": "write", "ranks": world, "steps": a.steps, "GB": _all(raw) / 1e9,
            "seconds": t, "GB/s": _all(raw) / t / 1e9, "threads per rank": w.stats["threads"],
            "workers per rank": w.stats["workers"], "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "unpadded on the GPU": snapshot.UNPAD, "pinned buffers registered": pinned.registration()}


def replay(a, rank: int, world: int, dev: torch.device) -> dict:
    r = trajstore.Reader(a.dump, rank=rank, world_size=world, balance=a.balance)
    steps = r.steps
    for _ in r.iter(steps=steps, device=dev, prefetch=2, layout=a.layout):  # warm the pinned staging pool
        pass
    _sync(dev)
    if dev.type == "cuda":  # a long run's replay: the pinned decode's build, started by the first replay, done
        decode_pool.wait(300)
    dist.barrier()
    times = []
    for _ in range(a.passes):  # each timed pass barrier to barrier; the median is reported
        t0 = time.perf_counter()
        for _ in r.iter(steps=steps, device=dev, prefetch=2, layout=a.layout):
            pass
        _sync(dev)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    t = sorted(times)[len(times) // 2]
    # the decoder's ceiling on the same host, same run: pq.read_table alone of every file of the steps,
    # by one process with all the host's cores (Arrow's pool set to them, then set back)
    t_pq = _ceiling(r, steps, rank)
    frac = _decoded_fraction(a, r, steps, rank)
    bad, raw = [], 0
    for s in steps:  # not timed: every slice against the logical batch rebuilt from the generator
        whole = logical(s, a.dumped, a.batch, a.max_len, a.scale)
        B = next(iter(whole.values())).shape[0]
        rows = torch.tensor(partition(B, world, a.balance, whole["attention_mask"].sum(1).numpy())[rank])
        got = r[s]  # as dumped (padded); the packed layout is the same trajectories, timed above
        raw += W.raw_bytes({k: v[rows] for k, v in whole.items()})
        for k, v in whole.items():
            want = v[rows]
            g = got[k].cpu()
            if g.dtype != want.dtype or g.shape != want.shape or not torch.equal(g, want):
                bad.append(f"step {s} field {k}: {tuple(g.shape)} {g.dtype} vs {tuple(want.shape)} {want.dtype}")
    exact = _all(float(len(bad))) == 0
    if bad:
        print(f"rank {rank}: {bad[0]}", file=sys.stderr, flush=True)
    return {"phase": "replay", "ranks": world, "dumped_ranks": a.dumped, "steps": len(steps),
            "layout": a.layout, "balance": a.balance, "GB": _all(raw) / 1e9, "seconds": t, "GB/s": _all(raw) / t / 1e9,
            "GB/s of each pass": [round(_all(raw) / x / 1e9, 3) for x in times],
            "read_table GB/s (all cores, 1 process)": _all(raw) / t_pq / 1e9,
            "decoded fraction (max over ranks)": frac, "threads per rank": r.threads,
            "Arrow decoding into pinned memory": decode_pool.status(), "pinned buffers registered": pinned.registration(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "bit-exact": exact}


def _ceiling(r, steps: list[int], rank: int) -> float:
    """Seconds rank 0 takes to ``pq.read_table`` every file of ``steps`` with all the cores, the others waiting."""
    t = 0.0
    dist.barrier()
    if rank == 0:
        old = pa.cpu_count()
        pa.set_cpu_count(len(os.sched_getaffinity(0)))
        try:
            files = [f for s in steps for f in r.files(s)]
            for f in files:  # warm
                pq.read_table(f)
            t0 = time.perf_counter()
            for f in files:
                pq.read_table(f)
            t = time.perf_counter() - t0
        finally:
            pa.set_cpu_count(old)
    dist.barrier()
    return _all(t)


def _decoded_fraction(a, r, steps: list[int], rank: int) -> float:
    """The largest share, over the ranks, of the Arrow bytes a read of every whole step decodes that one
    rank decodes for its slices (not timed: counted on the tables pyarrow returns)."""
    got: list[int] = []
    real = {n: getattr(pq.ParquetFile, n) for n in ("read_row_group", "read_row_groups", "read")}
    real_scan = parquet._scan  # a large read: Arrow's dataset reader

    def count(fn):
        return lambda *x, **k: (lambda t: (got.append(t.nbytes), t)[1])(fn(*x, **k))

    for n, fn in real.items():
        setattr(pq.ParquetFile, n, count(fn))
    parquet._scan = count(real_scan)
    try:
        for s in steps:
            r.read(s)
        mine, got[:] = sum(got), []
        if rank == 0:
            whole = trajstore.Reader(a.dump)
            for s in steps:
                whole.read(s)
        total = _all(float(sum(got)))
    finally:
        for n, fn in real.items():
            setattr(pq.ParquetFile, n, fn)
        parquet._scan = real_scan
    return _all(mine / total if total else 0.0, dist.ReduceOp.MAX)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="torchrun ... -m benchmarks.ranks", description=__doc__.split("\n\n")[0])
    ap.add_argument("phase", choices=["write", "replay"])
    ap.add_argument("--dump", required=True)
    ap.add_argument("--dumped", type=int, default=None, help="replay: the world size the dump was written with")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256, help="trajectories per rank and step (write)")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--scale", type=float, default=1.0, help="sequence lengths, as in benchmarks/workload.py")
    ap.add_argument("--layout", choices=["padded", "packed"], default=None,
                    help="replay: Reader.iter's layout (default: as dumped, padded; packed is timed only)")
    ap.add_argument("--cpu", action="store_true", help="no GPU: batches and replay on the CPU (a smoke test)")
    ap.add_argument("--passes", type=int, default=3, help="replay: timed passes (the median is reported)")
    ap.add_argument("--balance", choices=["contiguous", "tokens"], default="contiguous",
                    help="replay: how the ranks share each step's rows (Reader's balance=); each slice is checked "
                         "against the rows trajstore's partition gives the rank")
    ap.add_argument("--whole-copy", action="store_true", help="write: copy the padded CUDA tensors whole to the "
                    "host (the path before they were unpadded on the GPU, trajstore/device/unpad.py), to compare")
    a = ap.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    if a.cpu:
        dev = torch.device("cpu")
    else:
        dev = torch.device("cuda", local % torch.cuda.device_count())  # more ranks than GPUs: they share them
        torch.cuda.set_device(dev)
    if a.phase == "replay" and a.dumped is None:
        ap.error("replay needs --dumped (the world size the dump was written with)")
    out = write(a, rank, world, dev) if a.phase == "write" else replay(a, rank, world, dev)
    if rank == 0:
        out["gpu"] = None if a.cpu else torch.cuda.get_device_name(dev)
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0 if out.get("bit-exact", True) else 1


if __name__ == "__main__":
    sys.exit(main())
