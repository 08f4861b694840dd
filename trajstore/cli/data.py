"""A dump's files: ``trajstore verify`` (every step file against its recorded SHA-256, exit 1 if one
is damaged), ``trajstore upgrade`` (an older layout moved to the current one) and ``trajstore import``
(another tool's dump converted into a trajstore dump).

The modules doing the work are imported when the command runs (``verify`` without torch)."""

from __future__ import annotations

import argparse
import json
import sys

from . import console as out
from .registry import JSON, PATH, arg, command

__all__ = ["cmd_verify", "cmd_upgrade", "cmd_import"]


# ----------------------------------------------------------------------------- verify
@command("verify", "check every step file against its recorded SHA-256 (exit 1 if one is damaged)", PATH,
         arg("--split", default=None, help="only this split (default: all)"),
         arg("--deep", action="store_true", help="also decode every step (slower)"), JSON)
def cmd_verify(args: argparse.Namespace) -> int:
    from ..inspection.verify import verify

    rep = verify(args.path, args.split, deep=args.deep)
    if args.json:
        print(json.dumps({"path": str(rep.path), "ok": rep.ok, "checked": rep.checked,
                          **{key: [{"split": s, "step": k, "reason": why} for (s, k), why in sorted(d.items())]
                             for key, d in (("damaged", rep.damaged), ("skipped", rep.skipped),
                                            ("incomplete", rep.incomplete))}}, indent=2))
    else:
        print(rep.summary())
    return 0 if rep.ok else 1


# ----------------------------------------------------------------------------- upgrade
@command("upgrade", "move a dump of an older layout to the current one (step files are not touched)", PATH, JSON)
def cmd_upgrade(args: argparse.Namespace) -> int:
    from ..store.upgrade import upgrade_layout

    moved = upgrade_layout(args.path)
    if args.json:
        print(json.dumps({"path": args.path, "moved": moved}, indent=2))
    else:
        print(f"{args.path}: moved {len(moved)} file(s) to the current layout" if moved else
              f"{args.path}: already of the current layout; nothing to do")
    return 0


# ----------------------------------------------------------------------------- import
@command("import", "convert another tool's dump (.pt folders; verl RolloutSkip, ROLL with --trust-pickle)",
         arg("src", help="the folder (or file) the framework wrote: .pt/.pth files, a verl RolloutSkip run, "
                         "a ROLL rollout-mock dump"),
         arg("dst", help="trajstore dump directory to write (created if missing)"),
         arg("--kind", choices=("pt", "verl", "roll"), help="source kind (default: detected from the files)"),
         arg("--trust-pickle", action="store_true",
             help="allow unpickling (verl gen_batch.dp, ROLL .pkl, .pt files torch.load(weights_only=True) "
                  "refuses). Unpickling runs code named by the file: only for files you made yourself"),
         arg("--split", default="train", help="split for files whose folder or name gives none (default: train)"),
         arg("--strict", action="store_true", help="stop with an error at the first file that cannot be imported "
                                                   "(default: skip it and report why)"),
         arg("--overwrite", action="store_true", help="replace steps already in DST"), JSON)
def cmd_import(args: argparse.Namespace) -> int:
    from ..inspection.importers import import_dump

    rep = import_dump(args.src, args.dst, kind=args.kind, trust_pickle=args.trust_pickle, split=args.split,
                      strict=args.strict, overwrite=args.overwrite, progress=lambda s: out.progress(s, "importing"))
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2))
    else:
        print(rep.summary())
    if not rep.imported:
        print(f"trajstore import: error: no step of {args.src} could be imported", file=sys.stderr)
        return 2
    return 0
