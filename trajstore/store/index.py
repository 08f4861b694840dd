"""The per-split index of per-trajectory columns (docs/FORMAT.md section 6).

``Reader.column("rewards", steps)`` would open every step file (a footer parse each); the index
keeps the plain per-trajectory fields of many steps (one primitive value per trajectory:
``rewards``, ``seq_len``...) in a few immutable *segments* (Parquet files),
``<dump>/_trajstore/<split>/index/steps_<first>-<last>.<hex>.index`` (not named ``*.parquet``: a glob
of the dump's step files must not reach them); a dump of layout 1 keeps them, and gets new ones, in
``<split>/_index/steps_<first>-<last>.<hex>.parquet``, and readers look in both places.

* :class:`Collector` (writer side): after a step is committed its indexable columns are kept in
  memory with the step file's identity ``(st_ino, st_size, st_mtime_ns)``, and written as a
  segment every ``INDEX_EVERY`` steps, on ``flush()`` and on ``close()``. Best effort: a failure
  is logged and its rows dropped, never raised into ``append``.
* :class:`Index` (reader side): a step's value comes from a segment only when the step file's
  current identity is the recorded one; every other step is read from its file. A damaged or
  inconsistent segment is ignored with a warning.
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

from ..errors import FormatError
from ..format import dtypes as dt
from ..format import limits
from ..format.dtypes import as_value
from ..format.spec import is_dict_batch, is_plain_sample
from . import files, paths

DIR = "_index"  # layout 1: in the split folder
SIDE_DIR = "index"  # layout 2: in the split's side folder (paths.side_dir)
VERSION = 1
KEY = b"trajstore.index"
INDEX_EVERY = 256  # steps per segment (fewer on flush/close, or when the indexed fields change)
INDEX_MAX_ROWS = 1 << 22  # ...or fewer when they hold this many trajectories (bounds the memory kept)
SEGMENT_RE = re.compile(r"^steps_(\d{8,})-(\d{8,})\.[0-9a-f]{8}\.(?:parquet|index)$")
RESERVED = ("step", "row")  # the segment's own columns: a field stored under either name is not indexed

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


def _ident(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


# ----------------------------------------------------------------------------- writer side
class Collector:
    """Index rows of the steps a Writer committed, written out as segments (thread-safe)."""

    def __init__(self, split_dir: Path, split: str, shard: tuple[int, int] | None = None):
        self.dir, self.split, self.shard = split_dir, split, shard
        self._lock = threading.Lock()
        self._sig: str | None = None  # the indexed fields (JSON) of the rows kept
        self._fields: list = []
        self._rows: dict[int, tuple] = {}  # step -> (rows, identity, {col: pa.Array})

    def take(self, step: int, table: pa.Table) -> tuple | None:
        """The indexable columns of the step's encoded table, copied (the table may view the
        caller's tensors, which may change once the step is written); None if there are none."""
        try:
            doc = json.loads(table.schema.metadata[b"trajstore"])
            fs = fields(doc.get("batch"))
            cols = {}
            for _, node in fs:
                a = table.column(node["col"]).combine_chunks()
                if a.type != dt.arrow_type(node["dtype"]) or a.null_count or len(a) != table.num_rows:
                    return None
                cols[node["col"]] = pa.array(a.to_numpy(zero_copy_only=False).copy(), type=a.type)
            return (json.dumps(fs, sort_keys=True), fs, table.num_rows, cols) if fs else None
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

    def _swap(self) -> tuple[list, dict]:
        out, self._rows, self._sig = (self._fields, self._rows), {}, None
        return out

    def _write(self, fs: list, rows: dict) -> None:
        steps = sorted(rows)
        try:
            counts = np.array([rows[s][0] for s in steps], dtype=np.int64)
            starts = np.cumsum(counts) - counts
            arrays = {"step": pa.array(np.repeat(np.array(steps, dtype=np.int64), counts)),
                      "row": pa.array((np.arange(counts.sum()) - np.repeat(starts, counts)).astype(np.int32))}
            for _, node in fs:
                arrays[node["col"]] = pa.concat_arrays([rows[s][2][node["col"]] for s in steps])
            meta = {"version": VERSION, "split": self.split, "fields": fs,
                    "steps": [[s, rows[s][0], *rows[s][1]] for s in steps]}
            if self.shard is not None:
                meta["shard"] = list(self.shard)
            table = pa.table(arrays).replace_schema_metadata({KEY: json.dumps(meta)})
            d, suffix = _place(self.dir)
            d.mkdir(parents=True, exist_ok=True)  # not made durable: losing the folder only loses the speed-up
            name = f"steps_{steps[0]:08d}-{steps[-1]:08d}.{os.urandom(4).hex()}.{suffix}"
            tmp = d / f".{name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
            try:
                pq.write_table(table, tmp, compression="zstd", compression_level=3, write_page_checksum=True)
                files.fsync(tmp)
                os.link(tmp, d / name)  # never replaces a segment: names are unique and never reused
            finally:
                tmp.unlink(missing_ok=True)
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
    """Delete the segments whose step range ``first..last`` holds no step file any more (after
    ``max_keep`` rotation deleted steps); returns their names. Other segments are left alone."""
    steps, gone = paths.list_steps(split_dir), []
    for d in dirs(split_dir):
        try:
            names = files.listdir(d)
        except OSError:
            continue
        for n in names:
            m = SEGMENT_RE.match(n)
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


# ----------------------------------------------------------------------------- reader side
class _Segment:
    """One segment's description and step/row layout, checked against its columns; field columns
    are read (and checked) on first use."""

    def __init__(self, path: Path, split: str, lo: int, hi: int):
        self.path = path
        with open(path, "rb") as fh:
            pf = pq.ParquetFile(fh, page_checksum_verification=True)
            raw = (pf.metadata.metadata or {}).get(KEY)
            if raw is None:
                raise FormatError("no trajstore.index metadata")
            doc = json.loads(raw)
            if not isinstance(doc, dict) or type(doc.get("version")) is not int:
                raise FormatError("the metadata has no version")
            if doc["version"] != VERSION:
                raise FormatError(f"index version {doc['version']}; this trajstore reads version {VERSION}")
            if doc.get("split") != split:
                raise FormatError(f"it says it indexes split {doc.get('split')!r}")
            sh = doc.get("shard")
            if sh is not None and not (type(sh) is list and len(sh) == 2 and all(type(x) is int for x in sh)
                                       and 0 <= sh[0] < sh[1]):
                raise FormatError(f"its shard {sh!r} is not [rank, world_size]")
            self.shard = None if sh is None else tuple(sh)
            fs, steps = doc.get("fields"), doc.get("steps")
            if not isinstance(fs, list) or not isinstance(steps, list) or not steps:
                raise FormatError("fields or steps missing")
            if not all(isinstance(f, list) and len(f) == 2 and type(f[0]) is str for f in fs) or fields(
                    {"t": "batch", "keys": fs}) != fs:
                raise FormatError("a field is not a plain per-trajectory tensor")
            self.nodes = {k: n for k, n in fs}
            if len(self.nodes) != len(fs) or len({n["col"] for _, n in fs}) != len(fs):
                raise FormatError("a field or column is listed twice")
            if not all(isinstance(e, list) and len(e) == 5 and all(type(x) is int and x >= 0 for x in e)
                       for e in steps):
                raise FormatError("a step entry is not [step, rows, st_ino, st_size, st_mtime_ns]")
            nums = [e[0] for e in steps]
            if any(a >= b for a, b in zip(nums, nums[1:])) or (nums[0], nums[-1]) != (lo, hi):
                raise FormatError(f"steps {nums[0]}..{nums[-1]} are not increasing or not the range its name says")
            counts = np.array([e[1] for e in steps], dtype=np.int64)
            n = pf.metadata.num_rows
            if int(counts.sum()) != n or n * 8 * (2 + len(fs)) > limits.MAX_DECODED_BYTES:
                raise FormatError(f"it holds {n} rows, its steps add up to {int(counts.sum())}")
            self.schema = pf.schema_arrow
            starts = np.cumsum(counts) - counts
            step = self._read(pf, "step", pa.int64(), n)
            row = self._read(pf, "row", pa.int32(), n)
            if not (np.array_equal(step.to_numpy(), np.repeat(np.array(nums, dtype=np.int64), counts)) and
                    np.array_equal(row.to_numpy(), np.arange(n) - np.repeat(starts, counts))):
                raise FormatError("its step/row columns do not match its steps")
        self.pos = {s: i for i, s in enumerate(nums)}
        self.idents = [tuple(e[2:]) for e in steps]
        self.starts, self.counts = starts.tolist(), counts.tolist()
        self._cols: dict[str, pa.Array] = {}

    def _read(self, pf: pq.ParquetFile, col: str, typ: pa.DataType, n: int, old: pa.DataType | None = None) -> pa.Array:
        """Column ``col`` of type ``typ`` (or ``old``: a half dtype's type in step files of versions 1-2)."""
        idx = self.schema.get_field_index(col)
        if idx < 0 or self.schema.field(idx).type not in (typ, old or typ):
            raise FormatError(f"column {col!r} is missing or not {typ}")
        arr = pf.reader.read_column(idx)
        if len(arr) != n or arr.null_count:
            raise FormatError(f"column {col!r} holds {len(arr)} values ({arr.null_count} null) for {n} rows")
        return arr.combine_chunks()

    def value(self, name: str, step: int) -> Any:
        """``step``'s value of field ``name``, as ``format.parquet.read_sample`` decodes it (a copy)."""
        return as_value(*self.raw(name, step))

    def raw(self, name: str, step: int) -> tuple[np.ndarray, dict]:
        """``step``'s values of field ``name`` as a numpy copy, and the field's spec node."""
        node = self.nodes[name]
        a = self._cols.get(name)
        if a is None:
            with open(self.path, "rb") as fh:
                pf = pq.ParquetFile(fh, page_checksum_verification=True)
                a = self._cols[name] = self._read(pf, node["col"], dt.arrow_type(node["dtype"]),
                                                  sum(self.counts), dt.arrow_type(node["dtype"], 1))
        i = self.pos[step]
        v = a.slice(self.starts[i], self.counts[i]).to_numpy(zero_copy_only=False)
        c = v.copy()  # owned by the result: an in-place change must not reach the cache
        c.flags.writeable = v.flags.writeable  # as from the step file (Arrow views are read-only)
        return c, node


class Index:
    """The segments of one split, read on demand and cached by file name."""

    def __init__(self, split_dir: Path, split: str):
        self.split_dir, self.dirs, self.split = str(split_dir), dirs(split_dir), split
        self.dir = self.dirs[0]
        self._segs: dict[str, _Segment | None] = {}
        self._lock = threading.Lock()

    def values(self, name: str, steps: list[int], shards: dict[int, int] | None = None) -> dict[int, Any]:
        """``{step: value}`` of field ``name`` for the steps of ``steps`` that a segment covers and
        whose step file is the one indexed (``shards``: step -> N of the steps written as N shards,
        every one indexed); the others are left out (read them from their files)."""
        try:
            return self._values(name, steps, shards or {})
        except Exception as e:  # noqa: BLE001 - the index is advisory: fall back to the files
            rlog.warning("trajstore: the index of %s is not used (%s: %s); reading the step files",
                         self.dir, type(e).__name__, e)
            return {}

    def _values(self, name: str, steps: list[int], shards: dict[int, int]) -> dict[int, Any]:
        found = []
        for d in self.dirs:
            try:
                found += [(n, str(d / n)) for n in sorted(os.listdir(d))]
            except OSError:
                continue
        want = sorted(set(steps))
        cand: dict[int, list[tuple[str, _Segment]]] = {}
        for base, n in found:
            m = SEGMENT_RE.match(base)
            if not m:
                continue
            lo, hi = int(m.group(1)), int(m.group(2))
            i = bisect.bisect_left(want, lo)
            if i == len(want) or want[i] > hi:
                continue  # covers none of the steps asked for
            seg = self._segment(n, lo, hi)
            if seg is not None and name in seg.nodes:
                for s in seg.pos.keys() & want[i:bisect.bisect_right(want, hi)]:
                    cand.setdefault((s, seg.shard), []).append((n, seg))
        out: dict[int, Any] = {}
        for s in want:
            if s in shards:
                got = [self._one(name, s, cand.get((s, (r, shards[s]))), paths.shard_name(s, r, shards[s]))
                       for r in range(shards[s])]
                if all(g is not None for g in got) and all(g[1] == got[0][1] for g in got):
                    out[s] = as_value(np.concatenate([g[0] for g in got]), got[0][1])  # in rank order
                continue
            got = self._one(name, s, cand.get((s, None)), paths.step_name(s))
            if got is not None:
                out[s] = as_value(*got)
        return out

    def _one(self, name: str, s: int, cand: list | None, file: str) -> tuple[np.ndarray, dict] | None:
        """Field ``name`` of step ``s`` from the first of ``cand`` that indexes ``file`` as it is now."""
        if not cand:
            return None
        try:
            ident = _ident(os.stat(os.path.join(self.split_dir, file)))
        except OSError:
            return None  # gone: the step file path says so
        for n, seg in cand:
            if seg.idents[seg.pos[s]] != ident or self._segs.get(n) is not seg:
                continue  # rewritten since it was indexed, or the segment turned out damaged
            try:
                return seg.raw(name, s)
            except FileNotFoundError:
                self._segs[n] = None  # deleted since it was listed (rotation)
            except Exception as e:  # noqa: BLE001 - a damaged column: forget the segment
                self._bad(n, e)
        return None

    def _segment(self, n: str, lo: int, hi: int) -> _Segment | None:
        with self._lock:
            if n in self._segs:
                return self._segs[n]
            try:
                seg = _Segment(Path(n), self.split, lo, hi)
            except FileNotFoundError:
                return None  # deleted since it was listed (rotation)
            except Exception as e:  # noqa: BLE001 - a parser of untrusted bytes: any failure is damage
                self._bad(n, e)
                return None
            self._segs[n] = seg
            return seg

    def _bad(self, n: str, e: BaseException) -> None:
        self._segs[n] = None
        rlog.warning("trajstore: index segment %s is ignored (%s: %s); the steps it covers are read from "
                     "their files", n, type(e).__name__, e)
