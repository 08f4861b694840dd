"""Dump a short RL run, replay it with the sampler never constructed, and check that the two runs
print the same per-step loss, grad-norm and final weights digest, bit for bit.

    python examples/demo.py                  # 20 steps on CPU
    python examples/demo.py --steps 5        # other arguments go to examples/rl_loop.py
    python examples/demo.py --device cuda    # on a GPU (trajstore.deterministic() is on)
    python examples/demo.py --out DIR        # the dump in DIR instead of dumps/demo

The dump stays in ``dumps/demo`` of the checkout (ignored by git), the dump every example of
README.md runs on (``trajstore info dumps/demo``); a dump left there by an earlier demo is replaced.
Each run is its own process, as a real replay would be.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "dumps" / "demo"


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


def fresh(out: Path) -> None:
    """Make room for the dump at ``out``: an earlier demo's dump there is removed; anything else stops the demo."""
    if not out.exists():
        return
    if out.is_dir() and (out / "trajstore.json").is_file():
        shutil.rmtree(out)
    elif out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    else:
        sys.exit(f"{out} exists and is not a trajstore dump; remove it or pass --out DIR")


def arguments(argv: list[str]) -> tuple[Path, list[str]]:
    """The dump's folder and the arguments for rl_loop.py, all checked before anything is removed:
    ``--help`` or a mistyped option ends the demo here, with the dump untouched."""
    spec = importlib.util.spec_from_file_location("rl_loop", HERE / "rl_loop.py")
    loop = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(HERE.parent))  # the trajstore of this checkout, as the two runs get it
    spec.loader.exec_module(loop)
    ap = argparse.ArgumentParser(prog="python examples/demo.py", description=__doc__.split("\n\n")[0],
                                 allow_abbrev=False)
    ap.add_argument("--out", "--keep", metavar="DIR", type=Path, default=DEFAULT_OUT,
                    help="where the dump goes (default: dumps/demo of the checkout; an earlier demo's dump "
                         "there is replaced, any other folder is left alone)")
    loop.options(ap.add_argument_group("passed on to examples/rl_loop.py"))
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error(f"--steps {a.steps}: the demo needs at least one step to compare")
    if a.quiet:
        ap.error("--quiet: the demo compares the lines the two runs print; leave it out")
    rest, i = [], 0
    while i < len(argv):  # rl_loop.py's arguments: all but --out DIR (or --out=DIR)
        flag = argv[i].split("=", 1)[0]
        if flag in ("--out", "--keep"):
            i += 1 if "=" in argv[i] else 2
            continue
        rest.append(argv[i])
        i += 1
    return a.out.absolute(), rest


def main() -> None:
    out, args = arguments(sys.argv[1:])
    fresh(out)
    dump = str(out)
    print(f"== dump: sample, train, record every step's rollout batch in {dump}", flush=True)
    a = run("dump", dump, args)
    print(f"\n== replay: train from {dump}; the sampler is never constructed", flush=True)
    b = run("replay", dump, args)
    if a != b:
        sys.stdout.writelines(difflib.unified_diff(a.splitlines(True), b.splitlines(True), "dump", "replay"))
        sys.exit("\nthe runs differ")
    steps = sum(line.startswith("step") for line in a.splitlines())
    if not steps:  # nothing was compared: never a success line
        sys.exit("\nthe runs printed no step: nothing was compared")
    shown = os.path.relpath(dump) if not os.path.relpath(dump).startswith("..") else dump
    print(f"\nbit-identical: per-step loss and grad-norm of {steps} steps, and the final weights digest")
    print(f"the dump is in {shown}: try `trajstore info {shown}` (README.md, 'Look inside a dump')")


if __name__ == "__main__":
    main()
