"""How each stage of a step's write and read uses the GIL (``python -m benchmarks.gil``; issue 23).

The writer runs up to 16 workers at once and replay up to 8 prefetch threads: a call that keeps the GIL
for a step-sized pass stalls every one of them, and a call that gives it up and takes it back waits in
line behind them each time. Each stage runs on one thread (trajstore's serial budget: no pool threads,
one torch thread, Arrow's CPU pool at one thread), alone and then beside a thread spinning pure Python with a 0.2 ms switch interval:

* ``alone``: the stage's time (median of ``--repeat``);
* ``beside``: its time while the spinner competes for the GIL;
* ``hand-offs``: ``(beside - alone) / 0.2 ms``, about how often the stage gave the GIL up and had to
  wait to take it back (each wait about one switch interval);
* ``longest hold``: the spinner's longest wait for the GIL: the longest stretch the stage kept it
  (a step-sized numpy pass that never gives it up shows here: numpy's ``cumsum`` over a step's token
  positions held it ~8 ms on the GPU host before the encoder moved to torch's, RESULTS.md).

The stages: the encode (``schema.encode_plain``), the Parquet write (``pq.write_table``), the index's
digests (``store/digest.py``), the commit's fsync and hash (``commit.prepare``), and a serial read
(``Reader._read``, a prefetch thread's unit). Figures move with the host; compare rows of one run.

Arrow's CPU pool is set to one thread for the run (and restored), and the read's Reader has a budget of
one thread (else it raises the pool to its budget while it reads): a read decodes on that pool even from
a serial thread, and where its threads and the spinner outnumber the free cores the spinner also waits
for a core, which would show as "holds" of one scheduler tick (4 ms on the 2-core VM with Arrow's two
threads; gone with one: benchmarks/RESULTS.md, ninth round). Run on a host with at least two free cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

import trajstore
from trajstore import schema
from trajstore.base import threads as _threads
from trajstore.format.file.parquet import parquet_options
from trajstore.store import commit, digest

from . import workload as W

SWITCH = 0.0002  # the spinner's switch interval (s)


class Spinner:
    """A thread running pure Python; ``stop()`` gives its longest wait for the GIL (ms)."""

    def __init__(self) -> None:
        self._stop, self.longest = False, 0.0
        self._old = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH)
        self._t = threading.Thread(target=self._run, name="gil-spinner", daemon=True)
        self._t.start()
        time.sleep(0.005)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop:
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now

    def stop(self) -> float:
        self._stop = True
        self._t.join()
        sys.setswitchinterval(self._old)
        return self.longest * 1e3


def measure(fn: Any, repeat: int) -> dict[str, float]:
    """``fn`` timed alone and beside a ``Spinner`` (median of ``repeat`` each, after one warm call)."""
    fn()

    def med() -> float:
        ts = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    alone = med()
    sp = Spinner()
    try:
        beside = med()
    finally:
        hold = sp.stop()
    return {"alone_ms": alone * 1e3, "beside_ms": beside * 1e3,
            "handoffs": max(0.0, beside - alone) / SWITCH, "hold_ms": hold}


def stages(batch: dict, tmp: Path) -> list[tuple[str, Any]]:
    """The stages of one step's write and read, each a callable run on the calling thread."""
    table = schema.encode_plain(batch, None, step=0, split="train", extra={})
    opts, doc = parquet_options(table), json.loads(table.schema.metadata[b"trajstore"])
    f = tmp / "step.parquet"
    pq.write_table(table, f, **opts)
    with trajstore.Writer(tmp / "dump", workers=1) as w:
        w.append(0, batch)
    r = trajstore.Reader(tmp / "dump", threads=1)  # its scan on one Arrow thread (module doc); a serial read
    # makes the same Python calls at any budget (its joins are whole columns: format/arrow.py ``_combined``)

    def prepare() -> None:
        commit.prepare(f)
        commit.forget(f)

    return [("encode (schema.encode_plain)", lambda: schema.encode_plain(batch, None, step=0, split="train", extra={})),
            ("Parquet write (pq.write_table)", lambda: pq.write_table(table, f, **opts)),
            ("index digests (digest.derive)", lambda: digest.derive(doc, table)),
            ("fsync and hash (commit.prepare)", prepare),
            ("serial read (Reader._read, packed)", lambda: r._read(0, None, "packed"))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gil", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=5, help="timed calls of each stage, alone and beside the spinner")
    a = ap.parse_args(argv)
    torch_threads, arrow_threads, was_serial = torch.get_num_threads(), pa.cpu_count(), _threads.is_serial()
    torch.set_num_threads(1)
    pa.set_cpu_count(1)
    _threads.serial()  # this thread's work on itself alone, as a writer worker's or a prefetch thread's
    try:
        batch = W.padded_batch(B=a.batch, max_len=a.max_len, seed=0)
        with tempfile.TemporaryDirectory(prefix="trajstore-gil-") as tmp:
            rows = [(label, measure(fn, a.repeat)) for label, fn in stages(batch, Path(tmp))]
    finally:
        torch.set_num_threads(torch_threads)
        pa.set_cpu_count(arrow_threads)
        _threads.serial(was_serial)
    print(f"# one thread, serial budget, Arrow's pool at one thread; a pure-Python thread beside it at a {SWITCH * 1e3:.1f} ms switch interval")
    print(f"{'stage':38s} {'alone':>10s} {'beside':>10s} {'hand-offs':>10s} {'longest hold':>13s}")
    for label, m in rows:
        print(f"{label:38s} {m['alone_ms']:7.2f} ms {m['beside_ms']:7.2f} ms {m['handoffs']:10.0f} "
              f"{m['hold_ms']:10.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
