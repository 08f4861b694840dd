"""Issue 23's many-rank acceptance rows in one command: ``python -m benchmarks.ranks_suite [--ranks N]``.

Launches ``benchmarks/ranks.py`` under plain ``torchrun --standalone`` (one process per rank, the environment passed
on as it is: no thread variable is set here) for each phase, in rounds, every round on fresh dumps:

- ``write`` by 1 rank and by N ranks (N: ``--ranks``, default the GPUs of this host, at least 2);
- ``replay`` of the 1-rank dump by 1 rank, of the N-rank dump by N ranks, and by N / 2 ranks (each of those decodes
  its slices' row groups only: its decoded fraction).

Then it prints a Markdown table: per figure, the median over the rounds of the per-round ratio (each ratio taken
within one round, so a host that drifts between rounds moves both sides), every round's value, and issue 23's target
where the issue states one (its rows are for N = 4: aggregate write and replay >= 3x one rank, replay >= 0.8x the
host's ``read_table`` ceiling with all cores, the N / 2 ranks each decoding <= 0.6 of the dump). ``--json FILE``
saves every phase's line. Exits 1 when a phase fails or a replayed slice is not bit-exact. Extra arguments after
``--`` go to every ``ranks.py`` call (``-- --cpu --steps 2 --batch 8 --max-len 64``: a smoke test on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SIZES = ["--steps", "24", "--batch", "512", "--max-len", "8192"]  # issue 23's workload: 24 steps x 512 a rank
THREAD_VARS = ("OMP_NUM_THREADS", "TRAJSTORE_THREADS", "MKL_NUM_THREADS")
LAUNCH = ["--standalone"]  # torchrun's rendezvous: one host (the tests pin it to 127.0.0.1)


def phase(n: int, args: list[str], log: list[dict]) -> dict:
    """One ``ranks.py`` call by ``n`` ranks under torchrun: its JSON line (``rc`` and ``error`` added on failure)."""
    run = [*LAUNCH, f"--nproc-per-node={n}", "-m", "benchmarks.ranks", *args]  # torchrun's arguments
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", *run], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1])
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    out = json.loads(lines[-1]) if lines else {}
    out["launch"] = " ".join(["torchrun", *run])
    if p.returncode != 0 or not lines:
        out["rc"] = p.returncode
        out["error"] = (p.stderr.strip().splitlines() or ["no output"])[-1]
    print(json.dumps(out), flush=True)
    log.append(out)
    return out


def one_round(n: int, root: Path, extra: list[str], log: list[dict]) -> dict:
    """Every phase once, on fresh dumps under ``root``: ``{name: its JSON line}``."""
    d1, dn = str(root / "d1"), str(root / f"d{n}")
    got = {"write 1": phase(1, ["write", "--dump", d1, *extra], log),
           f"write {n}": phase(n, ["write", "--dump", dn, *extra], log),
           "replay 1 of 1": phase(1, ["replay", "--dump", d1, "--dumped", "1", *extra], log),
           f"replay {n} of {n}": phase(n, ["replay", "--dump", dn, "--dumped", str(n), *extra], log)}
    h = n // 2
    got[f"replay {h} of {n}"] = phase(h, ["replay", "--dump", dn, "--dumped", str(n), *extra], log)
    return got


def rows(n: int, rounds: list[dict]) -> list[tuple[str, list[float], str, bool | None]]:
    """(figure, its value in each round, target, met: None where the issue states no target for ``n`` ranks)."""
    four = n == 4

    def each(fn):
        vals = []
        for r in rounds:
            try:
                vals.append(float(fn(r)))
            except (KeyError, TypeError, ZeroDivisionError):
                vals.append(float("nan"))
        return vals

    gb = lambda r, k: r[k]["GB/s"]  # noqa: E731
    out = [
        (f"write, {n} ranks aggregate / 1 rank", each(lambda r: gb(r, f"write {n}") / gb(r, "write 1")), ">= 3x",
         lambda m: m >= 3.0),
        (f"replay, {n} ranks aggregate / 1 rank", each(lambda r: gb(r, f"replay {n} of {n}") / gb(r, "replay 1 of 1")),
         ">= 3x", lambda m: m >= 3.0),
        (f"replay, {n} ranks aggregate / read_table with all cores (1 process)",
         each(lambda r: gb(r, f"replay {n} of {n}") / r[f"replay {n} of {n}"]["read_table GB/s (all cores, 1 process)"]),
         ">= 0.8x", lambda m: m >= 0.8),
    ]
    h = n // 2
    out.append((f"replay, {h} of the {n}-rank dump: decoded fraction, most of any rank",
                each(lambda r: r[f"replay {h} of {n}"]["decoded fraction (max over ranks)"]), "<= 0.6", lambda m: m <= 0.6))
    table = []
    for name, vals, target, holds in out:
        m = statistics.median(vals) if vals else float("nan")
        table.append((name, vals, target if four else "", holds(m) if four else None))
    for k in ("write 1", f"write {n}", "replay 1 of 1", f"replay {n} of {n}"):
        table.append((f"  {k} rank(s), GB/s", each(lambda r, k=k: gb(r, k)), "", None))
    return table


def exact(rounds: list[dict]) -> bool:
    """Every phase ran, and every replayed slice was bit-exact."""
    return all("rc" not in x and x.get("bit-exact", True) for r in rounds for x in r.values())


def markdown(n: int, rounds: list[dict]) -> str:
    lines = ["| figure | median of the rounds | each round | target (issue 23, 4 ranks) |", "|---|---|---|---|"]
    for name, vals, target, met in rows(n, rounds):
        m = statistics.median(vals) if vals else float("nan")
        tgt = target + ("" if met is None else (" met" if met else " **missed**"))
        lines.append(f"| {name} | {m:.3f} | {' '.join(f'{v:.3f}' for v in vals)} | {tgt} |")
    lines.append(f"| every phase ran, every replayed slice bit-exact | {exact(rounds)} | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else list(SIZES)
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ranks_suite", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=None, help="N >= 2 (default: the GPUs of this host, at least 2; "
                    "ranks beyond the GPUs share them)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the dumps go, each round's removed after it (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="save every phase's JSON line here")
    a = ap.parse_args(argv)
    n = a.ranks
    if n is None:
        import torch

        n = max(2, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if n < 2 or a.rounds < 1:
        ap.error("--ranks must be >= 2 (N ranks against 1) and --rounds >= 1")
    set_vars = {k: os.environ[k] for k in THREAD_VARS if k in os.environ}
    if set_vars:  # measured as users launch: plain torchrun, nothing set by hand
        print(f"# note: thread variables set in this environment, passed on to the ranks: {set_vars}", flush=True)
    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="trajstore-ranks-"))
    log: list[dict] = []
    rounds = []
    try:
        for i in range(a.rounds):
            rounds.append(one_round(n, root / f"round{i}", extra, log))
            shutil.rmtree(root / f"round{i}", ignore_errors=True)
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(markdown(n, rounds), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"ranks": n, "rounds": log}, indent=1))
    return 0 if exact(rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
