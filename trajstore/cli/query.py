"""``trajstore sql``: DuckDB SQL over a dump (one view per split), printed as a table, JSON lines or
CSV; a statement that writes is refused before anything runs.

DuckDB and the reading modules are imported when the command runs (without torch)."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from typing import Any

from . import console as out
from ..errors import ConfigError
from .registry import PATH, arg, command

__all__ = ["cmd_sql"]


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
