"""Reader: list the steps of a dump and bring one back exactly as it was appended."""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from . import _store, schema
from .errors import DumpNotFoundError, FormatError, FormatVersionError, StepNotFoundError

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

    def __init__(self, path: str | Path, split: str = "train"):
        self.path = Path(path)
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
            raise StepNotFoundError(
                f"step {step} is not in dump {self.path} split {self.split!r}: "
                f"{_describe(self._steps, step)}{hint}", step=step
            )
        return f

    def _open(self, step: int) -> tuple[pq.ParquetFile, dict, Path]:
        f = self.file(step)
        try:
            pf = pq.ParquetFile(f, memory_map=False)
            kv = pf.schema_arrow.metadata or {}
        except (pa.ArrowException, OSError) as e:
            raise FormatError(f"{f}: not a readable Parquet file ({e}); the step is damaged") from None
        raw = kv.get(b"trajstore")
        if raw is None:
            raise FormatError(f"{f}: Parquet file without trajstore metadata; it was not written by trajstore")
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise FormatError(f"{f}: trajstore metadata is not valid JSON ({e})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("batch"), dict):
            raise FormatError(f"{f}: trajstore metadata has no batch spec")
        v = doc.get("format_version")
        if not isinstance(v, int) or v > _store.FORMAT_VERSION:
            raise FormatVersionError(
                f"{f}: format version {v!r}; this trajstore reads up to {_store.FORMAT_VERSION}; upgrade trajstore"
            )
        if doc.get("step") != step:
            raise FormatError(f"{f}: the file says it holds step {doc.get('step')!r}, its name says {step}")
        return pf, doc, f

    def meta(self, step: int) -> dict:
        """The ``meta`` dict given to ``append`` for ``step``."""
        return self._open(step)[1].get("meta", {})

    def info(self, step: int) -> dict:
        """The step's stored description: spec, meta, row count."""
        return self._open(step)[1]

    def read(self, step: int, columns: list[str] | None = None, layout: str | None = None) -> Any:
        """The batch of ``step``; ``columns`` limits it to those fields, ``layout``
        ("padded" or "packed") converts a dict batch between the two layouts."""
        pf, doc, f = self._open(step)
        spec = doc["batch"]
        cols = schema.columns_for(spec, columns)
        if layout and cols is not None and spec.get("t") == "batch":
            cols = cols + [c for c in _token_cols(spec) if c not in cols][:1]
        try:
            table = pf.read(columns=cols, use_threads=True)
        except (pa.ArrowException, OSError) as e:
            raise FormatError(f"{f}: reading step {step} failed ({e}); the step is damaged") from None
        if table.num_rows != doc.get("num_rows", table.num_rows):
            raise FormatError(f"{f}: holds {table.num_rows} rows, its metadata says {doc.get('num_rows')}")
        return schema.decode(table, spec, where=str(f), columns=columns, layout=layout)

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def __repr__(self) -> str:
        return f"Reader({str(self.path)!r}, split={self.split!r}, steps={len(self._steps)})"


def _token_cols(spec: dict) -> list[str]:
    return [n["col"] for _, n in spec["keys"] if n.get("kind") == "token"]
