"""The reader side of the per-split column index (docs/FORMAT.md section 6; the writer side and the
folder layout are ``store/index.py``): :class:`Index` gives a step's indexed values — a plain
per-trajectory field, or a digest of ``store/digest.py`` — from a segment only when

* the segment's bytes have the SHA-256 recorded in its sidecar (a segment without one, or whose bytes
  changed since it was written, is ignored with a warning: the steps it covers are read from their
  files), and it passes the structural checks of the format;
* the step file's current identity ``(st_ino, st_size, st_mtime_ns)`` is the recorded one (for a
  step written as N shards: every shard's).

A segment's bytes are read, checked and parsed once and kept (compressed, as on disk) while it is
cached, so the columns read later are those of the bytes checked.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
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
from . import digest, paths
from .checksums import read_sum
from .fs import is_remote
from .regular import open_checked, read_small, read_upto, sha256_of
from .index import DERIVED, KEY, SEGMENT_RE, VERSION, _ident, dirs, fields, sum_of

rlog = logging.getLogger("trajstore.reader")

Key = str | tuple  # a field name, or a digest ``(what, (field, ...))``


def _bytes(path: Path) -> pa.Buffer:
    """The whole of segment ``path`` (a regular file, at most ``MAX_DECODED_BYTES``), checked
    against the SHA-256 in its sidecar: hashed as it is read, ``regular.CHUNK`` bytes at a time,
    before it is held (a segment whose bytes changed costs no more memory than a chunk); the bytes
    kept are hashed again (they are those checked, even if the file changed in between)."""
    want = read_sum(sum_of(path))
    if want is None:
        raise FormatError(f"its checksum {sum_of(path).name} is missing or malformed")
    what, cap = "the index segment", limits.MAX_DECODED_BYTES
    if is_remote(path):
        if path.sha256() != want:
            raise _changed(path)
        data = read_small(path, what, cap)
    else:
        fd, st = open_checked(path, what, follow=False)
        with os.fdopen(fd, "rb", buffering=0) as f:
            if st.st_size > cap:
                raise limits.over(path, st.st_size, "the index segment")
            if sha256_of(f.read) != want:
                raise _changed(path)
            f.seek(0)
            data = read_upto(f.read, cap + 1)
    if len(data) > cap or hashlib.sha256(data).hexdigest() != want:
        raise _changed(path)
    return pa.py_buffer(data)


def _changed(path: Path) -> FormatError:
    return FormatError(f"its SHA-256 is not the one recorded in {sum_of(path).name}: its bytes changed "
                       "since it was written")


class _Segment:
    """One segment's description and step/row layout, checked against its columns; value columns
    are read (and checked) on first use, from the bytes checked when it was opened."""

    def __init__(self, path: Path, split: str, lo: int, hi: int):
        self.path = path
        self._buf = _bytes(path)
        pf = self._file()
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
        # key -> (column, Arrow type, the type of versions 1-2 step files)
        self.cols: dict[Key, tuple] = {k: (n["col"], dt.arrow_type(n["dtype"]), dt.arrow_type(n["dtype"], 1))
                                       for k, n in fs}
        for e in doc.get("derived", []):
            if not (type(e) is list and len(e) == 3 and type(e[0]) is str and e[0].startswith(DERIVED)
                    and e[1] in digest.WHAT and type(e[2]) is list and all(type(x) is str for x in e[2])):
                raise FormatError(f"a derived entry {str(e)[:80]} is not [column, what, [field, ...]]")
            typ = pa.from_numpy_dtype(np.dtype(digest.WHAT[e[1]]))
            self.cols[(e[1], tuple(e[2]))] = (e[0], typ, typ)
        names = [c[0] for c in self.cols.values()]
        if len(self.cols) != len(fs) + len(doc.get("derived", [])) or len(set(names)) != len(names) \
                or set(names) & {"step", "row"}:
            raise FormatError("a field, digest or column is listed twice")
        if not all(isinstance(e, list) and len(e) == 5 and all(type(x) is int and x >= 0 for x in e)
                   for e in steps):
            raise FormatError("a step entry is not [step, rows, st_ino, st_size, st_mtime_ns]")
        nums = [e[0] for e in steps]
        if any(a >= b for a, b in zip(nums, nums[1:])) or (nums[0], nums[-1]) != (lo, hi):
            raise FormatError(f"steps {nums[0]}..{nums[-1]} are not increasing or not the range its name says")
        counts = np.array([e[1] for e in steps], dtype=np.int64)
        n = pf.metadata.num_rows
        if int(counts.sum()) != n or n * 8 * (2 + len(self.cols)) > limits.MAX_DECODED_BYTES:
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
        self._cols: dict[Key, np.ndarray] = {}

    def _file(self) -> pq.ParquetFile:
        return pq.ParquetFile(pa.BufferReader(self._buf), page_checksum_verification=True)

    def _read(self, pf: pq.ParquetFile, col: str, typ: pa.DataType, n: int, old: pa.DataType | None = None) -> pa.Array:
        """Column ``col`` of type ``typ`` (or ``old``: a half dtype's type in step files of versions 1-2)."""
        idx = self.schema.get_field_index(col)
        if idx < 0 or self.schema.field(idx).type not in (typ, old or typ):
            raise FormatError(f"column {col!r} is missing or not {typ}")
        arr = pf.reader.read_column(idx)
        if len(arr) != n or arr.null_count:
            raise FormatError(f"column {col!r} holds {len(arr)} values ({arr.null_count} null) for {n} rows")
        return arr.combine_chunks()

    def column(self, key: Key) -> np.ndarray:
        """All values of ``key`` (read-only numpy, cached)."""
        a = self._cols.get(key)
        if a is None:
            col, typ, old = self.cols[key]
            a = self._cols[key] = self._read(self._file(), col, typ, sum(self.counts), old).to_numpy(zero_copy_only=False)
        return a

    def raw(self, key: Key, step: int) -> np.ndarray:
        """``step``'s values of ``key`` (a field: as ``format.parquet.read_sample`` decodes it before
        ``as_value``; a digest: int64 or float64) as a numpy copy."""
        i = self.pos[step]
        v = self.column(key)[self.starts[i]:self.starts[i] + self.counts[i]]
        c = v.copy()  # owned by the result: an in-place change must not reach the cache
        c.flags.writeable = v.flags.writeable  # as from the step file (Arrow views are read-only)
        return c


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
        got = self.arrays([name], steps, shards)
        return {s: as_value(a[0], node) for s, (a, node) in got.items()}

    def arrays(self, keys: list[Key], steps: list[int], shards: dict[int, int] | None = None) -> dict[int, tuple]:
        """``{step: ([numpy array per key], node of keys[0] if a field)}`` for the steps of ``steps``
        for which one segment (one per shard) holds every key of ``keys``, as ``values`` says."""
        try:
            got = self._pick(keys, steps, shards or {})
            out = {}
            for s, segs in got.items():
                vals = [[seg.raw(k, s) for seg in segs] for k in keys]
                out[s] = ([v[0] if len(v) == 1 else np.concatenate(v) for v in vals],  # shards in rank order
                          segs[0].nodes.get(keys[0]) if isinstance(keys[0], str) else None)
            return out
        except Exception as e:  # noqa: BLE001 - the index is advisory: fall back to the files
            rlog.warning("trajstore: the index of %s is not used (%s: %s); reading the step files",
                         self.dir, type(e).__name__, e)
            return {}

    def table(self, keys: list[Key], steps: list[int], shards: dict[int, int] | None = None
              ) -> tuple[list[int], np.ndarray, list[np.ndarray]]:
        """The steps (in order) of ``steps`` that ``arrays`` would give, the row bounds of each
        (``[n + 1]``), and each key's values of those steps' rows joined (new arrays): ``arrays`` of
        many steps at once, without a Python object per step and key."""
        try:
            got = self._pick(keys, steps, shards or {})
            runs: list[list] = []  # [segment, first row, rows]: steps next to each other in a segment, merged
            found, counts = [], []
            for s in sorted(got):
                n = 0
                for seg in got[s]:
                    i = seg.pos[s]
                    if runs and runs[-1][0] is seg and runs[-1][1] + runs[-1][2] == seg.starts[i]:
                        runs[-1][2] += seg.counts[i]
                    else:
                        runs.append([seg, seg.starts[i], seg.counts[i]])
                    n += seg.counts[i]
                found.append(s)
                counts.append(n)
            bounds = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
            cols = [np.concatenate([seg.column(k)[a:a + n] for seg, a, n in runs]) if runs
                    else np.zeros(0) for k in keys]
            return found, bounds, cols
        except Exception as e:  # noqa: BLE001 - see arrays
            rlog.warning("trajstore: the index of %s is not used (%s: %s); reading the step files",
                         self.dir, type(e).__name__, e)
            return [], np.zeros(1, np.int64), [np.zeros(0) for _ in keys]

    def _pick(self, keys: list[Key], steps: list[int], shards: dict[int, int]) -> dict[int, list[_Segment]]:
        """``{step: [segment, ...]}`` (one per shard, in rank order) holding ``keys`` of ``step``'s
        current file(s), their columns read, for the steps of ``steps`` the index covers."""
        found = []
        for d in self.dirs:
            try:
                found += [(n, str(d / n)) for n in sorted(os.listdir(d))]
            except OSError:
                continue
        want = sorted(set(steps))
        cand: dict[tuple, list[tuple[str, _Segment]]] = {}
        for base, n in found:
            m = SEGMENT_RE.match(base)
            if not m:
                continue
            lo, hi = int(m.group(1)), int(m.group(2))
            i = bisect.bisect_left(want, lo)
            if i == len(want) or want[i] > hi:
                continue  # covers none of the steps asked for
            seg = self._segment(n, lo, hi)
            if seg is not None and all(k in seg.cols for k in keys) and self._load(n, seg, keys):
                for s in seg.pos.keys() & want[i:bisect.bisect_right(want, hi)]:
                    cand.setdefault((s, seg.shard), []).append((n, seg))
        fields = [k for k in keys if isinstance(k, str)]
        out: dict[int, list[_Segment]] = {}
        for s in want:
            if s in shards:
                got = [self._one(keys, s, cand.get((s, (r, shards[s]))), paths.shard_name(s, r, shards[s]))
                       for r in range(shards[s])]
                if all(g is not None for g in got) and all(g.nodes.get(k) == got[0].nodes.get(k)
                                                           for g in got for k in fields):
                    out[s] = got
                continue
            got1 = self._one(keys, s, cand.get((s, None)), paths.step_name(s))
            if got1 is not None:
                out[s] = [got1]
        return out

    def _load(self, n: str, seg: _Segment, keys: list[Key]) -> bool:
        """Read (and check) the columns of ``keys`` of segment ``n``; False (forgotten) if damaged."""
        try:
            for k in keys:
                seg.column(k)
            return True
        except Exception as e:  # noqa: BLE001 - a damaged column: forget the segment
            self._bad(n, e)
            return False

    def _one(self, keys: list[Key], s: int, cand: list | None, file: str) -> _Segment | None:
        """The first of ``cand`` that indexes ``file`` as it is now (its columns of ``keys`` read)."""
        if not cand:
            return None
        try:
            ident = _ident(os.stat(os.path.join(self.split_dir, file)))
        except OSError:
            return None  # gone: the step file path says so
        for n, seg in cand:
            if seg.idents[seg.pos[s]] == ident and self._segs.get(n) is seg:
                return seg  # else: rewritten since it was indexed, or the segment turned out damaged
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
