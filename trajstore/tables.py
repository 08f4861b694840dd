"""Tabular views of a dump: one dict per trajectory, pandas DataFrames and DuckDB views.

``step_rows``: the trajectories of one step as dicts (``trajstore.format.rows``), the view that
``to_pandas``, ``traces``, ``diff`` and ``trajstore show`` share.

``to_pandas``: one row per trajectory with ``step`` and ``index`` (position in the batch)
columns; per-token fields hold the trajectory's own tokens as numpy arrays (bfloat16 as
float32), nested fields have dotted names, a rejected (``None``) trajectory is a row whose
``rejected`` column is True and whose fields are missing (NaN/None).

``duckdb``: an in-memory DuckDB connection with one view per split (``train``, ``val``, ...)
over the split's step files (or over the one file of a Reader opened on a step file), every row carrying its ``step``. Columns are the stored Arrow
columns (docs/FORMAT.md): per-token fields are lists, nested fields have dotted names (quote
them: ``"a.b"``), JSON-valued fields are JSON strings, and bfloat16 values appear as their raw
uint16 bits (use ``to_pandas`` for them).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import FormatError, MissingDependencyError
from .format import containers
from .format.rows import rows
from .store import paths

if TYPE_CHECKING:  # optional extras, imported when used
    import duckdb
    import pandas as pd

__all__ = ["step_rows", "to_pandas", "duckdb_connect"]


def step_rows(reader: Any, step: int) -> list[dict | None]:
    """The trajectories of ``step`` of ``reader`` (a Reader): one dict each, None for a rejected one.
    A TensorDict or DataProto-like step is read through its plain form (``format.containers``),
    the dict its spec describes."""
    return rows(containers.unwrap(reader.read(step))[0], reader.info(step)["batch"])


def to_pandas(reader: Any, step: int | None = None) -> pd.DataFrame:
    """The trajectories of ``step`` (None: every step) as a pandas DataFrame."""
    try:
        import pandas as pd
    except ImportError:
        raise MissingDependencyError("to_pandas needs pandas: pip install pandas") from None
    steps = reader.steps if step is None else [step]
    recs: list[dict] = []
    for s in steps:
        for i, r in enumerate(step_rows(reader, s)):
            rec = {"step": s, "index": i, "rejected": r is None}
            if r is not None:
                rec.update(r)
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
    root = Path(getattr(path, "path", path))
    if root.is_file() and getattr(path, "steps", None) is not None:  # a Reader of one step file
        groups = {path.split: [str(root)]}
    else:
        paths.read_manifest(root)
        groups = {split: [str(root / split / paths.step_name(s)) for s in paths.list_steps(root / split)]
                  for split in paths.list_splits(root)}
    con = con if con is not None else duckdb.connect()
    for split, files in groups.items():
        if not files:
            continue
        lst = "[" + ", ".join(_lit(f) for f in files) + "]"
        try:
            con.execute(f"CREATE OR REPLACE VIEW {_quote(split)} AS "
                        f"SELECT * FROM read_parquet({lst}, union_by_name = true)")
        except duckdb.Error as e:
            raise FormatError(f"dump {root} split {split!r}: DuckDB cannot open its step files ({e})") from None
    return con
