"""``python -m benchmarks [--quick] [--json FILE]``: trajstore against the baselines, same run.

Workload: benchmarks/workload.py. Baselines, on the same step: AReaL-style ``torch.save`` /
``torch.load`` of the padded batch, ROLL-style ``pickle`` of the padded batch, ``torch.save`` of
the flat unpadded tensors, safetensors of the flat tensors. Every time is the median of
``--repeat`` runs; reads come from the page cache for every contender. Figures are printed as a
Markdown table (each with its ratio to a baseline and the issue's target) and, with ``--json``,
saved. On a machine with CUDA the GPU figures (replay GB/s, exposed data wait with a 200 ms
compute loop, prefetch=2) are added.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import trajstore
from trajstore import schema
from trajstore.device import decode_pool, pinned
from trajstore.store import checksums

from . import cuda_writes, encodings, least, padded, replay_cpu, scale
from .writes import throughput, writer_figures
from . import workload as W


def med(fn, repeat: int) -> float:
    return med_cpu(fn, repeat)[0]


def paired(fn, base, repeat: int) -> tuple[float, float]:
    """(median wall time of ``fn``, of ``base``), the two timed in turn ``repeat`` times each: a ratio of
    figures measured side by side, not minutes apart (the host's load and page cache drift between the
    baselines at the start and a row measured after the writer's)."""
    a, b = [], []
    for i in range(repeat):
        for f, out in ((fn, a), (base, b)) if i % 2 == 0 else ((base, b), (fn, a)):
            t0 = time.perf_counter()
            f()
            out.append(time.perf_counter() - t0)
    return statistics.median(a), statistics.median(b)


def med_cpu(fn, repeat: int) -> tuple[float, float]:
    """(median wall time, median CPU time of the whole process, every thread counted)."""
    ws, cs = [], []
    for _ in range(repeat):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        ws.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
    return statistics.median(ws), statistics.median(cs)


def as_json(info: dict, rep: "Report", enc: list, b: dict) -> str:
    """The ``--json`` file: the run's info, every row, the encodings' rows and the baselines' figures (not
    the flat file the paired read loads, a path)."""
    return json.dumps({"info": info, "figures": rep.rows, "encodings": enc,
                       "baselines": {k: v for k, v in b.items() if k != "flat_file"}}, indent=1)


class Report:
    def __init__(self):
        self.rows: list[dict] = []

    def add(self, figure: str, value: float, unit: str, base: float | None = None, base_name: str = "",
            target: str = "", ok: bool | None = None):
        # plain Python numbers (a numpy bool or int from a figure's arithmetic is not JSON: ``--json``)
        value, base = float(value), None if base is None else float(base)
        ok = None if ok is None else bool(ok)
        ratio = value / base if base else None
        self.rows.append({"figure": figure, "value": value, "unit": unit, "baseline": base_name,
                          "baseline_value": base, "ratio": ratio, "target": target, "met": ok})
        r = f"{ratio:.3f}x {base_name}" if ratio is not None else ""
        mark = "" if ok is None else (" MET" if ok else " MISSED")
        print(f"  {figure:58s} {value:12.4g} {unit:6s} {r}{('  target ' + target + mark) if target else ''}",
              flush=True)

    def markdown(self) -> str:
        out = ["| figure | value | baseline | ratio | target |", "|---|---|---|---|---|"]
        for r in self.rows:
            ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else ""
            base = f"{r['baseline']} ({r['baseline_value']:.4g})" if r["baseline_value"] else ""
            tgt = r["target"] + ("" if r["met"] is None else (" met" if r["met"] else " **missed**"))
            out.append(f"| {r['figure']} | {r['value']:.4g} {r['unit']} | {base} | {ratio} | {tgt} |")
        return "\n".join(out)


def fsize(p: Path) -> int:
    return p.stat().st_size


def baselines(rep: Report, tmp: Path, P: dict, F: dict, raw: int, repeat: int) -> dict:
    from safetensors.torch import load_file, save_file

    b = {}
    f = tmp / "padded.pt"
    b["save_padded"] = med(lambda: torch.save(P, f), repeat)
    b["bytes_padded"] = fsize(f)
    b["load_padded"] = med(lambda: torch.load(f, weights_only=True), repeat)
    f = tmp / "padded.pkl"

    def dump():
        with open(f, "wb") as fh:
            pickle.dump(P, fh, protocol=pickle.HIGHEST_PROTOCOL)

    b["save_pickle"] = med(dump, repeat)
    b["bytes_pickle"] = fsize(f)

    def load():
        with open(f, "rb") as fh:
            return pickle.load(fh)  # the ROLL-style baseline being measured, not library code

    b["load_pickle"] = med(load, repeat)
    f = tmp / "flat.pt"
    b["save_flat"] = med(lambda: torch.save(F, f), repeat)
    b["bytes_flat"] = fsize(f)
    b["load_flat"] = med(lambda: torch.load(f, weights_only=True), repeat)
    b["flat_file"] = f
    f = tmp / "flat.safetensors"
    Fc = {k: v.contiguous() for k, v in F.items()}
    b["save_st"] = med(lambda: save_file(Fc, str(f)), repeat)
    b["bytes_st"] = fsize(f)
    b["load_st"] = med(lambda: load_file(str(f)), repeat)
    print("baselines (s / bytes):", json.dumps({k: round(v, 5) for k, v in b.items() if k != "flat_file"}), flush=True)
    return b


def reader_figures(rep: Report, d: Path, b: dict, repeat: int) -> dict:
    """Main rows: the reader's default (verify=False); the verify=True rows (SHA-256 of the whole
    step file before decoding) are extra lines."""
    out = {}
    for verify in (False, True):
        r = trajstore.Reader(d, verify=verify)
        tag = ", verify=True" if verify else ""
        t, load = paired(lambda: r.read(0, layout="packed"), lambda: torch.load(b["flat_file"], weights_only=True),
                         2 * repeat + 1)
        rep.add(f"read(step, layout='packed') to CPU{tag}", t * 1e3, "ms", load * 1e3,
                "flat torch.load, timed in turn with it", "<= 1.5x", t / load <= 1.5)
        t2 = med(lambda: r[0], repeat)
        rep.add(f"Reader[step] padded{tag}", t2 * 1e3, "ms", b["load_padded"] * 1e3, "padded torch.load",
                "<= 0.4x", t2 / b["load_padded"] <= 0.4)
        out[verify] = (t, t2)
    # the Parquet decoder alone, same columns as read(layout='packed'): the floor under that figure
    import pyarrow.parquet as pq

    f = trajstore.Reader(d).file(0)
    cols = least.columns(f)
    _, cpu = med_cpu(lambda: pq.read_table(f, columns=cols, pre_buffer=False), repeat)
    t, load = paired(lambda: pq.read_table(f, columns=cols, pre_buffer=False),
                     lambda: torch.load(b["flat_file"], weights_only=True), 2 * repeat + 1)
    rep.add("  pyarrow read_table of those columns alone (no trajstore)", t * 1e3, "ms", load * 1e3,
            "flat torch.load, timed in turn with it")
    # the same read with trajstore's page checks and each column joined into one array on this thread
    t, load = paired(lambda: least.read_cpu(f, cols), lambda: torch.load(b["flat_file"], weights_only=True),
                     2 * repeat + 1)
    rep.add("  pyarrow read_table with page checks, each column joined by numpy (benchmarks/least.py)", t * 1e3,
            "ms", load * 1e3, "flat torch.load, timed in turn with it")
    # CPU time, every thread counted: the decode is bound by cores, so this is what caps a
    # pipeline that decodes several steps at once (replay)
    r = trajstore.Reader(d)
    _, cpu_read = med_cpu(lambda: r.read(0, layout="packed"), repeat)
    cores = os.cpu_count() or 1
    raw = sum(v.nbytes for v in r.read(0, layout="packed").values() if isinstance(v, torch.Tensor))
    rep.add("  CPU time per step (all threads): read(step, packed)", cpu_read * 1e3, "ms")
    rep.add("  CPU time per step (all threads): pyarrow read_table alone", cpu * 1e3, "ms")
    rep.add(f"  most read_table alone can give on {cores} cores (cores x bytes / its CPU time)",
            cores * raw / cpu / 1e9, "GB/s")
    return out


def read_profile(d: Path, repeat: int) -> None:
    """Where Reader.read(step, layout='packed') spends its time (printed, not in the table)."""
    import pyarrow.parquet as pq

    r = trajstore.Reader(d, verify=False)
    f = r.file(0)
    pf = pq.ParquetFile(f)
    print("# read profile, main step, per column (ms): ParquetFile.read on one thread / read_table "
          "wall / read_table CPU, all threads (read_table decodes row groups on Arrow's thread pool "
          "even with use_threads=False)", flush=True)
    for c in pf.schema_arrow.names:
        t = med(lambda: pq.ParquetFile(f).read(columns=[c], use_threads=False), repeat)
        t2, c2 = med_cpu(lambda: pq.read_table(f, columns=[c], use_threads=False), repeat)
        print(f"#   {c:16s} {t * 1e3:8.2f} {t2 * 1e3:8.2f} {c2 * 1e3:8.2f}", flush=True)
    t_all1 = med(lambda: pq.ParquetFile(f).read(use_threads=False), repeat)
    t_file = med(lambda: pq.ParquetFile(f).read(use_threads=True), repeat)
    t_ds = med(lambda: pq.read_table(f, use_threads=True), repeat)
    table = pq.read_table(f, use_threads=True)
    spec = r.info(0)["batch"]
    # an alternative decode schedule, for comparison: one task per (row group, column), each on
    # its own ParquetFile (they are not thread-safe), on a pool of min(16, cores) threads
    from concurrent.futures import ThreadPoolExecutor

    md = pf.metadata
    cols = [c for c in pf.schema_arrow.names if c != "attention_mask"]
    tasks = [(i, c) for i in range(md.num_row_groups) for c in cols]
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as ex:
        t_tasks = med(lambda: list(ex.map(
            lambda t: pq.ParquetFile(f, metadata=md).read_row_group(t[0], columns=[t[1]], use_threads=False),
            tasks)), repeat)
    t_ds2 = med(lambda: pq.read_table(f, columns=cols, use_threads=True), repeat)
    print(f"#   without attention_mask (what read(layout='packed') decodes): read_table {t_ds2 * 1e3:.1f}; "
          f"{len(tasks)} (row group, column) tasks on a thread pool {t_tasks * 1e3:.1f}", flush=True)
    t_dec = med(lambda: schema.decode(table, spec, where="x", layout="packed"), repeat)
    t_pad = med(lambda: schema.decode(table, spec, where="x"), repeat)
    t_sha = med(lambda: checksums.read_verified(f, 0), repeat)
    print(f"#   {pf.metadata.num_row_groups} row group(s); all columns, 1 thread {t_all1 * 1e3:.1f}; "
          f"ParquetFile.read(use_threads) {t_file * 1e3:.1f}; read_table (row groups in parallel) "
          f"{t_ds * 1e3:.1f}; schema.decode of that table: packed {t_dec * 1e3:.1f}, padded {t_pad * 1e3:.1f}; "
          f"read + SHA-256 check (verify=True) {t_sha * 1e3:.1f}", flush=True)


def rewards_figures(rep: Report, tmp: Path, m: int, B: int, main: Path, n: int, repeat: int) -> None:
    """``Reader.column("rewards")`` (one column chunk per file, files on a thread pool) against
    loading the same steps whole with ``read(step)`` one after another; the per-step
    ``read(step, columns=["rewards"])`` loop and the verify=True scan are extra lines."""
    def scan(r: trajstore.Reader, steps: list[int], label: str, whole: float, unit: str, k: float,
             reps: int) -> None:
        t = med(lambda: r.column("rewards", steps), reps)
        base = f"loading those {len(steps)} steps whole"
        rep.add(f"rewards across {label}, Reader.column", t * k, unit, whole * k, base, "<= 0.01x", t / whole <= 0.01)
        w = min(8, os.cpu_count() or 1)
        t1 = med(lambda: r.column("rewards", steps, workers=w), reps)
        rep.add(f"  same, Reader.column(workers={w})", t1 * k, unit, whole * k, base)
        t2 = med(lambda: [r.read(s, columns=["rewards"]) for s in steps], reps)
        rep.add("  same, read(step, columns=['rewards']) per step", t2 * k, unit, whole * k, base)
        rv = trajstore.Reader(r.path, verify=True)
        t3 = med(lambda: rv.column("rewards", steps), reps)
        rep.add("  same, Reader.column, verify=True", t3 * k, unit, whole * k, base)

    r = trajstore.Reader(main)
    steps = list(range(n))
    whole = med(lambda: [r.read(s) for s in steps], 1)
    scan(r, steps, f"the {n} main-size steps", whole, "ms", 1e3, repeat)
    d = tmp / "many"
    small = [W.padded_batch(B=B, max_len=512, seed=i, scale=1 / 32) for i in range(4)]
    with trajstore.Writer(d, workers=min(4, os.cpu_count() or 1), max_pending_steps=64) as w:
        for s in range(m):
            w.append(s, small[s % 4])
    r = trajstore.Reader(d)
    steps = r.steps
    whole = med(lambda: [r.read(s) for s in steps], 1)
    scan(r, steps, f"{m} small steps (B={B}, ~70 tokens)", whole, "s", 1.0, max(1, repeat // 2))


def gpu_figures(rep: Report, d: Path, raw: int, n: int, b: dict, tmp: Path, cycles: int) -> None:
    dev = torch.device("cuda")
    decode_pool.wait(300)  # a long run's replay: the pinned decode's build (started by the first replay) done
    print(f"  Arrow decoding into pinned memory: {decode_pool.status()}; pinned buffers registered: "
          f"{pinned.registration()}", flush=True)
    f_flat = tmp / "flat.pt"
    steps = list(range(n)) * max(1, 24 // n)

    def replay(r: trajstore.Reader, prefetch: int) -> float:
        """Sustained GB/s: one pass to warm the pinned staging pool, then the timed pass."""
        for _ in r.iter(steps=steps, device=dev, prefetch=prefetch, layout="packed"):
            pass
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in r.iter(steps=steps, device=dev, prefetch=prefetch, layout="packed"):
            pass
        torch.cuda.synchronize()
        return len(steps) * raw / (time.perf_counter() - t0) / 1e9

    for verify in (False, True):
        r = trajstore.Reader(d, verify=verify)
        tag = ", verify=True" if verify else ""
        gbps = replay(r, 2)
        t0 = time.perf_counter()
        for _ in steps[:6]:
            x = torch.load(f_flat, weights_only=True)
            x = {k: v.to(dev) for k, v in x.items()}
        torch.cuda.synchronize()
        base = 6 * raw / (time.perf_counter() - t0) / 1e9
        rep.add(f"replay to CUDA, iter(prefetch=2, packed){tag}", gbps, "GB/s", base,
                "flat torch.load + .cuda()", ">= 8 GB/s", gbps >= 8)
        if not verify:
            for k in (4, 8):
                g = replay(r, k)
                rep.add(f"replay to CUDA, iter(prefetch={k}, packed){tag}", g, "GB/s", base,
                        "flat torch.load + .cuda()", ">= 8 GB/s", g >= 8)
            # the ceiling set by the Parquet decoder: pyarrow read_table of the same steps, 8 at a
            # time, no conversion, no copy, no GPU (replay_cpu.ceiling)
            files = [r.file(s) for s in steps]
            gd = max(replay_cpu.ceiling_gbps(files, raw) for _ in range(2))
            rep.add("  decoder ceiling: pyarrow read_table alone, 8 steps at a time, to CPU", gd, "GB/s")
            t0 = time.perf_counter()
            for s in steps[:8]:
                r.read(s, layout="packed")
            t = (time.perf_counter() - t0) / 8
            rep.add("  read(step, packed) to CPU, one step at a time", t * 1e3, "ms")

    # exposed data wait: a loop that computes 200 ms per step on the GPU and syncs each step
    r = trajstore.Reader(d)
    fixed = r.read(0, layout="packed", device=dev)

    def body(batch):
        batch["input_ids"].sum()
        torch.cuda._sleep(cycles)
        torch.cuda.current_stream().synchronize()

    comp = []
    for _ in range(5):
        t0 = time.perf_counter()
        body(fixed)
        comp.append(time.perf_counter() - t0)
    compute = statistics.median(comp)
    exposed, nxt = [], []
    it = r.iter(steps=steps, device=dev, prefetch=2, layout="packed")
    for i in range(len(steps)):
        t0 = time.perf_counter()
        _, batch = next(it)
        t1 = time.perf_counter()
        body(batch)
        t2 = time.perf_counter()
        exposed.append(max(0.0, (t2 - t0) - compute))
        nxt.append(t1 - t0)
    it.close()
    steady = exposed[1:]
    mean = statistics.mean(steady)
    rep.add("compute per step (calibrated GPU loop)", compute * 1e3, "ms")
    rep.add("exposed data wait per step, mean (steps 2..)", mean * 1e3, "ms", compute * 1e3, "step compute",
            "<= 0.01x", mean / compute <= 0.01)
    rep.add("exposed data wait per step, max (steps 2..)", max(steady) * 1e3, "ms", compute * 1e3, "step compute")
    rep.add("exposed data wait, first step (cold)", exposed[0] * 1e3, "ms")
    rep.add("time inside next(), mean (steps 2..)", statistics.mean(nxt[1:]) * 1e3, "ms")


def calibrate_sleep(ms: float = 200.0) -> int:
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    c = 50_000_000
    t0 = time.perf_counter()
    torch.cuda._sleep(c)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return int(c * ms / 1e3 / dt)


def print_encodings(enc: list[dict], steps: list[dict]) -> None:
    print("\n| column | encoding | zstd | bytes/value | write MB/s | read MB/s | read M values/s |"
          "\n|---|---|---|---|---|---|---|")
    for e in enc:
        print(f"| {e['column']} | {e['encoding']} | {e['zstd']} | {e['bytes_per_value']:.3f} | "
              f"{e['write_MBps']:.0f} | {e['read_MBps']:.0f} | {e['read_Mvalues_per_s']:.0f} |")
    print("\n| log-probs stored as | encodings | file MB | log-probs MB | read step ms | read log-probs ms | "
          "replay packed to CUDA ms |\n|---|---|---|---|---|---|---|")
    for s in steps:
        gpu = "" if s["replay_cuda_s"] is None else f"{s['replay_cuda_s'] * 1e3:.1f}"
        print(f"| {s['logprobs']} | {s['encodings']} | {s['file_bytes'] / 1e6:.2f} | {s['logprobs_bytes'] / 1e6:.2f} | "
              f"{s['read_step_s'] * 1e3:.1f} | {s['read_logprobs_s'] * 1e3:.1f} | {gpu} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, a few minutes on 2 cores")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--dir", help="scratch folder (default: a temporary one, removed)")
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--skip", default="",
                    help="comma list of sections to skip: encodings,rewards,scale,s3,padded,cuda_writes")
    ap.add_argument("--only-encodings", action="store_true",
                    help="only the encoding benchmark (benchmarks/encodings.py): columns, then whole steps")
    ap.add_argument("--only", choices=["padded", "cuda_writes", "writes"], help="only this section: padded (replay "
                    "to CUDA padded vs packed, on a dump written for it, benchmarks/padded.py), cuda_writes (a padded "
                    "CUDA batch dumped, benchmarks/cuda_writes.py), writes (background write throughput, "
                    "benchmarks/writes.py)")
    a = ap.parse_args(argv)
    q = a.quick
    B, max_len, n, m, repeat = (128, 4096, 4, 100, 3) if q else (1024, 8192, 8, 1000, 5)
    skip = set(filter(None, a.skip.split(",")))
    tmp = Path(a.dir or tempfile.mkdtemp(prefix="trajstore-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
            "torch": torch.__version__, "pyarrow": __import__("pyarrow").__version__,
            "cpus": os.cpu_count(), "machine": platform.platform(), "quick": q,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    print("#", json.dumps(info), flush=True)
    rep = Report()
    try:
        t0 = time.perf_counter()
        batches = [W.padded_batch(B=B, max_len=max_len, seed=i) for i in range(3)]
        P = batches[0]
        F = W.flat_batch(P)
        raw = W.raw_bytes(P)
        tokens = int(P["attention_mask"].sum())
        print(f"# workload: B={B}, T={P['input_ids'].shape[1]}, tokens={tokens} (mean {tokens / B:.0f}), "
              f"raw {raw / 1e6:.1f} MB, padded {sum(v.nbytes for v in P.values()) / 1e6:.1f} MB "
              f"(generated in {time.perf_counter() - t0:.1f} s)", flush=True)
        if a.only_encodings:
            print_encodings(encodings.run(P), encodings.steps(P, repeat))
            return 0
        if a.only == "padded":
            d = tmp / "padded_dump"
            with trajstore.Writer(d) as w:
                for i in range(n):
                    w.append(i, batches[i % len(batches)])
            padded.run(rep, d, raw, n, repeat, torch.cuda.is_available() and not a.no_gpu)
            print("\n" + rep.markdown(), flush=True)
            return 0
        if a.only == "cuda_writes":
            cuda_writes.run(rep, tmp, batches, raw, n)
            print("\n" + rep.markdown(), flush=True)
            return 0
        if a.only == "writes":
            throughput(rep, tmp, batches, raw, n)
            print("\n" + rep.markdown(), flush=True)
            return 0
        b = baselines(rep, tmp, P, F, raw, repeat)
        d = writer_figures(rep, tmp, batches, raw, n, b)
        reader_figures(rep, d, b, repeat)
        if q:  # the issue-2 acceptance point is on a 1,024-trajectory batch: measure it in quick mode too
            A = W.padded_batch(B=1024, max_len=8192, seed=7)
            with trajstore.Writer(tmp / "accept") as w:
                w.append(0, A)
            size = fsize(tmp / "accept" / "train" / "step_00000000.parquet")
            rep.add("bytes on disk / raw unpadded bytes, B=1024", size / W.raw_bytes(A), "x", None, "",
                    "<= 0.30 (issue 2)", size / W.raw_bytes(A) <= 0.30)
            del A
        read_profile(d, repeat)
        if "rewards" not in skip:
            rewards_figures(rep, tmp, m, B, d, n, repeat)
        if "scale" not in skip:  # a split of 10,000 small steps (1,000 with --quick)
            for name, t in scale.run(tmp, 1_000 if q else 10_000):
                rep.add(name, t * 1e3, "ms", target="< 1000 ms (issue 14)" if name.startswith("Reader(path)")
                        else "", ok=t < 1 if name.startswith("Reader(path)") else None)
        if "s3" not in skip:  # the same listing on a local S3 server (moto), beside it; skipped without moto
            for name, t in scale.run_s3(tmp, 1_000 if q else 10_000):
                rep.add(name, t * 1e3, "ms", None, "")
        if torch.cuda.is_available() and not a.no_gpu:
            gpu_figures(rep, d, raw, n, b, tmp, calibrate_sleep())
        if "cuda_writes" not in skip and not a.no_gpu:  # a padded CUDA batch dumped (issue 23); skipped without CUDA
            cuda_writes.run(rep, tmp, batches, raw, n)
        if "padded" not in skip:  # padded replay to CUDA against packed (issue 16); GPU rows skipped without CUDA
            padded.run(rep, d, raw, n, repeat, torch.cuda.is_available() and not a.no_gpu)
        enc = [] if "encodings" in skip else encodings.run(P)
        if enc:
            print_encodings(enc, encodings.steps(P, repeat))
        print("\n" + rep.markdown(), flush=True)
        if a.json:
            Path(a.json).write_text(as_json(info, rep, enc, b))
    finally:
        if not a.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
