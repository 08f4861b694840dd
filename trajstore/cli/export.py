"""``trajstore export``: a dump's readable traces (prompt, completion, messages, reward, versions,
lengths) as JSON lines, to stdout or an ``-o`` file, or logged to a local Trackio project.

The trace and reading modules are imported when the command runs."""

from __future__ import annotations

import argparse
import sys

from . import console as out
from . import support as support
from ..base.text import parse_steps
from ..errors import ConfigError
from .registry import OVERRIDES, PATH, SPLIT, TOKENIZER, arg, command, fields

__all__ = ["cmd_export"]


@command("export", "readable traces (prompt, completion, messages, reward, versions, lengths)", PATH,
         arg("--format", choices=("jsonl", "trackio"), default="jsonl", dest="fmt",
             help="jsonl (default), or trackio: log to a local Trackio project (needs trajstore[trackio])"),
         arg("--project", help="Trackio project (default: the dump directory's name)"),
         arg("--run", dest="run_name", help="Trackio run name (default: Trackio's)"),
         TOKENIZER, arg("--max-per-step", type=int, metavar="K", help="at most K trajectories per step"),
         arg("--steps", help="steps to export, e.g. 0-9,12 (default: all)"),
         arg("-o", "--output", help="output file (default: stdout); written under a temporary name and renamed "
                                    "when complete"),
         arg("--include-rejected", action="store_true", help='also write {"rejected": true} records'),
         arg("--logprobs", action="store_true", help="add per-token log-probabilities"),
         SPLIT, *OVERRIDES)
def cmd_export(args: argparse.Namespace) -> int:
    from ..inspection.traces import dumps, load_tokenizer, traces
    from ..read.reader import Reader

    r = Reader(args.path, args.split)
    tok = load_tokenizer(args.tokenizer)
    want = parse_steps(args.steps, "--steps")
    steps = r.steps if want is None else [s for s in want if s in r.steps]
    if want is not None and not steps:
        raise ConfigError(f"--steps {args.steps}: none of these steps is in {args.path} split {r.split!r}")
    if args.fmt == "trackio":
        from ..inspection.trackio import export_trackio

        n, rejected = export_trackio(r, steps, tok, args.max_per_step, fields=fields(args),
                                     project=args.project or r.path.resolve().name, name=args.run_name,
                                     progress=lambda s: out.progress(s, "exporting"))
        print(f"logged {n} trajectories from {len(steps)} step(s) to Trackio; {rejected} rejected counted",
              file=sys.stderr)
        return 0
    n = rejected = 0
    with support.output_file(args.output) as f:  # -o: under its name only once complete
        for s in out.progress(steps, "exporting"):
            for t in traces(r, s, tok, args.max_per_step, fields=fields(args), logprobs=args.logprobs):
                if t["rejected"]:
                    rejected += 1
                    if not args.include_rejected:
                        continue
                else:
                    n += 1
                f.write(dumps(t) + "\n")
    print(f"exported {n} trajectories from {len(steps)} step(s); {rejected} rejected "
          f"{'included' if args.include_rejected else 'skipped'}", file=sys.stderr)
    return 0
