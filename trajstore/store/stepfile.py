"""Opening one committed step file: its Parquet reader and its trajstore description (the footer's
``trajstore`` document), checked as every reader checks it: the format version known, the step the
file says it holds, and (``check``) the spec consistent with the file's columns (``format.validate``).

The reader decodes what this opens; ``trajstore info`` and ``verify`` read the footer through it alone,
without the decoding modules (and without torch, docs/CLI.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pyarrow.parquet as pq

from ..errors import FormatError, foreign_errors
from ..format import limits
from ..format.file import validate
from ..format.spec import check_version
from . import checksums, paths
from .fs import source

__all__ = ["StepFile", "open_step"]


class StepFile(NamedTuple):
    """An opened step file: its Parquet reader, the source it reads from (the checked file; with
    ``verify`` the descriptor whose bytes were hashed), its trajstore description and its path."""

    pf: pq.ParquetFile
    src: Any
    doc: dict
    path: Path


def open_step(f: Path, step: int, verify: bool = False, check: bool = True, budget: bool = True) -> StepFile:
    """Step file (or shard) ``f`` of ``step`` opened; ``verify`` reads its bytes checked against the
    recorded checksum first; ``check=False`` skips the walk of the whole spec (``validate.check``), for
    callers that check the one node they decode; ``budget=False`` checks the spec without the decode budget
    (the SQL views: DuckDB reads the columns itself)."""
    with foreign_errors(f, "reading it as a Parquet file", then="the step is damaged"):
        src = checksums.read_verified(f, step) if verify else source(f)
        pf = pq.ParquetFile(src, memory_map=False, page_checksum_verification=True, **limits.THRIFT_LIMITS)
        kv = pf.metadata.metadata or {}  # the footer's key-value pairs (no Arrow schema build)
    raw = kv.get(b"trajstore")
    if raw is None:
        raise FormatError(f"{f}: Parquet file without trajstore metadata; it was not written by trajstore")
    doc = limits.load_doc(raw, str(f))  # its size bounded first (format/limits.py)
    if not isinstance(doc, dict) or not isinstance(doc.get("batch"), dict):
        raise FormatError(f"{f}: trajstore metadata has no batch spec")
    check_version(doc.get("format_version"), str(f), "the step")
    if doc.get("step") != step:
        raise FormatError(f"{f}: the file says it holds step {doc.get('step')!r}, its name says {step}")
    _check_shard(f, doc.get("shard"))
    if check:
        if budget:
            limits.check_pages(pf.metadata, str(f))
        with foreign_errors(f, "reading its Arrow schema", then="the step is damaged"):
            arrow_schema = pf.schema_arrow
        validate.check(doc, arrow_schema, pf.metadata.num_rows, str(f), budget)
    return StepFile(pf, src, doc, f)


def _check_shard(f: Path, shard: Any) -> None:
    """The shard the footer says the file holds is the one its name says: a shard named rank r of N says
    ``{"rank": r, "world_size": N}``, a whole step file (``step_N.parquet``) says none (a shard renamed
    whole would read as the whole step). Other names (a lone file given to the reader) are not judged."""
    name = f.name
    m = paths.SHARD_RE.match(name)
    if m is not None:
        want = {"rank": int(m[2]), "world_size": int(m[3])}
        if shard != want:
            raise FormatError(f"{f}: its metadata says shard {shard!r}, its name says rank {want['rank']} of "
                              f"{want['world_size']}; the file was renamed or is damaged")
    elif paths.STEP_RE.match(name) and shard is not None:
        raise FormatError(f"{f}: its metadata says shard {shard!r} of a step written by several ranks, its name "
                          "says a whole step; the file was renamed or is damaged")
