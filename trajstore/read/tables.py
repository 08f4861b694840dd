"""Tabular views of a dump: one dict per trajectory, pandas DataFrames and DuckDB views.

``step_rows``: the trajectories of one step as dicts (``trajstore.format.rows``), the view that
``to_pandas``, ``traces``, ``diff`` and ``trajstore show`` share.

``to_pandas``: one row per trajectory with ``step`` and ``index`` (position in the batch)
columns (and ``rank``, the rank that wrote it, for steps written by several ranks); per-token fields hold the trajectory's own tokens as numpy arrays (bfloat16 as
float32), nested fields have dotted names, a rejected (``None``) trajectory is a row whose
``rejected`` column is True and whose fields are missing (NaN/None). A field named like one of those
columns of the frame's own (``index``: OpenRLHF's ``Experience.index``, ``rejected``, ``rank``) keeps
its values under ``<name>_field`` (``OWN``), so neither replaces the other.

``duckdb``: an in-memory DuckDB connection with one view per split (``train``, ``val``, ...)
over the split's step files (or over the one file of a Reader opened on a step file), every row carrying its ``step``;
a split whose name needs quotes has a second view that does not (``train-rank0``: ``train_rank0``), and the
rank splits of one split (``train-rank0``, ``train-rank1``...) a logical view (``train``) with a ``rank`` column. A
split written by N ranks as shard files (docs/FORMAT.md section 1) is one view whose shard rows carry their
``rank`` column (NULL for whole-step files): the view lists the files of complete steps only, so the shards
of a step whose other shards are not committed are not in it (a glob of ``*.parquet`` sees them). A view holds
exactly the steps a Reader reads (``_opened``: a step whose footer the Reader refuses is left out, with a warning),
each file handed to DuckDB by its literal name (``_literal``: no glob, no hive partitions). Columns are the stored Arrow
columns (docs/FORMAT.md): per-token fields are lists, nested fields have dotted names (quote
them: ``"a.b"``), JSON-valued fields are JSON strings, and bfloat16 / float16 values appear as
float32 numbers (as their raw uint16 bits / halffloat in step files of format versions 1 and 2:
use ``to_pandas`` for them). A step appended as a list of trajectory dicts whose
``attention_mask`` is ``[g, T]`` (AReaL's groups) has one row per trajectory, as in ``to_pandas``:
its per-token cells cut by the trajectory's mask row, other tensor cells split along their first
dimension, other fields repeated, and ``group`` (the element's index) where ``g > 1``.
"""

from __future__ import annotations

import difflib
import os
import re
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, FormatError, MissingDependencyError, TrajstoreError, TrajstoreWarning, warn
from ..format.spec import RUNS_ACTION, RUNS_COL
from ..store import listing, manifest, paths, remote, stepfile
from ..store.fs import is_remote, resolve
from ..store.regular import open_checked

if TYPE_CHECKING:  # optional extras, imported when used
    import duckdb
    import pandas as pd

__all__ = ["explain_sql_error", "step_rows", "to_pandas", "duckdb_connect", "read_only", "check_query", "OWN"]

OWN = ("step", "index", "rejected", "rank")  # to_pandas' own columns: a field of such a name is <name>_field


def step_rows(reader: Any, step: int) -> list[dict | None]:
    """The trajectories of ``step`` of ``reader`` (a Reader): one dict each, None for a rejected one.
    A TensorDict or DataProto-like step is read through its plain form (``format.containers``),
    the dict its spec describes."""
    from ..format.batch import containers  # the decoding side waits: `trajstore sql` runs without torch
    from ..format.codec.rows import rows

    return rows(containers.unwrap(reader.read(step))[0], reader.info(step)["batch"])


def to_pandas(reader: Any, step: int | None = None) -> pd.DataFrame:
    """The trajectories of ``step`` (None: every step) as a pandas DataFrame."""
    try:
        import pandas as pd
    except ImportError:
        raise MissingDependencyError("to_pandas needs pandas: pip install pandas") from None
    from .shards import ranks

    steps = reader.steps if step is None else [step]
    recs: list[dict] = []
    for s in steps:
        rows_, by = step_rows(reader, s), ranks(reader, s)
        for i, r in enumerate(rows_):
            rec = {"step": s, "index": i, "rejected": r is None}
            if by is not None and len(by) == len(rows_):
                rec["rank"] = by[i]
            if r is not None:
                rec.update((f"{k}_field" if k in OWN else k, v) for k, v in r.items())
            recs.append(rec)
    if not recs:
        return pd.DataFrame({"step": pd.Series(dtype="int64"), "index": pd.Series(dtype="int64"),
                             "rejected": pd.Series(dtype="bool")})
    return pd.DataFrame.from_records(recs)


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _lit(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def duckdb_connect(path: Any, con: Any = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection (new in-memory one unless ``con``) with one view per split of the dump at
    ``path`` (a directory or a Reader)."""
    try:
        import duckdb
    except ImportError:
        raise MissingDependencyError("SQL over a dump needs duckdb: pip install 'trajstore[cli]'") from None
    root = resolve(getattr(path, "path", path), "sql")
    if root.is_file() and getattr(path, "steps", None) is not None:  # a Reader of one step file
        groups = {path.split: _opened(root.parent, [(s, [root]) for s in path.steps])}
    else:
        manifest.read_manifest(root)
        groups = {split: _files(root / split) for split in listing.list_splits(root)}
    con = con if con is not None else duckdb.connect()
    groups = {split: files for split, files in groups.items() if files}
    for split, files in groups.items():
        if is_remote(root):  # DuckDB scans a pyarrow dataset of the objects (store/remote.py)
            con.register(f"__trajstore_{split}", remote.dataset([f for f, _ in files]))
            con.execute(f"CREATE OR REPLACE VIEW {_quote(split)} AS SELECT * FROM {_quote('__trajstore_' + split)}")
            continue
        by_select: dict[str | None, list[str]] = {}  # files whose rows are trajectories: None
        for f, doc in files:
            _check_footer(f)
            by_select.setdefault(_group_select(doc), []).append(_literal(f))
        parts = []
        for sel, fs in by_select.items():
            lst = "[" + ", ".join(_lit(f) for f in fs) + "]"
            parts.append(f"SELECT * FROM read_parquet({lst}, {_OPTIONS})" if sel is None else
                         sel.replace(_FILES, lst))
        try:
            con.execute(f"CREATE OR REPLACE VIEW {_quote(split)} AS " + " UNION ALL BY NAME ".join(parts))
        except duckdb.Error as e:
            raise FormatError(f"dump {root} split {split!r}: DuckDB cannot open its step files ({e})") from None
    _aliases(con, list(groups))
    return con


QUERIES = ("SELECT", "EXPLAIN")  # DuckDB statement types of a query (WITH, DESCRIBE, SHOW, SUMMARIZE are SELECT)


def read_only(con: Any, path: Any) -> Any:
    """``con`` (of ``duckdb_connect``) confined to the dump: DuckDB reads files of the dump's folder
    only (``allowed_directories``, ``enable_external_access=false``), loads no extension, and its
    settings are locked, so no statement can widen that. Pair it with ``check_query``: a query that
    writes (``COPY ... TO``, ``CREATE``, ``DROP``) is refused before it runs."""
    root = resolve(getattr(path, "path", path), "sql")
    root = root.parent if not is_remote(root) and root.is_file() else root  # a Reader of one step file
    dirs = [] if is_remote(root) else sorted({str(root.absolute()) + "/", str(root.resolve()) + "/"})
    dirs = sorted({*dirs, *(_GLOB.sub(r"[\1]", d) for d in dirs)})  # as ``_literal`` names the files in it
    con.execute("SET allowed_directories = [" + ", ".join(_lit(d) for d in dirs) + "]")
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def check_query(con: Any, query: str, path: Any) -> list[str]:
    """The statements of ``query``; ConfigError naming the first one that is not a query (it would write
    a file, or change the views or settings): inspection reads the dump and nothing else."""
    import duckdb

    try:
        statements = con.extract_statements(query)
    except duckdb.Error as e:
        raise ConfigError(explain_sql_error(con, e, path)) from None
    for st in statements:
        if st.type.name not in QUERIES:
            raise ConfigError(f"{st.query.strip()[:80]!r} is a {st.type.name} statement; trajstore sql runs "
                              f"queries only (SELECT, WITH, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN) and never writes "
                              f"a file or changes the dump's views; for more, open the dump's files with DuckDB "
                              f"yourself (Reader(path).duckdb() in Python)")
    return [st.query for st in statements]


_MISSING_TABLE = re.compile(r"Table with name (\S+) does not exist", re.I)


def explain_sql_error(con: Any, error: Exception, path: Any) -> str:
    """A DuckDB error on a query over the dump's views, on one line: DuckDB's first line, its column
    candidates (they are the dump's columns), and instead of its table guesses (DuckDB's own catalog:
    ``pg_tablespace``...) the views of the dump, the closest first."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    head = lines[0] if lines else type(error).__name__
    extra = [ln for ln in lines[1:] if ln.lower().startswith("candidate bindings")]
    views = [r[0] for r in con.execute(
        "SELECT view_name FROM duckdb_views() WHERE NOT internal ORDER BY view_name").fetchall()]
    m = _MISSING_TABLE.search(head)
    if m:
        close = difflib.get_close_matches(m.group(1).strip('"').lower(), [v.lower() for v in views], n=1)
        if close:
            extra.append(f"did you mean {next(v for v in views if v.lower() == close[0])}?")
    listed = ", ".join(views) if views else "none (no split has a readable step)"
    return f"SQL error: {head}{''.join(' ' + e for e in extra)} (views of dump {path}: {listed})"


SQL_FOOTER_BYTES = 16 << 20  # the largest Parquet footer handed to DuckDB


def _check_footer(f: str) -> None:
    """FormatError for a local step file whose Parquet footer is larger than ``SQL_FOOTER_BYTES``:
    DuckDB holds several copies of a footer's strings per thread, and a failed allocation there
    aborts the process (a forged 60 MB metadata string under a 3 GiB address-space limit) instead
    of raising. A footer trajstore writes is far smaller (its description and schema: KBs)."""
    fd, st = open_checked(f, "the step file")
    try:
        tail = os.pread(fd, 8, max(0, st.st_size - 8))
    finally:
        os.close(fd)
    n = int.from_bytes(tail[:4], "little") if len(tail) == 8 and tail[4:] == b"PAR1" else 0
    if n > SQL_FOOTER_BYTES:
        raise FormatError(f"{f}: its Parquet footer holds {n} bytes, over the {SQL_FOOTER_BYTES} bytes trajstore "
                          "gives DuckDB (trajstore.tables.SQL_FOOTER_BYTES); a footer trajstore writes is far "
                          "smaller: the file is damaged or hostile; move it out of the split (or read the other "
                          "steps with trajstore.Reader)")


def _files(d: Any) -> list[tuple[Any, dict]]:
    """The files of the split's readable steps (whole step files, and the shards of complete steps) with
    their descriptions: those of ``_opened``."""
    ls = listing.scan(d)
    return _opened(d, [(s, listing.step_files(d, ls, s)) for s in ls.steps if s not in ls.ambiguous])


def _opened(d: Any, steps: list[tuple[int, list]]) -> list[tuple[Any, dict]]:
    """``(file, description)`` of each file of ``steps`` (step, its files) whose footer the Reader accepts
    (``stepfile.open_step``: a trajstore description of a known format version, of the step its name says,
    that fits the file's columns), so a view holds exactly the steps a Reader reads. A step with a refused file (a
    copy of another step planted under a new name, a damaged footer) is left out of the view whole, with a
    ``TrajstoreWarning`` naming the file and why (``trajstore verify`` reports it too). The decode budget is
    not applied: DuckDB reads the columns itself, within its own ``memory_limit``."""
    out = []
    for s, fs in steps:
        try:
            out += [(f, stepfile.open_step(f, s, budget=False).doc) for f in fs]
        except (TrajstoreError, OSError) as e:
            out = [(f, doc) for f, doc in out if f not in fs]
            warn(f"{e}; step {s} is left out of the SQL views, as a Reader refuses it", TrajstoreWarning)
    return out


_GLOB = re.compile(r"([][*?])")
# every file named by itself: no hive partitions read from a folder named `lr=0.1` (an extra column)
_OPTIONS = "union_by_name = true, hive_partitioning = false"


def _literal(f: Any) -> str:
    """Local step file ``f`` as a name DuckDB reads literally: absolute (no ``~`` expansion), and the glob
    characters ``[ ] * ?`` each in a class of its own (``runs/run[1]`` would also match ``runs/run1``)."""
    return _GLOB.sub(r"[\1]", os.path.abspath(f))


def _ident(name: str, reserved: set[str]) -> str:
    """``name`` as an SQL identifier that needs no quotes: other characters than ``[A-Za-z0-9_]`` become
    ``_``, a leading digit gets a ``_`` before it, a reserved keyword (``reserved``) a ``_`` after it."""
    v = re.sub(r"[^A-Za-z0-9_]", "_", name)
    v = "_" + v if v[:1].isdigit() else v
    return v + "_" if v.lower() in reserved else v


def _aliases(con: Any, splits: list[str]) -> None:
    """Beside each split's view (its exact name), a view that needs no quotes where the name does
    (``train-rank0``: ``train_rank0``), and one logical view per split dumped by several ranks
    (``train``: the rows of ``train-rank0``, ``train-rank1``... with their ``rank``) where no split
    or view has that name yet. View names are case-insensitive in DuckDB; a name already taken
    gets ``_2``, ``_3``... (splits in sorted order; docs/CLI.md)."""
    used = {s.lower() for s in splits}
    reserved = {r[0].lower() for r in con.execute(
        "SELECT keyword_name FROM duckdb_keywords() WHERE keyword_category = 'reserved'").fetchall()}
    ranks: dict[str, list[tuple[int, str]]] = {}
    for split in sorted(splits):
        if m := paths.RANK_RE.match(split):
            ranks.setdefault(m.group(1), []).append((int(m.group(2)), split))
        v = base = _ident(split, reserved)
        if v == split:
            continue
        n = 2
        while v.lower() in used:
            v, n = f"{base}_{n}", n + 1
        used.add(v.lower())
        con.execute(f"CREATE OR REPLACE VIEW {v} AS SELECT * FROM {_quote(split)}")
    for name, parts in sorted(ranks.items()):
        v = _ident(name, reserved)
        if v.lower() in used or any("rank" in {c.lower() for c in _columns(con, s)} for _, s in parts):
            continue  # a split of that name (or a stored field named rank): the rank views alone
        used.add(v.lower())  # ranks storing one field with types DuckDB cannot unify fail when it is queried
        con.execute(f"CREATE OR REPLACE VIEW {v} AS " + " UNION ALL BY NAME ".join(
            f"SELECT *, CAST({k} AS INTEGER) AS rank FROM {_quote(s)}" for k, s in sorted(parts)))


def _columns(con: Any, view: str) -> list[str]:
    return [d[0] for d in con.execute(f"SELECT * FROM {_quote(view)} LIMIT 0").description]


_FILES = "\x00files\x00"  # where _group_select's SELECT takes its file list (no column name has a NUL)


def _group_select(doc: dict) -> str | None:
    """For a step file (its description ``doc``) of a list batch whose elements have an ``attention_mask``
    cell (AReaL's episodes ``[1, T]`` and groups ``[g, T]``): a SELECT (``_FILES`` to fill in) with one
    row per trajectory (the ``__shape__`` columns stay the stored element's); None for any other file (its
    rows are trajectories already)."""
    spec = doc.get("batch") if isinstance(doc, dict) else None
    elem = spec.get("elem") if isinstance(spec, dict) and spec.get("t") == "seq" else None
    keys = elem.get("keys") if isinstance(elem, dict) and elem.get("t") == "struct" else None
    keys = [k for k in keys if isinstance(k, list) and len(k) == 2] if isinstance(keys, list) else []
    cells = {k: (n["col"], n["shape_col"]) for k, n in keys if isinstance(n, dict) and n.get("t") == "cell"
             and isinstance(n.get("col"), str) and isinstance(n.get("shape_col"), str)}
    if "attention_mask" not in cells or {"group", "__t", "file_row_number"} & {k for k, _ in keys}:
        return None
    q = _quote
    (mc, ms), t = map(q, cells["attention_mask"]), '"__t"'
    grouped = f"len({ms}) = 2"  # a [g, T] mask (g = 1 for an episode); a rejected row has none
    g = f"(CASE WHEN {grouped} THEN {ms}[1] ELSE 1 END)"
    mask = f"list_slice(CAST({mc} AS BOOLEAN[]), {t} * {ms}[2] + 1, ({t} + 1) * {ms}[2])"
    runs = {k: q(n["runs"]) for k, n in keys if isinstance(n, dict) and n.get("t") == "cell"
            and n.get("runs") in (RUNS_COL, RUNS_ACTION)}
    rc = q(RUNS_COL)
    if runs:  # a row stored by runs keeps only valid mask entries: trajectory t's mask from its run
        mask = (f"(CASE WHEN {rc} IS NOT NULL THEN list_transform(range({ms}[2]), lambda x: x >= {rc}[{t} + 1] AND "
                f"x < {rc}[{t} + 1] + {rc}[{g} + {t} + 1]) ELSE {mask} END)")
    exprs = []
    for k, (c, sc) in cells.items():
        n = f"(len({q(c)}) // {g})"
        row = f"list_slice({q(c)}, {t} * {n} + 1, ({t} + 1) * {n})"  # trajectory t's part of [g, ...]
        unpadded = ""
        if k in runs:  # a group stored by runs (docs/FORMAT.md 3.10): trajectory t's run, already unpadded
            rc = runs[k]
            w = f"(len({q(c)}) // greatest(list_sum(list_slice({rc}, {g} + 1, 2 * {g})), 1))"
            at = f"coalesce(list_sum(list_slice({rc}, {g} + 1, {g} + {t})), 0)"
            unpadded = (f"WHEN {grouped} AND {rc} IS NOT NULL THEN list_slice({q(c)}, {at} * {w} + 1, "
                        f"({at} + {rc}[{g} + {t} + 1]) * {w}) ")
        exprs.append(f"CASE {unpadded}WHEN {grouped} AND {q(sc)} = {ms} THEN list_where({row}, {mask}) "
                     f"WHEN {grouped} AND {q(sc)}[1] = {ms}[1] THEN {row} ELSE {q(c)} END AS {q(c)}")
    drop = ", ".join([t, '"file_row_number"'] + [q(c) for c, _ in cells.values()])
    return (f"SELECT * EXCLUDE ({drop}), CASE WHEN {g} > 1 THEN \"file_row_number\" END AS \"group\", "
            + ", ".join(exprs) + f" FROM (SELECT *, unnest(range({g})) AS {t} FROM "
            f"read_parquet({_FILES}, {_OPTIONS}, file_row_number = true))")
