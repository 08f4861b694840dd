"""The per-split index of per-trajectory columns (docs/FORMAT.md section 6).

``Reader.column("rewards", steps)`` would open every step file (a footer parse each); the index
keeps the plain per-trajectory fields of many steps (one primitive value per trajectory:
``rewards``, ``seq_len``...) in a few immutable *segments* (Parquet files),
``<dump>/_trajstore/<split>/index/steps_<first>-<last>.<hex>.index`` (not named ``*.parquet``: a glob
of the dump's step files must not reach them); a dump of layout 1 keeps them, and gets new ones, in
``<split>/_index/steps_<first>-<last>.<hex>.parquet``, and readers look in both places.

* :class:`Collector` (writer side, this module): after a step is committed its indexable columns,
  and the per-trajectory digests ``trajstore view`` plots (``store/digest.py``), are kept in memory
  with the step file's identity ``(st_ino, st_size, st_mtime_ns)``, and written as a segment every
  ``INDEX_EVERY`` steps, on ``flush()`` and on ``close()``, its SHA-256 in a sidecar
  ``steps_<first>-<last>.<hex>.sha256`` beside it (written first). Best effort: a failure is logged
  and its rows dropped, never raised into ``append``.
* ``store/segments.py``'s ``Index`` (reader side): a step's value comes from a segment only when the
  segment's bytes match its sidecar and the step file's current identity is the recorded one; every
  other step is read from its file. A damaged, unchecked or inconsistent segment is ignored with a
  warning.
* A writer of one rank's shards (docs/FORMAT.md 1.2) writes segments of its own shard files,
  marked ``"shard": [rank, world_size]``; a logical step's value is its N shards' values joined in
  rank order, taken from the index only when every shard is indexed and current. Each writer's
  segments have names of their own (a random part, written by ``link``), so the N writers of a split
  never replace each other's.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..format import dtypes as dt
from ..format.spec import is_dict_batch, is_plain_sample
from . import digest, files, listing, paths
from .checksums import SUM_SUFFIX, file_sha256, sum_line

DIR = "_index"  # layout 1: in the split folder
SIDE_DIR = "index"  # layout 2: in the split's side folder (paths.side_dir)
VERSION = 1
KEY = b"trajstore.index"
INDEX_EVERY = 256  # steps per segment (fewer on flush/close, or when the indexed fields change)
INDEX_MAX_ROWS = 1 << 22  # ...or fewer when they hold this many trajectories (bounds the memory kept)
SEGMENT_RE = re.compile(r"^steps_([0-9]{8,})-([0-9]{8,})\.[0-9a-f]{8}\.(?:parquet|index)$")
SUM_RE = re.compile(r"^steps_([0-9]{8,})-([0-9]{8,})\.[0-9a-f]{8}\.sha256$")  # a segment's SHA-256
RESERVED = ("step", "row")  # the segment's own columns: a field stored under either name is not indexed
DERIVED = "~"  # digest columns are named ~0, ~1, ... (a step with a field column named so keeps none)

wlog = logging.getLogger("trajstore.writer")
rlog = logging.getLogger("trajstore.reader")


def fields(spec: Any) -> list[list]:
    """``[[name, node], ...]``: the top-level plain per-trajectory tensor fields of a step spec."""
    if not is_dict_batch(spec):
        return []
    return [[k, n] for k, n in spec["keys"] if is_plain_sample(n) and n["col"] not in RESERVED]


def _place(split_dir: Path) -> tuple[Path, str]:
    """The folder new segments of ``split_dir`` go to, and their suffix."""
    side = paths.side_dir(split_dir)
    return (split_dir / DIR, "parquet") if side == split_dir else (side / SIDE_DIR, "index")


def dirs(split_dir: Path) -> list[Path]:
    """The folders that may hold segments of ``split_dir``: its side folder's, then layout 1's."""
    side = paths.side_dir(split_dir)
    return [split_dir / DIR] if side == split_dir else [side / SIDE_DIR, split_dir / DIR]


def sum_of(segment: Path) -> Path:
    """The sidecar holding the SHA-256 of ``segment`` (its name with ``.sha256`` for its suffix)."""
    return segment.with_suffix(SUM_SUFFIX)


def _ident(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


# ----------------------------------------------------------------------------- writer side
class Collector:
    """Index rows of the steps a Writer committed, written out as segments (thread-safe)."""

    def __init__(self, split_dir: Path, split: str, shard: tuple[int, int] | None = None):
        self.dir, self.split, self.shard = split_dir, split, shard
        self._lock = threading.Lock()
        self._sig: str | None = None  # the indexed fields and digests (JSON) of the rows kept
        self._fields: tuple = ([], [])  # ([[name, node], ...], [[column, what, [field, ...]], ...])
        self._rows: dict[int, tuple] = {}  # step -> (rows, identity, {col: pa.Array})

    def take(self, step: int, table: pa.Table) -> tuple | None:
        """The indexable columns of the step's encoded table, copied (the table may view the
        caller's tensors, which may change once the step is written), and its digests
        (``store/digest.py``, new arrays); None if there are none."""
        try:
            doc = json.loads(table.schema.metadata[b"trajstore"])
            fs = fields(doc.get("batch"))
            cols = {}
            for _, node in fs:
                a = table.column(node["col"]).combine_chunks()
                if a.type != dt.arrow_type(node["dtype"]) or a.null_count or len(a) != table.num_rows:
                    return None
                cols[node["col"]] = pa.array(a.to_numpy(zero_copy_only=False).copy(), type=a.type)
            try:
                dig = digest.derive(doc, table)
            except Exception as e:  # noqa: BLE001 - the fields are still indexed
                wlog.warning("trajstore: step %d of %s: no run-page digests in the index (%s: %s)", step,
                             self.dir, type(e).__name__, e)
                dig = {}
            names = [f"{DERIVED}{i}" for i in range(len(dig))]
            if set(names) & set(cols):
                dig, names = {}, []  # a field column named like a digest column: no digests
            derived = []
            for c, ((what, by), a) in zip(names, dig.items()):
                derived.append([c, what, list(by)])
                cols[c] = pa.array(np.asarray(a, dtype=digest.WHAT[what]))
            sig = json.dumps([fs, derived], sort_keys=True)
            return (sig, (fs, derived), table.num_rows, cols) if fs or derived else None
        except Exception as e:  # noqa: BLE001 - the index is advisory: never fail the step
            wlog.warning("trajstore: step %d of %s left out of the index (%s: %s); Reader.column reads "
                         "it from its file", step, self.dir, type(e).__name__, e)
            return None

    def add(self, step: int, taken: tuple | None, before: os.stat_result, final: Path) -> None:
        """Keep ``taken`` (from :meth:`take`) for ``step``, just committed as ``final`` from a
        temporary whose stat was ``before``; writes a segment when ``INDEX_EVERY`` steps are kept."""
        try:
            ident = _ident(os.stat(final))
            out = []
            with self._lock:
                self._rows.pop(step, None)  # an earlier write of this step: its file is gone
                if taken is None or ident != _ident(before):
                    return  # nothing to index, or the file was replaced already by someone else
                sig, fs, n, cols = taken
                if sig != self._sig and self._rows:
                    out.append(self._swap())  # one segment holds one set of fields
                self._sig, self._fields = sig, fs
                self._rows[step] = (n, ident, cols)
                if len(self._rows) >= INDEX_EVERY or sum(r[0] for r in self._rows.values()) >= INDEX_MAX_ROWS:
                    out.append(self._swap())
            for fs, rows in out:
                self._write(fs, rows)
        except Exception as e:  # noqa: BLE001 - see take
            wlog.warning("trajstore: step %d of %s left out of the index (%s: %s)", step, self.dir,
                         type(e).__name__, e)

    def flush(self) -> None:
        """Write the kept rows as a segment (if any)."""
        try:
            with self._lock:
                out = self._swap() if self._rows else None
            if out:
                self._write(*out)
        except Exception as e:  # noqa: BLE001 - see take
            wlog.warning("trajstore: index rows of %s dropped (%s: %s)", self.dir, type(e).__name__, e)

    def _swap(self) -> tuple[tuple, dict]:
        out, self._rows, self._sig = (self._fields, self._rows), {}, None
        return out

    def _write(self, what: tuple, rows: dict) -> None:
        steps = sorted(rows)
        fs, derived = what
        try:
            counts = np.array([rows[s][0] for s in steps], dtype=np.int64)
            starts = np.cumsum(counts) - counts
            arrays = {"step": pa.array(np.repeat(np.array(steps, dtype=np.int64), counts)),
                      "row": pa.array((np.arange(counts.sum()) - np.repeat(starts, counts)).astype(np.int32))}
            for col in [node["col"] for _, node in fs] + [d[0] for d in derived]:
                arrays[col] = pa.concat_arrays([rows[s][2][col] for s in steps])
            meta = {"version": VERSION, "split": self.split, "fields": fs,
                    "steps": [[s, rows[s][0], *rows[s][1]] for s in steps]}
            if derived:
                meta["derived"] = derived
            if self.shard is not None:
                meta["shard"] = list(self.shard)
            table = pa.table(arrays).replace_schema_metadata({KEY: json.dumps(meta)})
            d, suffix = _place(self.dir)
            d.mkdir(parents=True, exist_ok=True)  # not made durable: losing the folder only loses the speed-up
            name = f"steps_{steps[0]:08d}-{steps[-1]:08d}.{os.urandom(4).hex()}.{suffix}"
            tmp = d / f".{name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
            side = sum_of(d / name)
            tmp_sum = d / f".{side.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
            try:
                pq.write_table(table, tmp, compression="zstd", compression_level=3, write_page_checksum=True)
                files.fsync(tmp)
                tmp_sum.write_text(sum_line(file_sha256(tmp), name))
                files.fsync(tmp_sum)
                os.link(tmp_sum, side)  # first: a segment is never seen without its checksum
                os.link(tmp, d / name)  # never replaces a segment: names are unique and never reused
            finally:
                tmp.unlink(missing_ok=True)
                tmp_sum.unlink(missing_ok=True)
            files.fsync_dir(d)
        except Exception as e:  # noqa: BLE001 - see take
            wlog.warning("trajstore: index segment of %s steps %d..%d not written (%s: %s); Reader.column "
                         "reads those steps from their files", self.dir, steps[0], steps[-1], type(e).__name__, e)


def clean_temp(split_dir: Path, keep_own: bool = False) -> None:
    """Remove temporaries of segment writes that were interrupted (their process is gone)."""
    for d in dirs(split_dir):
        for n in files.stale_temps(d, ".steps_", keep_own):
            try:
                (d / n).unlink(missing_ok=True)
            except OSError:
                pass


def prune(split_dir: Path) -> list[str]:
    """Delete the segments (and their checksums) whose step range ``first..last`` holds no step file
    any more (after ``max_keep`` rotation deleted steps); returns their names. Others are left alone."""
    steps, gone = listing.list_steps(split_dir), []
    for d in dirs(split_dir):
        try:
            names = files.listdir(d)
        except OSError:
            continue
        for n in names:
            m = SEGMENT_RE.match(n) or SUM_RE.match(n)
            if not m:
                continue
            i = bisect.bisect_left(steps, int(m.group(1)))
            if i < len(steps) and steps[i] <= int(m.group(2)):
                continue
            try:
                (d / n).unlink()
                gone.append(n)
            except OSError:
                pass
    return gone
