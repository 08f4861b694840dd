"""The ``trajstore`` command: look inside a dump without writing code.

    trajstore info PATH [--json]                   splits, steps, sizes, fields, environment
    trajstore show PATH --step N [--sample I] [--tokenizer T] [--logprobs]
    trajstore diff A B [--steps 0-9] [--fields f,g] [--atol X --rtol Y]
    trajstore diff A --pair logprobs old_logprobs [--mask loss_mask]
    trajstore sql PATH "SELECT step, avg(rewards) FROM train GROUP BY step"
    trajstore export PATH --format jsonl [--tokenizer T] [--max-per-step K] [-o FILE]
    trajstore verify PATH [--split S] [--deep] [--json]   checksums of every step (docs/RELIABILITY.md)
    trajstore import SRC DST [--kind pt|verl|roll] [--trust-pickle] [--strict]   other tools' dumps (docs/IMPORT.md)
    trajstore view PATH [PATH2] [--port N] [--tokenizer T] [--export FILE.html]   in the browser (trajstore[view])

Exit status: 0 success; 1 ``diff`` found a difference beyond tolerance, or ``verify`` a damaged
step; 2 an error (bad arguments, no such dump/step/field, a damaged file, a missing optional
package, an ``import`` that converted nothing or met a file that needs ``--trust-pickle``), with
one line on stderr (``--debug``: the traceback too); 130 interrupted (CTRL-C). ``PATH`` may name a
split folder or a step file of a dump (``_cli_support.locate``). ``--help``, ``info``, ``sql`` and
``verify`` (without ``--deep``) never import torch.

Adding a subcommand: write one function ``def cmd_x(args) -> int`` and register it with one
``@command("x", "help", arg(...), ...)`` line.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from typing import Any, Callable

from . import support as support

try:  # a CTRL-C while the command starts up: one line and exit 130, never a traceback (docs/CLI.md)
    from . import console as out
    from ..base.text import format_ranges, human_bytes, parse_steps, runs
    from ..errors import ConfigError, MissingDependencyError
except KeyboardInterrupt:
    raise SystemExit(support.interrupted(None)) from None

__all__ = ["main", "command", "arg"]

Command = Callable[[argparse.Namespace], int]
_COMMANDS: list[tuple[str, str, tuple, Command]] = []


def arg(*names: str, **kw: Any) -> tuple:
    """An argparse argument of a subcommand (same arguments as ``add_argument``)."""
    return names, kw


def command(name: str, help: str, *arguments: tuple) -> Callable[[Command], Command]:
    """Register ``fn(args) -> exit status`` as subcommand ``name``."""
    def deco(fn: Command) -> Command:
        _COMMANDS.append((name, help, arguments, fn))
        return fn
    return deco


PATH = arg("path", help="dump directory (holds trajstore.json), or one of its split folders or step files")
SPLIT = arg("--split", default=None, help="split to read (default: train, else the dump's only split; "
                                           "see docs/CLI.md for rank dumps)")
JSON = arg("--json", action="store_true", help="machine-readable JSON on stdout")
TOKENIZER = arg("--tokenizer", metavar="T", help="local tokenizer.json or HF model directory (no network)")
OVERRIDES = [arg(f"--{k}-field", dest=f"f_{k}", metavar="NAME", help=f"field holding the {k} (default: by name)")
             for k in ("tokens", "prompt", "completion", "mask", "reward", "versions", "logprobs")]


def _fields(args: argparse.Namespace) -> dict:
    return {k[2:]: v for k, v in vars(args).items() if k.startswith("f_") and v}


# ----------------------------------------------------------------------------- info
@command("info", "splits, steps, sizes, fields and environment of a dump", PATH,
         arg("--split", default=None, help="only this split (default: all)"),
         arg("--all-steps", action="store_true", help="list every step (default: the first and last 10)"), JSON)
def cmd_info(args: argparse.Namespace) -> int:
    from ..inspection.describe import describe, short
    from ..store.listing import ranks_text

    d = describe(args.path, args.split, progress=lambda s, name: out.progress(s, f"reading {name}"))
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    formats = sorted({v for sp in d["splits"].values() for v in sp["formats"]})
    print(f"dump {d['path']}  (layout {d['format_version']}, step format {', '.join(map(str, formats)) or '-'}, "
          f"trajstore {d['library_version']}, created {d['created']})")
    for name, sp in d["splits"].items():
        st = sp["steps"]
        out.heading(f"split {name}")
        rng = f"{st['first']}..{st['last']}" if st["count"] else "none"
        print(f"steps {rng}  count {st['count']}  gaps {format_ranges(st['gaps'])}")
        print(f"rows {sp['rows']}  tokens {sp['tokens'] if sp['tokens'] is not None else '-'}  "
              f"bytes {human_bytes(sp['bytes'])}")
        ranks = sorted({p["ranks"] for p in sp["per_step"] if "ranks" in p})
        if ranks:
            print(f"written by {', '.join(map(str, ranks))} ranks (one shard file per rank and step)")
        for inc in sp.get("incomplete", []):  # shards not all committed: not readable (docs/RELIABILITY.md)
            print(f"INCOMPLETE step {inc['step']}: {inc['ranks']} ranks, rank(s) "
                  f"{ranks_text(inc['missing'])} not committed; the step is not readable")
        for amb in sp.get("ambiguous", []):  # a whole file and shards, or shards of two world sizes
            print(f"AMBIGUOUS step {amb['step']}: {', '.join(amb['files'])}; keep the files of one writing")
        per = sp["per_step"]
        if len(per) > 20 and not args.all_steps:
            per = per[:10] + [{"step": f"... {len(per) - 20} more (--all-steps)"}] + per[-10:]
        out.table(["step", "rows", "tokens", "bytes", "meta"],
                  [[p["step"], p.get("rows", ""), p.get("tokens", ""), p.get("bytes", ""),
                    short(p["meta"]) if p.get("meta") else ""] for p in per],
                  title="per step")
        out.table(["field", "dtype", "kind", "shape", "steps"],
                  [[f["name"], f["dtype"] + (" (varies)" if f.get("varies") else ""), f["kind"],
                    "-" if f["shape"] is None else "[" + ", ".join(map(str, f["shape"])) + "]", f["steps"]]
                   for f in sp["fields"]], title="fields")
        if sp.get("columns"):  # the split's record: one Arrow type per column name (docs/FORMAT.md 3.11)
            out.table(["column", "arrow type"], [[k, v] for k, v in sp["columns"].items()],
                      title="columns of the split (one type each)")
    env = d["environment"] or {}
    out.table(["key", "value"], [[k, json.dumps(v) if isinstance(v, list | dict) else v] for k, v in env.items()],
              title="environment (of the process that created the dump)")
    return 0


# ----------------------------------------------------------------------------- show
@command("show", "one trajectory as text: prompt, completion, segments, reward, versions", PATH,
         arg("--step", type=int, help="step number (required unless PATH is a step file)"),
         arg("--sample", type=int, default=0, help="trajectory index in the step (default 0)"),
         TOKENIZER, arg("--logprobs", action="store_true", help="print per-token log-probabilities"),
         SPLIT, JSON, *OVERRIDES)
def cmd_show(args: argparse.Namespace) -> int:
    from ..inspection.describe import jsonable, short
    from ..inspection.traces import decode_ids, load_tokenizer, to_json, trace_rows
    from ..read.reader import Reader
    from ..read.tables import step_rows

    if args.step is None:
        raise ConfigError("show: give --step N (or a step file of the dump as PATH)")
    r = Reader(args.path, args.split)
    tok = load_tokenizer(args.tokenizer)
    all_rows = step_rows(r, args.step)
    if not 0 <= args.sample < len(all_rows):
        raise ConfigError(f"step {args.step} has {len(all_rows)} trajectories; --sample {args.sample} is out of range")
    row, meta = all_rows[args.sample], jsonable(r.meta(args.step))
    if row is None:
        if args.json:
            print(json.dumps({"step": args.step, "index": args.sample, "rejected": True}))
        else:
            print(f"step {args.step} trajectory {args.sample}: rejected (stored as None)")
        return 0
    t = trace_rows(row, tok, fields=_fields(args), logprobs=args.logprobs)
    if args.json:
        print(json.dumps({"step": args.step, "index": args.sample, "rejected": False, **to_json(t),
                          "meta": meta}, ensure_ascii=False))
        return 0
    head = [f"step {args.step}", f"trajectory {args.sample} of {len(all_rows)}"]
    if "reward" in t:
        head.append(f"reward {t['reward']}")
    if "lengths" in t:
        head.append("tokens " + ", ".join(f"{k} {v}" for k, v in t["lengths"].items()))
    if "versions" in t:
        v = t["versions"]
        head.append("versions " + (", ".join(f"{a}x{n}" for a, n in v) if isinstance(v, list) else str(v)))
    print("  |  ".join(head + ([f"meta {short(meta)}"] if meta else [])))
    if not t["segments"]:
        for k in ("prompt", "completion"):
            if k in t:
                out.block(k, t[k])
        if "prompt" not in t and "completion" not in t:
            print("(no token or text field found: use --tokens-field NAME)")
    for s in t["segments"]:
        body = s["text"] if "text" in s else " ".join(map(str, s["ids"].tolist()))
        out.block(f"{s['role']} ({s['tokens']} tokens)", body,
                  style={"model": "green", "prompt": "blue", "env": "yellow"}.get(s["role"], ""))
    if args.logprobs:
        lines = []
        for s in t["segments"]:
            lp = s.get("logprobs")
            for j, i in enumerate(s["ids"].tolist()):
                lines.append([s["pos"][0] + j, s["role"], i,
                              repr(decode_ids(tok, [i])) if tok is not None else "",
                              None if lp is None else float(lp[j])])
        if "logprobs_field" in t:
            out.table(["pos", "role", "id", "token", t["logprobs_field"]], lines, title="per-token log-probabilities")
        else:
            print("(no logprobs field found: use --logprobs-field NAME)")
    if t.get("fields"):
        out.table(["field", "value"], list(t["fields"].items()), title="other fields")
    return 0


# ----------------------------------------------------------------------------- diff
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


# ----------------------------------------------------------------------------- sql
@command("sql", "run DuckDB SQL over a dump: one view per split (train, val, ...), each row with its step",
         PATH, arg("query", help='e.g. "SELECT step, avg(rewards) FROM train GROUP BY step ORDER BY step"'),
         arg("--format", choices=("table", "json", "csv"), default="table", dest="fmt",
             help="output format (default table; plain columns when piped)"))
def cmd_sql(args: argparse.Namespace) -> int:
    from ..read.tables import check_query, duckdb_connect, explain_sql_error, read_only

    if not args.query.strip():
        raise ConfigError(f"the query is empty; give a statement such as \"SELECT count(*) FROM train\" "
                          f"(the views of a dump are its splits: trajstore info {args.path})")
    con = read_only(duckdb_connect(args.path), args.path)
    check_query(con, args.query, args.path)  # a query that writes is refused before anything runs
    import duckdb

    try:
        cur = con.execute(args.query)
    except duckdb.Error as e:
        raise ConfigError(explain_sql_error(con, e, args.path)) from None
    if cur is None or cur.description is None:  # a statement that returns no rows (a comment, SET ...)
        return 0
    cols = [d[0] for d in cur.description]
    data = cur.fetchall()
    narrow = [i for i, d in enumerate(cur.description) if str(d[1]).startswith(("FLOAT", "HALF"))]
    if narrow:  # DuckDB gives FLOAT (float32) values as float64: print them at their own precision
        from ..inspection.describe import plain
        import numpy as np

        def f32(v: Any) -> Any:
            return [f32(x) for x in v] if isinstance(v, list) else v if v is None else plain(np.float32(v))

        data = [tuple(f32(v) if i in narrow else v for i, v in enumerate(r)) for r in data]
    if args.fmt == "json":
        for r in data:
            print(json.dumps(dict(zip(cols, r)), default=str))
    elif args.fmt == "csv":
        w = csv.writer(sys.stdout)
        w.writerow(cols)
        w.writerows(data)
    else:
        out.table(cols, data)
    return 0


# ----------------------------------------------------------------------------- export
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

        n, rejected = export_trackio(r, steps, tok, args.max_per_step, fields=_fields(args),
                                     project=args.project or r.path.resolve().name, name=args.run_name,
                                     progress=lambda s: out.progress(s, "exporting"))
        print(f"logged {n} trajectories from {len(steps)} step(s) to Trackio; {rejected} rejected counted",
              file=sys.stderr)
        return 0
    n = rejected = 0
    with support.output_file(args.output) as f:  # -o: under its name only once complete
        for s in out.progress(steps, "exporting"):
            for t in traces(r, s, tok, args.max_per_step, fields=_fields(args), logprobs=args.logprobs):
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


# ----------------------------------------------------------------------------- view
@command("view", "look at a run in the browser: curves, step tables, coloured tokens, a diff of two dumps",
         PATH, arg("path2", nargs="?", metavar="PATH2", help="a second dump: the diff page compares the two"),
         SPLIT, TOKENIZER, arg("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)"),
         arg("--port", type=support.port, default=8000, help="port, 1-65535 (default: 8000)"),
         arg("--export", metavar="FILE.html", help="write one self-contained HTML file instead of serving"),
         arg("--steps", help="--export: the steps whose trajectories go in the file, e.g. 0-9,12 (default: the last)"),
         arg("--max-per-step", type=int, default=4, metavar="K", help="--export: trajectories per step (default: 4)"))
def cmd_view(args: argparse.Namespace) -> int:
    from ..view.pages import View

    try:
        from ..view import app, export
    except ImportError as e:
        raise MissingDependencyError(f"trajstore view needs the 'view' extra ({e.name}): "
                                     "pip install 'trajstore[view]'") from None
    v = View(args.path, args.split, args.tokenizer, other=args.path2)
    if args.path2 is not None:  # a second dump that does not open is an error now, not on the diff page
        from ..read.reader import Reader

        Reader(args.path2, v.split)
    if args.export:
        want = parse_steps(args.steps, "--steps")
        steps = None if want is None else [s for s in want if s in v.reader(None).steps]
        if want is not None and not steps:
            raise ConfigError(f"--steps {args.steps}: none of these steps is in {args.path} split {v.split!r}")
        try:
            f = export.export(v, args.export, steps, args.max_per_step)
        except OSError as e:
            raise ConfigError(f"--export {args.export}: cannot be written ({e.strerror or e}); check that its "
                              "folder exists and is writable") from None
        print(f"wrote {f} (opens with no network)")
        return 0
    sock = app.listen(args.host, args.port)  # bound (or a one-line error) before the line saying it serves
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"trajstore view: http://{host}:{sock.getsockname()[1]}/  (split {v.split}; Ctrl-C stops)", flush=True)
    app.serve(v, args.host, args.port, sock)
    return 0


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


# ----------------------------------------------------------------------------- entry point
def parser() -> argparse.ArgumentParser:
    from .._version import __version__

    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="on an error, print the traceback as well as the one-line message")
    p = support.Parser(prog="trajstore", description="Look inside trajstore dumps.", parents=[debug])
    p.commands = [c[0] for c in _COMMANDS]
    p.add_argument("--version", action="version", version=f"trajstore {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help, arguments, fn in _COMMANDS:
        sp = sub.add_parser(name, help=help, description=help, parents=[debug])
        for names, kw in arguments:
            sp.add_argument(*names, **kw)
        sp.set_defaults(_fn=fn, _parser=sp)
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments; an unknown one is the subcommand's usage error (``see trajstore show --help``)."""
    args, extra = parser().parse_known_args(argv)
    if extra:
        args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def run(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status: the
    command's, 2 for an error (one line on stderr), 130 when interrupted."""
    command = None
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        args = _parse(argv)
        command, debug = args.command, getattr(args, "debug", False)
        support.locate(args)
        with support.warnings_as_lines(command):
            return args._fn(args)
    except KeyboardInterrupt:
        return support.interrupted(command)
    except BrokenPipeError:  # e.g. piped into head
        sys.stderr.close()
        return 0
    except Exception as e:  # a TrajstoreError says what to do; anything else is named with its type
        return support.report_error(command, e, debug)


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point. Called without ``argv`` (as the installed ``trajstore``), it ends
    the process with ``os._exit`` once output is flushed: a command has nothing left to clean up,
    and skipping interpreter teardown keeps the exit status exactly the command's (native
    libraries' thread pools can abort during teardown). With ``argv`` it just returns the status."""
    if argv is not None:
        return run(argv)
    try:
        rc = run()
    except SystemExit as e:  # argparse: --help, --version, usage errors
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:  # between the command's end and here
        rc = support.interrupted(None)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
