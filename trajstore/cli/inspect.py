"""``trajstore info`` and ``trajstore show``: what a dump holds (splits, steps, sizes, fields,
environment) and one trajectory of it as text (prompt, completion, segments, reward, versions).

The inspection modules these commands need are imported inside them (``trajstore --help`` starts
without them; ``info`` without torch)."""

from __future__ import annotations

import argparse
import json

from . import console as out
from ..base.text import format_ranges, human_bytes
from ..errors import ConfigError
from .registry import JSON, OVERRIDES, PATH, SPLIT, TOKENIZER, arg, command, fields

__all__ = ["cmd_info", "cmd_show"]


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
    t = trace_rows(row, tok, fields=fields(args), logprobs=args.logprobs)
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
