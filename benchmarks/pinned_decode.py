"""Replay with no host copy: Arrow decoding straight into pinned memory (``python -m benchmarks.pinned_decode``;
issue 23, seventeenth round in benchmarks/RESULTS.md).

Every replay to a GPU that trajstore or ``least.py`` does copies a step's decoded values once on the host, from
Arrow's pageable buffers into pinned memory, before the copy to the device. pyarrow takes no allocator from
Python, but its readers take a ``memory_pool``: ``trajstore/device/decode_pool.cc`` is one whose large buffers
are pinned (``cudaHostAlloc`` of the CUDA runtime torch loaded), kept for reuse, which ``decode_pool.py`` compiles
against the installed pyarrow's headers with the C++ compiler (``$CXX``, else ``c++``) and boxes as a
``pyarrow.MemoryPool``. This module times, over the same files in the same call:

* the decoder ceiling (``replay_cpu.ceiling``: ``read_table``, 8 steps at once, no copy);
* ``least.py``'s replay: ``k`` threads, each reading a step, copying it into pinned memory, one device copy;
* the same through a pool of cached plain memory (``staged cached``): what reusing Arrow's buffers alone gives;
* **pinned decode**: each step read into the pinned pool and each column chunk sent to the GPU from where Arrow
  decoded it (one device copy a chunk, no host copy);
* ``Reader.iter(prefetch=k, layout="packed")`` to the GPU, staging through pinned memory
  (``$TRAJSTORE_PINNED_DECODE=0``), then decoding into the pinned pool (``=1``: ``torch_bridge.Arena.send``).

Each row is a warm pass, then a timed one, of 24 steps (8 written, each read 3 times), ``--rounds`` times; the
ratio is to the round's ceiling. Without CUDA the pool is plain cached memory and nothing is sent (the CPU test
of this module)."""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import torch

from trajstore.device import decode_pool as D
from . import least, replay_cpu
from .padded import pinned_decode as switch
from . import workload as W

Pool, build, compiler, cuda_host_alloc = D.Pool, D.build, D.compiler, D.cuda_host_alloc


def _put(parts: list[tuple[str, np.ndarray]], device: Any) -> torch.Tensor:
    """Each chunk's values copied to ``device`` (a CUDA copy: not waited for) from where Arrow decoded them, one after
    the other in a new buffer there."""
    out = torch.empty(sum(len(b) for _, b in parts), dtype=torch.uint8, device=device)
    p = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Arrow's buffers are read-only; torch only reads them
        for _, b in parts:
            out[p:p + len(b)].copy_(torch.from_numpy(b), non_blocking=out.is_cuda)
            p += len(b)
    return out


def sent(f: Path, cols: list[str], pool: pa.MemoryPool | None, device: Any = None) -> np.ndarray:
    """The bytes one pinned-decode step puts on ``device`` (host memory without one): each chunk's values copied
    from where Arrow decoded them, in ``least.values`` order."""
    out = _put(least.values(least.read(f, cols, pool)), device)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    return out.cpu().numpy()


def pinned_decode(files: list[Path], k: int, pool: pa.MemoryPool, device: Any = None) -> Callable[[], None]:
    """A pass of the pinned-decode replay (see the module doc) over ``files`` on ``k`` threads."""
    cols = least.columns(files[0])
    local = threading.local()
    cuda = device is not None and torch.device(device).type == "cuda"

    def one(f: Path) -> None:
        parts = least.values(least.read(f, cols, pool))  # alive until its copies are done (synchronize below)
        s = getattr(local, "stream", None) or (torch.cuda.Stream(device) if cuda else None)
        local.stream = s
        with torch.cuda.stream(s):
            _put(parts, device if cuda else None)
        if s is not None:
            s.synchronize()

    return lambda: least.in_order(one, files, k)


def staged(files: list[Path], k: int, pool: pa.MemoryPool | None, device: Any = None) -> Callable[[], None]:
    """``least.py``'s replay with each step read into ``pool``: copied into a pinned buffer, then sent whole."""
    cols = least.columns(files[0])
    local = threading.local()
    cuda = device is not None and torch.device(device).type == "cuda"

    def take(n: int) -> np.ndarray:
        buf = getattr(local, "buf", None)
        if buf is None or buf.numel() < n:
            buf = local.buf = torch.empty(n + n // 4, dtype=torch.uint8, pin_memory=cuda)
        return buf.numpy()

    def one(f: Path) -> None:
        _, where = least.stage(f, cols, take, pool)
        p = where[-1][2] if where else 0
        if cuda:
            s = getattr(local, "stream", None) or torch.cuda.Stream(device)
            local.stream = s
            with torch.cuda.stream(s):
                torch.empty(p, dtype=torch.uint8, device=device).copy_(local.buf[:p], non_blocking=True)
            s.synchronize()

    return lambda: least.in_order(one, files, k)


def timed(fn: Callable[[], None], n: int, raw: int) -> dict[str, float]:
    """A warm pass of ``fn``, then a timed one: GB/s of tensor bytes (``raw`` a step, ``n`` steps) and the cores
    kept busy (the process's CPU time over the wall time)."""
    fn()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
    return {"gbps": n * raw / wall / 1e9, "busy": cpu / wall, "cpu_ms": cpu / n * 1e3}


def rows(files: list[Path], raw: int, device: Any, ks: tuple[int, ...], pinned: Pool, cached: Pool,
         reader: Any = None, steps: list[int] | None = None) -> list[tuple[str, Callable[[], None]]]:
    """The rows of one round (see the module doc), labelled; ``reader``: also ``Reader.iter`` over ``steps``."""
    out: list[tuple[str, Callable[[], None]]] = [("decoder ceiling: read_table, 8 at a time",
                                                  lambda: replay_cpu.ceiling(files))]
    for k in ks:
        out += [(f"least replay, {k} at a time", lambda k=k: least.gbps(files, raw, k, device)),
                (f"staged through cached plain memory, {k} at a time", staged(files, k, cached.pool, device)),
                (f"pinned decode, {k} at a time", pinned_decode(files, k, pinned.pool, device))]
        if reader is not None:
            for on in (False, True):
                def replay(k: int = k, on: bool = on) -> None:
                    with switch(on):
                        for _ in reader.iter(steps=steps, device=device, prefetch=k, layout="packed"):
                            pass
                        if device is not None:
                            torch.cuda.synchronize()
                what = "decoding into pinned memory" if on else "staged"
                out.append((f"Reader.iter(prefetch={k}, packed), {what}", replay))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pinned_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="distinct steps written (each read 3 times a pass)")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefetch", default="4,8", help="comma list of steps at once")
    a = ap.parse_args(argv)
    import trajstore

    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else None
    batches = [W.padded_batch(B=a.batch, max_len=a.max_len, seed=i) for i in range(3)]
    raw = W.raw_bytes(batches[0])
    with tempfile.TemporaryDirectory(prefix="trajstore-pinned-decode-") as tmp:
        lib = build(Path(tmp))
        pinned = Pool(lib, cuda_host_alloc() if cuda else None)
        cached = Pool(lib, None)
        d = Path(tmp) / "dump"
        with trajstore.Writer(d) as w:
            for s in range(a.steps):
                w.append(s, batches[s % len(batches)])
        r = trajstore.Reader(d)
        steps = list(range(a.steps)) * 3
        files = [r.file(s) for s in steps]
        cols = least.columns(files[0])
        same = np.array_equal(sent(files[0], cols, pinned.pool, device), sent(files[0], cols, None))
        print(f"# {os.cpu_count()} cores, pyarrow {pa.__version__}, torch {torch.__version__}, device "
              f"{device or 'CPU'}, pool {pinned.pool.backend_name}; {len(files)} steps of {raw / 1e6:.1f} MB a pass; "
              f"a step sent from the pinned pool equals the default read: {same}")
        ks = tuple(int(x) for x in a.prefetch.split(","))
        for rnd in range(a.rounds):
            res = [(label, timed(fn, len(files), raw)) for label, fn in rows(files, raw, device, ks, pinned, cached, r, steps)]
            ceiling = res[0][1]["gbps"]
            for label, m in res:
                print(f"round {rnd}  {label:52s} {m['gbps']:6.3f} GB/s  {m['gbps'] / ceiling:5.3f} of the ceiling"
                      f"  {m['busy']:5.2f} cores busy  CPU {m['cpu_ms']:6.1f} ms a step")
        print(f"# pinned pool: {pinned.made()} buffers made, {pinned.reserved() / 2**20:.0f} MiB; the reader's: "
              f"{D.status()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
