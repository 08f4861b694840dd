"""The split's record of its column types, ``_trajstore/<split>/columns.json`` (docs/FORMAT.md 3.11).

The writer fits every step to it (``format.columns.fit``) and records a step's new columns there
*before* committing the step, so every committed step's columns are in the record (a step that
then fails leaves names it never used: harmless, they only make later steps move sooner). Several
writers of one split (the N ranks writing shards of its steps, docs/FORMAT.md section 1) share the
record: a writer adding columns re-reads it and saves the union under an exclusive lock
(``fcntl.flock`` on the folder of the record), so no writer's columns are lost and a name keeps one type. A
writer that opens a split loads the record; where there is none (a dump of trajstore before
0.2, or a record removed) it rebuilds it from the footers of the committed steps, in step order
(the first step's type of a name wins)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from ..format.file.columns import fit, type_name
from ..format.spec import STEP_COLUMN
from . import listing, paths
from .files import fsync, fsync_dir, stale_temps
from .fs import is_remote, source
from .regular import read_small

__all__ = ["NAME", "SplitColumns", "load", "save", "read"]

NAME = "columns.json"
VERSION = 1
log = logging.getLogger("trajstore.writer")


def read(split_dir: Path) -> dict[str, str] | None:
    """The recorded column types of a split (name -> Arrow type), or None without a readable record."""
    for d in paths.places(split_dir):
        try:
            doc = json.loads(read_small(d / NAME, "the split's column record"))
        except FileNotFoundError:
            continue
        except (OSError, ValueError, RecursionError):  # FormatError (store/regular.py) included: rebuilt
            return None
        cols = doc.get("columns") if isinstance(doc, dict) and doc.get("version") == VERSION else None
        if isinstance(cols, dict) and all(type(k) is str and type(v) is str for k, v in cols.items()):
            return dict(cols)
        return None
    return None


def load(split_dir: Path, clean: bool = True) -> dict[str, str]:
    """The split's column types for a writer: the record, else rebuilt from the step files. ``clean``:
    remove temporaries of dead writers first (not by a rank's writer: other ranks may be on other hosts)."""
    side = paths.side_dir(split_dir)
    for n in stale_temps(side, f".{NAME}.tmp-") if clean else ():
        (side / n).unlink(missing_ok=True)
    cols = read(split_dir)
    if cols is not None:
        return cols
    cols = {}
    listed = listing.scan(split_dir)
    for step in listed.steps:
        try:
            schemas = [pq.read_schema(source(f)) for f in listing.step_files(split_dir, listed, step)]
        except Exception as e:  # noqa: BLE001 - a damaged step: its readers report it
            log.warning("trajstore: %s: step %d's columns not read for the split's record (%s)", split_dir, step, e)
            continue
        for f in (f for schema in schemas for f in schema):
            if f.name != STEP_COLUMN:
                cols.setdefault(f.name, type_name(f.type))
    if cols:
        save(split_dir, cols)
    return cols


def save(split_dir: Path, cols: dict[str, str]) -> None:
    """Replace the record atomically (temporary, fsync, rename) with ``cols``."""
    side = paths.side_dir(split_dir)
    if is_remote(side):  # one PUT: the record is replaced whole
        side.store.put((side / NAME).key, json.dumps({"version": VERSION, "columns": cols}, indent=1).encode(),
                       create=False)
        return
    side.mkdir(parents=True, exist_ok=True)
    tmp = side / f".{NAME}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        tmp.write_text(json.dumps({"version": VERSION, "columns": cols}, indent=1))
        fsync(tmp)
        os.replace(tmp, side / NAME)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(side)


@contextlib.contextmanager
def _locked(split_dir: Path):
    """An exclusive lock on the split's record across processes: ``flock`` on the folder holding it
    (released when its holder dies). Object storage has no lock: there the record is one PUT and the
    ranks' writers race (docs/RELIABILITY.md, object storage)."""
    side = paths.side_dir(split_dir)
    if is_remote(side):
        yield
        return
    side.mkdir(parents=True, exist_ok=True)
    fd = os.open(side, os.O_RDONLY)  # the folder itself: no lock file to clean up
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class SplitColumns:
    """A writer's view of its split's column types: ``fit`` a step's table to them (thread-safe),
    recording the step's new columns before the caller commits it."""

    def __init__(self, split_dir: Path, clean: bool = True) -> None:
        self.dir = split_dir
        self.types = load(split_dir, clean)
        self._lock = threading.Lock()
        self._warned: set[tuple[str, str]] = set()  # (column, its other name) logged once

    def fit(self, step: int, table: Any) -> Any:
        """``table`` with one type per column name in the split (docs/FORMAT.md 3.11): a column
        whose type the split holds another of moves to a name of its own (logged once per column
        and name); new columns are saved to the record now, before the step is committed."""
        with self._lock:
            for k, v in (read(self.dir) or {}).items():  # what other writers of the split recorded since
                self.types.setdefault(k, v)
            fitted, moved, types = fit(table, self.types)
            if any(k not in self.types for k in types):
                with _locked(self.dir):  # other writers (ranks) of the split: re-read, fit, save the union
                    for k, v in (read(self.dir) or {}).items():
                        self.types.setdefault(k, v)
                    fitted, moved, types = fit(table, self.types)
                    new = {k: v for k, v in types.items() if k not in self.types}
                    if new:
                        save(self.dir, {**self.types, **new})
                        self.types.update(new)
            table = fitted
            warn = [(old, name) for old, name in moved.items() if (old, name) not in self._warned]
            self._warned.update(warn)
        for old, name in warn:
            log.warning("trajstore: step %d of %s: column %r is %s here but %s in earlier steps of the split; "
                        "stored as %r (trajstore reads it as the same field; SQL readers see %r NULL in this "
                        "step: docs/FORMAT.md 3.11)", step, self.dir, old, types[name], self.types[old], name, old)
        return table
