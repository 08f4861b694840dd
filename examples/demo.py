"""Dump a short RL run, replay it with the sampler never constructed, and check that the two runs
print the same per-step loss, grad-norm and final weights digest, bit for bit.

    python examples/demo.py                  # 20 steps on CPU, about half a minute on 2 cores
    python examples/demo.py --steps 5        # other arguments go to examples/rl_loop.py
    python examples/demo.py --device cuda    # on a GPU (trajstore.deterministic() is on)
    python examples/demo.py --keep DIR       # keep the dump in DIR

Each run is its own process, as a real replay would be.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(mode: str, dump: str, args: list[str]) -> str:
    cmd = [sys.executable, str(HERE / "rl_loop.py"), f"--{mode}", dump, "--verbose", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)  # logs go to stderr as they come
    out = []
    for line in p.stdout:
        print(line, end="", flush=True)
        out.append(line)
    if p.wait():
        sys.exit(f"the {mode} run failed (exit status {p.returncode})")
    return "".join(out)


def main() -> None:
    args = sys.argv[1:]
    keep = None
    if "--keep" in args:
        i = args.index("--keep")
        keep, args = args[i + 1], args[:i] + args[i + 2:]
    with tempfile.TemporaryDirectory() as tmp:
        dump = keep or os.path.join(tmp, "dump")
        print(f"== dump: sample, train, record every step's rollout batch in {dump}", flush=True)
        a = run("dump", dump, args)
        print(f"\n== replay: train from {dump}; the sampler is never constructed", flush=True)
        b = run("replay", dump, args)
    if a != b:
        import difflib

        sys.stdout.writelines(difflib.unified_diff(a.splitlines(True), b.splitlines(True), "dump", "replay"))
        sys.exit("\nthe runs differ")
    steps = sum(line.startswith("step") for line in a.splitlines())
    print(f"\nbit-identical: per-step loss and grad-norm of {steps} steps, and the final weights digest")


if __name__ == "__main__":
    main()
