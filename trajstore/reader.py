"""Reader: list the steps of a dump and bring one back exactly as it was appended."""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from . import _store, _validate, integrity, schema
from .errors import DumpNotFoundError, FormatError, FormatVersionError, StepNotFoundError, TrajstoreError

__all__ = ["Reader"]


def _describe(steps: list[int], step: int) -> str:
    if not steps:
        return "the split holds no steps"
    i = bisect.bisect_left(steps, step)
    near = sorted({steps[j] for j in (i - 1, i) if 0 <= j < len(steps)})
    return (f"it holds {len(steps)} step(s) from {steps[0]} to {steps[-1]}; "
            f"nearest: {', '.join(map(str, near))}")


class Reader:
    """Read a dump written by :class:`trajstore.Writer`.

    >>> r = trajstore.Reader("dumps/run1")
    >>> batch = r[12]                 # the batch of step 12, as appended
    >>> r.read(12, columns=["rewards"])
    """

    def __init__(self, path: str | Path, split: str = "train", *, verify: bool = True):
        self.path = Path(path)
        self.verify = verify  # check each step file against its recorded SHA-256 before decoding
        self.split = _store.check_split(split)
        self.manifest = _store.read_manifest(self.path)
        self.dir = self.path / self.split
        if not self.dir.is_dir():
            others = _store.list_splits(self.path)
            raise DumpNotFoundError(
                f"dump {self.path} has no split {self.split!r}; splits present: {others or 'none'}"
            )
        self.refresh()

    # -- listing
    def refresh(self) -> list[int]:
        """Re-scan the split for steps committed since the reader was opened."""
        self._steps = _store.list_steps(self.dir)
        return self._steps

    def wait_for(self, step: int, timeout: float | None = None, poll: float = 0.05) -> None:
        """Block until ``step`` is committed (a writer may be running); StepNotFoundError after ``timeout`` s."""
        import time

        step = _store.check_step(step)
        end = None if timeout is None else time.monotonic() + timeout
        f = self.dir / _store.step_name(step)
        while not f.exists():
            if end is not None and time.monotonic() >= end:
                self.refresh()
                raise StepNotFoundError(
                    f"step {step} did not appear in dump {self.path} split {self.split!r} within {timeout} s: "
                    f"{_describe(self._steps, step)}; is the writer still running?", step=step)
            time.sleep(poll if end is None else max(0.0, min(poll, end - time.monotonic())))
        self.refresh()

    @property
    def skipped(self) -> dict[int, str]:
        """Steps the writer recorded as skipped (e.g. disk full), with the reason."""
        return _store.list_skipped(self.dir)

    @property
    def steps(self) -> list[int]:
        return list(self._steps)

    @property
    def splits(self) -> list[str]:
        return _store.list_splits(self.path)

    def __len__(self) -> int:
        return len(self._steps)

    def __contains__(self, step: object) -> bool:
        return isinstance(step, int) and (self.dir / _store.step_name(step)).exists()

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        for s in list(self._steps):
            yield s, self.read(s)

    def __getitem__(self, step: int) -> Any:
        return self.read(step)

    # -- one step
    def file(self, step: int) -> Path:
        """The committed file of ``step`` (raises StepNotFoundError)."""
        step = _store.check_step(step)
        f = self.dir / _store.step_name(step)
        if not f.exists():
            self.refresh()
            elsewhere = [s for s in self.splits if s != self.split
                         and (self.path / s / _store.step_name(step)).exists()]
            hint = f"; split(s) {elsewhere} hold step {step}" if elsewhere else ""
            why = _store.list_skipped(self.dir).get(step)
            hint += f"; the writer recorded it as skipped: {why}" if why is not None else ""
            raise StepNotFoundError(
                f"step {step} is not in dump {self.path} split {self.split!r}: "
                f"{_describe(self._steps, step)}{hint}", step=step
            )
        return f

    def _open(self, step: int) -> tuple[pq.ParquetFile, dict, Path]:
        f = self.file(step)
        try:
            src = pa.BufferReader(integrity.read_verified(f, step)) if self.verify else f
            pf = pq.ParquetFile(src, memory_map=False)
            pf.trajstore_source = src  # read() may decode row groups in parallel from it
            kv = pf.schema_arrow.metadata or {}
        except TrajstoreError:
            raise
        except Exception as e:  # noqa: BLE001 - a parser of untrusted bytes: any failure is a damaged file
            raise FormatError(f"{f}: not a readable Parquet file ({type(e).__name__}: {e}); "
                              "the step is damaged") from None
        raw = kv.get(b"trajstore")
        if raw is None:
            raise FormatError(f"{f}: Parquet file without trajstore metadata; it was not written by trajstore")
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{f}: trajstore metadata is not valid JSON ({e})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("batch"), dict):
            raise FormatError(f"{f}: trajstore metadata has no batch spec")
        v = doc.get("format_version")
        if type(v) is not int or v < 1:
            raise FormatError(f"{f}: format version {v!r} is not a positive int; the step is damaged")
        if v > _store.FORMAT_VERSION:
            raise FormatVersionError(
                f"{f}: format version {v!r}; this trajstore reads up to {_store.FORMAT_VERSION}; upgrade trajstore"
            )
        if doc.get("step") != step:
            raise FormatError(f"{f}: the file says it holds step {doc.get('step')!r}, its name says {step}")
        _validate.check(doc, pf.schema_arrow, pf.metadata.num_rows, str(f))
        return pf, doc, f

    def meta(self, step: int) -> dict:
        """The ``meta`` dict given to ``append`` for ``step``."""
        return self._open(step)[1].get("meta", {})

    def info(self, step: int) -> dict:
        """The step's stored description: spec, meta, row count."""
        return self._open(step)[1]

    def read(self, step: int, columns: list[str] | None = None, layout: str | None = None,
             device: Any = None) -> Any:
        """The batch of ``step``; ``columns`` limits it to those fields, ``layout``
        ("padded" or "packed") converts a dict batch between the two layouts; ``device`` ("cuda")
        moves its torch tensors there through pinned staging memory (trajstore/torch_bridge.py),
        ordered on the caller's current stream. On the CPU, tensors are views of Arrow memory
        where the layout allows."""
        if device is not None:
            from . import torch_bridge

            return torch_bridge.to_device(self.read(step, columns, layout), device)
        pf, doc, f = self._open(step)
        spec = doc["batch"]
        cols = schema.columns_for(spec, columns)
        if layout and cols is not None and spec.get("t") == "batch":
            cols = cols + [c for c in _token_cols(spec) if c not in cols][:1]
        try:
            table = _read_columns(pf, cols)
        except Exception as e:  # noqa: BLE001 - see _open
            raise FormatError(f"{f}: reading step {step} failed ({e}); the step is damaged") from None
        if table.num_rows != doc.get("num_rows", table.num_rows):
            raise FormatError(f"{f}: holds {table.num_rows} rows, its metadata says {doc.get('num_rows')}")
        return schema.decode(table, spec, where=str(f), columns=columns, layout=layout)

    def iter(self, steps: list[int] | None = None, device: Any = None, prefetch: int = 2,
             columns: list[str] | None = None, layout: str | None = None) -> Iterator[tuple[int, Any]]:
        """Yield ``(step, batch)`` for ``steps`` (default: all), decoding ``prefetch`` steps ahead
        on a thread pool; with ``device="cuda"`` the copy of the next batch overlaps the caller's
        work and the stream current at this call waits on each batch's copy. ``break`` frees the
        threads and staging memory."""
        from . import torch_bridge

        steps = list(self._steps) if steps is None else [_store.check_step(s) for s in steps]
        return torch_bridge.iterate(lambda s: self.read(s, columns, layout), steps, device, prefetch)

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def __repr__(self) -> str:
        return f"Reader({str(self.path)!r}, split={self.split!r}, steps={len(self._steps)})"

    # -- views (trajstore/_views.py)
    def to_pandas(self, step: int | None = None):
        """One DataFrame row per trajectory of ``step`` (None: every step), with ``step`` and ``index``."""
        from ._views import to_pandas

        return to_pandas(self, step)

    def duckdb(self):
        """A DuckDB connection with one view per split (``train``, ``val``...), each row with its ``step``."""
        from ._views import duckdb_connect

        return duckdb_connect(self)


def _read_columns(pf: pq.ParquetFile, cols: list[str] | None) -> pa.Table:
    """Large reads go through the dataset reader (``pq.read_table``): its column decoding measured
    ~4x faster per core than ``ParquetFile.read`` on list columns, and it runs columns and row
    groups in parallel (benchmarks/RESULTS.md). Small reads (a column of per-trajectory values)
    skip its second footer parse."""
    md = pf.metadata
    leaves = [md.schema.column(j).path for j in range(md.num_columns)]
    want = [j for j, p in enumerate(leaves)  # an estimate: it only picks the faster path
            if cols is None or any(p == c or p.startswith(c + ".") for c in cols)]
    size = sum(md.row_group(i).column(j).total_uncompressed_size for i in range(md.num_row_groups) for j in want)
    if size > PARALLEL_READ_BYTES:
        t = pq.read_table(pf.trajstore_source, columns=cols, use_threads=True)
        # one chunk per row group: join each column's chunks now, the columns in parallel
        parts = list(_combine_pool().map(lambda c: c.combine_chunks() if c.num_chunks > 1 else c, t.columns))
        return pa.Table.from_arrays(parts, schema=t.schema)
    return pf.read(columns=cols, use_threads=True)


_pool = None


def _combine_pool():
    global _pool
    if _pool is None:
        import os
        from concurrent.futures import ThreadPoolExecutor

        _pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="trajstore-combine")
    return _pool


PARALLEL_READ_BYTES = 4 << 20


def _token_cols(spec: dict) -> list[str]:
    return [n["col"] for _, n in spec["keys"] if n.get("kind") == "token"]
