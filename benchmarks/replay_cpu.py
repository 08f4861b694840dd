"""Where replay's CPU goes, by thread (``python -m benchmarks.replay_cpu``; issue 23): the decoder ceiling
(``pq.read_table`` of the same files, 8 at a time, as ``python -m benchmarks`` measures it) and
``Reader.iter(layout="packed")`` at each prefetch depth, each timed over a warm pass of the same steps,
with the process's CPU time a step split by thread kind:

* ``trajstore-read``: the prefetch threads (opening a step, waiting on Arrow's scan, the joins of
  deep prefetch);
* ``trajstore-decode``: the shared pool (stream joins, arena joins, copies);
* ``python main``: the consumer (staging, launching the copies to the GPU);
* ``native``: every thread Python did not start (Arrow's CPU pool decoding the row groups, CUDA's and
  torch's own threads).

Thread times come from ``/proc/self/task/*/stat`` (Linux), sampled every 20 ms so that threads which
end before the pass does are counted; the process total (``getrusage``) is printed beside their sum.
Off Linux the split is left out. ``--device cuda`` replays to the GPU (default where CUDA is present).
``--stages`` adds a step's read stage by stage on 8 serial threads (``stages``): the scan alone, the decode
alone (of tables read before the pass), then scan and decode, the rows that showed where replay left cores idle.

Each row gives the minor page faults a step (``getrusage``: memory touched for the first time; few here, so
fresh buffers are not where replay's time goes: benchmarks/RESULTS.md, issue 23, tenth round), and the cores
it kept busy (the process's CPU time over the pass's wall time): replay is bound by the CPU where that is
every core, and leaves cores idle where it is fewer than the ceiling's (benchmarks/RESULTS.md, issue 23,
ninth round). Each row also gives how long a thread waits to take the GIL back (``GilWait``: a thread that
sleeps 0.2 ms again and again, timing how late it wakes; idle, that is the timer's own slack): the mean and
the 90th percentile. Where the decoding threads' calls serialize on the GIL, it grows (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import trajstore
from trajstore.base import arrow_pool
from . import workload as W

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _thread_times() -> dict[int, float]:
    """CPU seconds of each thread of this process (user + system), by native thread id."""
    out: dict[int, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/self/task/{t}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            out[int(t)] = (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime: fields 14, 15
        except (OSError, ValueError, IndexError):
            continue
    return out


class ThreadCPU:
    """Samples every thread's CPU time while a pass runs; ``by_kind()`` the CPU each kind of thread used."""

    def __init__(self, every: float = 0.02):
        self.every, self.names = every, {}
        self.first = _thread_times()
        self.last = dict(self.first)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="replay-cpu-sampler", daemon=True)
        self._t.start()

    def _sample(self) -> None:
        for th in threading.enumerate():
            if th.native_id is not None:
                self.names[th.native_id] = th.name
        self.last.update(_thread_times())

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def stop(self) -> None:
        self._sample()
        self._stop.set()
        self._t.join()

    def by_kind(self) -> dict[str, float]:
        kinds: dict[str, float] = {}
        main = threading.main_thread().native_id
        for tid, t in self.last.items():
            name = self.names.get(tid)
            if name in ("replay-cpu-sampler", "replay-cpu-gil"):
                continue
            if tid == main:
                kind = "python main"
            elif name is None:
                kind = "native"
            elif name.startswith("trajstore-"):
                kind = name.split("_")[0]
            else:
                kind = "python other"
            kinds[kind] = kinds.get(kind, 0.0) + t - self.first.get(tid, 0.0)
        return kinds


class GilWait:
    """A thread that sleeps ``nap`` seconds again and again while a pass runs; how late each wake-up
    comes back (its wait for the GIL, and the timer's slack) gives ``mean_p90()`` in ms."""

    def __init__(self, nap: float = 0.0002):
        self.nap, self.late = nap, []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="replay-cpu-gil", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(self.nap)
            self.late.append(time.perf_counter() - t0 - self.nap)

    def stop(self) -> tuple[float, float]:
        self._stop.set()
        self._t.join()
        late = sorted(self.late) or [0.0]
        return sum(late) / len(late) * 1e3, late[int(len(late) * 0.9)] * 1e3


def _cpu() -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def measure(fn, n_steps: int, raw: int) -> dict[str, Any]:
    """One warm pass of ``fn``, then a timed one: GB/s and CPU ms a step, in all and by thread kind."""
    fn()
    probe, gil = ThreadCPU(), GilWait()
    c0, t0 = _cpu(), time.perf_counter()
    fn()
    wall, c1 = time.perf_counter() - t0, _cpu()
    probe.stop()
    user, sys_ = c1[0] - c0[0], c1[1] - c0[1]
    return {"gbps": n_steps * raw / wall / 1e9, "cpu_ms": (user + sys_) / n_steps * 1e3, "busy": (user + sys_) / wall,
            "sys_ms": sys_ / n_steps * 1e3, "faults": (c1[2] - c0[2]) / n_steps, "gil_ms": gil.stop(),
            "kinds": {k: v / n_steps * 1e3 for k, v in sorted(probe.by_kind().items())}}


def ceiling(files: list[Path], checks: bool = False) -> None:
    """The decoder ceiling's pass (``python -m benchmarks`` judges replay against it): ``pq.read_table``
    of the step files, 8 at a time, the columns a packed replay reads, no conversion, no copy, no GPU, on
    Arrow's pool as the process has it: a replay just before may have left it resized for half a second
    (``arrow_pool.LINGER``: 12 threads of 16 after a deep prefetch), so it is given back first. ``checks``:
    each page's CRC32 verified too (``page_checksum_verification``), as every trajstore read does
    (docs/RELIABILITY.md): the same decode with trajstore's integrity check, an extra line beside the
    ceiling the target is judged against."""
    import pyarrow.parquet as pq

    from .least import columns

    arrow_pool.settle()
    cols = columns(files[0])
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda f: pq.read_table(f, columns=cols, use_threads=False, pre_buffer=False,
                                            page_checksum_verification=checks), files))


def ceiling_gbps(files: list[Path], raw: int, checks: bool = False) -> float:
    """One timed pass of ``ceiling`` over ``files`` (steps of ``raw`` tensor bytes each): GB/s."""
    t0 = time.perf_counter()
    ceiling(files, checks)
    return len(files) * raw / (time.perf_counter() - t0) / 1e9


def stages(r: Any, steps: list[int], threads: int = 8) -> list[tuple[str, Any]]:
    """A step's read, stage by stage, on ``threads`` plain threads each decoding serially (as ``Reader.iter``'s
    prefetch threads do from prefetch 4): trajstore's scan alone (its dataset reader, page checksums checked),
    the decode alone (of each step's table, read before the pass), then scan and decode (``Reader._read``, to
    host memory). Beside the ceiling they show which stage leaves cores idle (benchmarks/RESULTS.md, issue 23
    sixth and seventh rounds)."""
    from trajstore.base import threads as _threads
    from trajstore.read import decode as _decode

    opened = {s: r._open(s) for s in set(steps)}
    tables = {s: _decode.read_table(f, s, None, "packed") for s, f in opened.items()}

    def on_threads(fn: Any) -> Any:
        def run() -> None:
            def one(s: int) -> None:
                _threads.serial()
                fn(s)
            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(one, steps))
        return run

    return [(f"trajstore scan alone, {threads} serial threads",
             on_threads(lambda s: _decode.read_table(r._open(s), s, None, "packed"))),
            (f"decode alone (tables read before), {threads} serial threads",
             on_threads(lambda s: _decode.decode(opened[s].doc, tables[s], opened[s].path, None, "packed"))),
            (f"scan + decode (Reader._read), {threads} serial threads", on_threads(lambda s: r._read(s, None, "packed")))]


def run(d: Path, raw: int, steps: list[int], device: Any, prefetches: tuple[int, ...],
        by_stage: bool = False) -> list[tuple[str, dict]]:
    r = trajstore.Reader(d)
    files = [r.file(s) for s in steps]
    rows = [("decoder ceiling: read_table, 8 at a time", measure(lambda: ceiling(files), len(steps), raw))]
    if by_stage:
        rows += [(label, measure(fn, len(steps), raw)) for label, fn in stages(r, steps)]
    for k in prefetches:
        def replay(k: int = k) -> None:
            for _ in r.iter(steps=steps, device=device, prefetch=k, layout="packed"):
                pass
            if device is not None and torch.device(device).type == "cuda":
                torch.cuda.synchronize()
        rows.append((f"Reader.iter(prefetch={k}, packed) to {device or 'CPU'}", measure(replay, len(steps), raw)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.replay_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="distinct steps written (each read 3 times a pass)")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else None)
    ap.add_argument("--prefetch", default="4,8", help="comma list of prefetch depths")
    ap.add_argument("--stages", action="store_true", help="also the scan alone, the decode alone and "
                    "scan + decode on 8 serial threads")
    a = ap.parse_args(argv)
    batches = [W.padded_batch(B=a.batch, max_len=a.max_len, seed=i) for i in range(3)]
    raw = W.raw_bytes(batches[0])
    with tempfile.TemporaryDirectory(prefix="trajstore-replay-cpu-") as tmp:
        d = Path(tmp) / "dump"
        with trajstore.Writer(d) as w:
            for s in range(a.steps):
                w.append(s, batches[s % len(batches)])
        rows = run(d, raw, list(range(a.steps)) * 3, a.device, tuple(int(x) for x in a.prefetch.split(",")), a.stages)
    print(f"# {os.cpu_count()} cores, torch {torch.__version__}, device {a.device or 'CPU'}; CPU ms a step by thread kind")
    for label, m in rows:
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in m["kinds"].items())
        print(f"{label:52s} {m['gbps']:#6.3g} GB/s  CPU {m['cpu_ms']:6.1f} ms a step ({m['busy']:#5.3g} of "
              f"{os.cpu_count()} cores busy), system {m['sys_ms']:5.1f}, {m['faults']:7.0f} page faults"
              f"  ({kinds}); GIL wait mean {m['gil_ms'][0]:.2f} ms, p90 {m['gil_ms'][1]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
