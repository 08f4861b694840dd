"""``trajstore diff``: two dumps (or two fields of one) compared step by step and field by field,
with the first divergence and every (step, field) beyond tolerance; exit 1 when one is.

The comparison itself is ``trajstore.inspection.diff``, imported when the command runs."""

from __future__ import annotations

import argparse
import json
from typing import Any

from . import console as out
from ..base.text import format_ranges, parse_steps, runs
from .registry import JSON, SPLIT, arg, command

__all__ = ["cmd_diff"]


def _where(fd: dict | None) -> str:
    """``step 1 traj 2 tok 5: -0.335 vs -0.325`` for a first divergence."""
    if not fd:
        return "-"
    short = {"step": "step", "field": "field", "trajectory": "traj", "token": "tok", "element": "elem"}
    s = " ".join(f"{short[k]} {fd[k]}" for k in short if k in fd and fd[k] != "*")  # "*": the whole step
    if fd.get("id"):
        s += f" (id {_id(fd)})"
    if "a" in fd:
        s += f": {out.fmt(fd['a'])} vs {out.fmt(fd['b'])}"
    if fd.get("note"):
        s += f" ({fd['note']})"
    return s


def _id(loc: dict | None) -> str:
    """A trajectory's id ``(step, row)`` (docs/FORMAT.md 3.13), or its index."""
    if not loc:
        return "-"
    return "({}, {})".format(*loc["id"]) if loc.get("id") else str(loc.get("trajectory", "-"))


DIVERGING_ROWS = 200  # the per-step table's rows in text; --json has every entry


def _diverging(rep: Any) -> None:
    """Every (step, field) beyond tolerance: max/mean abs and rel differences, where the worst value is
    (trajectory id, token), and the trajectories with a value beyond tolerance."""
    bad = [e for e in rep.entries if e.status not in ("identical", "close")]
    if not bad:
        return
    rows = [[e.step, e.field, e.status, e.max_abs, e.mean_abs, e.max_rel, e.mean_rel, _id(e.worst),
             (e.worst or {}).get("token", "-"),
             " ".join("({}, {})".format(*b) if isinstance(b, list) else str(b) for b in e.beyond) or e.note or "-"]
            for e in bad[:DIVERGING_ROWS]]
    out.table(["step", "field", "status", "max abs", "mean abs", "max rel", "mean rel", "worst traj", "token",
               "trajectories beyond tol"], rows, title="beyond tolerance, per step and field")
    if len(bad) > DIVERGING_ROWS:
        print(f"... and {len(bad) - DIVERGING_ROWS} more (--json lists every one)")


_HOW = {"bytes": "the same bytes (equal recorded SHA-256, both files hashed and checked against it; --deep "
                 "reads both)",
        "values": "compared value by value (read from both dumps)",
        "damaged": "a step file does not match its recorded SHA-256: damaged, not compared (trajstore verify)",
        "one side": "in one dump only", "one dump": "two fields of one dump, value by value"}


@command("diff", "compare two dumps (or two fields of one) step by step, field by field",
         arg("a", help="dump A"), arg("b", nargs="?", help="dump B (omit with --pair: compare within A)"),
         arg("--steps", help="steps to compare, e.g. 0-9,12 (default: all)"),
         arg("--fields", help="comma-separated fields (default: all)"),
         arg("--atol", type=float, default=0.0, help="absolute tolerance (default 0: exact)"),
         arg("--rtol", type=float, default=0.0, help="relative tolerance, |a-b| <= atol + rtol*|b|"),
         arg("--pair", nargs=2, metavar=("FIELD_A", "FIELD_B"),
             help="compare FIELD_A of A with FIELD_B of B (or of A), with summary statistics"),
         arg("--mask", help="only compare tokens where this per-token field is non-zero"),
         arg("--first", action="store_true", help="stop at the first divergence (the report ends there)"),
         arg("--deep", action="store_true", help="check every step file against its recorded SHA-256 and read both "
                                                 "sides' values, also where the two files' checksums are equal"),
         SPLIT, JSON)
def cmd_diff(args: argparse.Namespace) -> int:
    from ..inspection.diff import diff

    from ..store.fs import resolve
    from ..store.listing import default_split

    fields = [f.strip() for f in args.fields.split(",") if f.strip()] if args.fields else None
    split = args.split if args.split is not None else default_split(resolve(args.a, "diff"))  # B: the split of A's name
    rep = diff(args.a, args.b, steps=parse_steps(args.steps, "--steps"), fields=fields, atol=args.atol,
               rtol=args.rtol, split=split, pair=tuple(args.pair) if args.pair else None, mask=args.mask,
               first=args.first, deep=args.deep, progress=lambda s: out.progress(s, "comparing"))
    # an unknown field or step raises (a TrajstoreError: exit 2), never a "missing" difference (exit 1)
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2, default=str))
        return 0 if rep.ok else 1
    summ = rep.fields()
    stats = bool(args.pair)
    headers = ["field", "status", "steps", "values", "beyond tol", "max abs", "max rel"]
    if stats:
        headers += ["mean abs", "rmse", "p50 abs", "p90 abs", "p99 abs", "corr"]
    lines = []
    for name, f in summ.items():
        line = [name, f["status"], f["steps"], f["n"], f["n_exceed"], f["max_abs"], f["max_rel"]]
        if stats:
            line += [f.get("mean_abs"), f.get("rmse"), f.get("p50_abs"), f.get("p90_abs"), f.get("p99_abs"), f.get("corr")]
        lines.append(line)
    out.table(headers, lines, title=f"{rep.a} vs {rep.b}  (atol {rep.atol}, rtol {rep.rtol})")
    for name, f in summ.items():
        if f["first"] and name != "*":
            print(f"{name}: first beyond tolerance at {_where(f['first'])}")
    for how, steps in rep.how().items():
        print(f"{'step' if len(steps) == 1 else 'steps'} {format_ranges(runs(steps))}: {_HOW[how]}")
    _diverging(rep)
    first = rep.first_divergence
    if rep.identical:
        print("identical")
    elif rep.ok:
        print("within tolerance")
    else:
        print(f"first divergence ({first['status']}): {_where(first)}")
    return 0 if rep.ok else 1
