"""Writer: append one step's batch as one Parquet file, atomically."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from . import _store, schema
from .errors import ConfigError, StepExistsError, WriterError

__all__ = ["Writer"]

MAX_META_BYTES = 1 << 20


def parquet_options(table) -> dict:
    """Per-column encodings: BYTE_STREAM_SPLIT for numeric tensor values (see docs/FORMAT.md)."""
    bss = []
    for f in table.schema:
        t = f.type.value_type if hasattr(f.type, "value_type") else f.type
        if (f.metadata or {}).get(b"trajstore.kind") in (b"token", b"sample", b"cell") and (
            t.bit_width in (16, 32, 64) and str(t) not in ("bool",)
        ):
            bss.append(f.name)
    return {
        "compression": "zstd",
        "use_dictionary": [f.name for f in table.schema if f.name not in bss],
        "use_byte_stream_split": bss,
        "write_statistics": ["step"],
    }


def check_meta(meta: Any, step: int) -> dict:
    if meta is None:
        return {}
    if type(meta) is not dict:
        raise ConfigError(f"step {step}: meta must be a dict, got {type(meta).__name__}")
    schema.check_json(meta, f"step {step} meta")
    n = len(json.dumps(meta))
    if n > MAX_META_BYTES:
        raise ConfigError(f"step {step}: meta is {n} bytes of JSON, the limit is {MAX_META_BYTES}; "
                          "store large values as batch fields instead")
    return meta


class Writer:
    """Append steps to a dump at ``path``; use as a context manager.

    >>> with trajstore.Writer("dumps/run1") as w:
    ...     w.append(0, batch, meta={"lr": 1e-6})
    """

    def __init__(self, path: str | Path, split: str = "train", *, overwrite: bool = False):
        self.path = Path(path)
        self.split = _store.check_split(split)
        self.overwrite = overwrite
        self.manifest = _store.create_manifest(self.path)
        self.dir = self.path / self.split
        self.dir.mkdir(exist_ok=True)
        _store.clean_temp(self.dir)
        self._closed = False

    def append(self, step: int, batch: Any, meta: dict | None = None, *, overwrite: bool | None = None) -> None:
        """Record ``batch`` as step ``step`` (with JSON-able step metadata ``meta``)."""
        if self._closed:
            raise WriterError(f"append(step={step}) on a closed Writer for {self.dir}; open a new Writer")
        step = _store.check_step(step)
        meta = check_meta(meta, step)
        ow = self.overwrite if overwrite is None else overwrite
        final = self.dir / _store.step_name(step)
        if not ow and final.exists():
            raise StepExistsError(
                f"step {step} already exists in {self.dir} ({final.name}); pass overwrite=True to "
                "replace it, or write to another path or split"
            )
        table = schema.encode(batch, step=step, split=self.split, meta=meta)
        self._write(step, table, final, ow)

    def _write(self, step: int, table, final: Path, overwrite: bool) -> None:
        tmp = self.dir / _store.temp_name(step)
        try:
            pq.write_table(table, tmp, **parquet_options(table))
            _store.commit(tmp, final, overwrite)
        except FileExistsError:
            raise StepExistsError(
                f"step {step} was committed to {final} by someone else while it was being written; "
                "pass overwrite=True to replace it"
            ) from None
        except OSError as e:
            raise WriterError(f"step {step}: writing {final} failed: {e}; earlier steps are intact") from e
        finally:
            tmp.unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait until every appended step is on disk."""

    def close(self) -> None:
        self.flush()
        self._closed = True

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Writer({str(self.path)!r}, split={self.split!r})"
