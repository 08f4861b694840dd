"""A dump on object storage (``s3://``, ``gs://``, ``hdfs://``, any fsspec URL; ``store/fs.py`` builds the
file system): the commit protocol where there is no fsync, link or rename (docs/RELIABILITY.md,
"Object storage"). Names, listings and reads go through the same ``paths``/``checksums`` code as a
local dump, on :class:`~trajstore.store.fs.RemotePath` names.

Committing step file ``F`` (a whole step or a rank's shard: ``paths`` names it):

1. the step is encoded into memory;
2. its SHA-256 is PUT as a *pending* checksum ``_trajstore/<split>/.pending/<F>/<pid>-<random>-<host>.sha256``
   (a name no other writer uses);
3. ``F`` is PUT whole, in one request (or one multipart upload, which becomes visible only when it
   completes): readers see all of it or nothing. Without ``overwrite`` the PUT is conditional
   (``If-None-Match: *``, with s3fs) so that of two writers of one step exactly one succeeds. On a
   file system without conditional writes (pyarrow's S3) the writer first *claims* the step: it
   lists ``.pending/<F>/`` after its own PUT of step 2 and gives up (FileExistsError) if ``F`` exists
   or another writer's pending checksum younger than ``STALE_S`` is there. With a strongly
   consistent listing (S3 since 2020) of two overlapping writers the later one always sees the
   earlier, so two never both PUT; both may give up (neither sees itself alone). A writer whose PUT
   takes longer than ``STALE_S`` can be overtaken (docs/RELIABILITY.md);
4. the checksum is PUT as ``step_N.sha256`` and the pending one deleted.

A visible step therefore always has its checksum (the pending one until 4; readers accept both,
as on a local disk). A writer killed anywhere leaves no step object, or a step whose pending
checksum matches it (``clean_temp`` promotes it); the loser of a race deletes its pending checksum.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ConfigError, DumpNotFoundError
from . import checksums, manifest, paths
from . import files
from .fs import RemotePath

__all__ = ["create_manifest", "write", "commit", "clean_temp", "record_skipped", "NoIndex", "dataset"]

MARKER = ".layout"  # <dump>/_trajstore/.layout: an object store has no empty folders; the side folder's mark
STALE_S = 600.0  # a pending checksum of a step that is not there, older than this, is a dead writer's


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64]


def _tag() -> str:
    return f"{os.getpid()}-{os.urandom(4).hex()}-{_host()}"


def _live(p: RemotePath, now: float) -> bool:
    """Whether the pending checksum ``p`` may be a live writer's: one of this host whose process is
    gone is not; one of another host is, until ``STALE_S`` after its PUT."""
    m = re.match(r"^(\d+)-[0-9a-f]{8}-(.+)\.sha256$", p.name)
    if m and m.group(2) == _host() and int(m.group(1)) != os.getpid():
        return files.alive(int(m.group(1)))
    return now - _mtime(p) < STALE_S


def create_manifest(root: RemotePath) -> dict:
    """Read the dump's manifest, creating the dump if there is none: the side folder's mark, then the
    manifest in one conditional PUT (a manifest another writer made first is kept). A store that
    refuses (no such bucket, no credentials) is a ConfigError naming the URL."""
    store, f = root.store, root / paths.MANIFEST
    try:
        if not f.exists():
            store.put((root / paths.SIDE / MARKER).key, b"2\n", create=False)
            try:
                store.put(f.key, manifest.new_manifest().encode(), create=True)
            except FileExistsError:
                pass
        elif manifest.read_manifest(root)["format_version"] >= 2 and not (root / paths.SIDE).is_dir():
            store.put((root / paths.SIDE / MARKER).key, b"2\n", create=False)  # a copy that lost it
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"cannot create the dump at {root}: {e}; check that the bucket exists, the "
                          "credentials (AWS_* variables, AWS_PROFILE, ~/.aws/...) and the endpoint "
                          "(AWS_ENDPOINT_URL)") from None
    try:
        return manifest.read_manifest(root)
    except DumpNotFoundError:
        raise ConfigError(f"the dump at {root} was created but its manifest cannot be read back; check the "
                          "store's consistency settings and permissions") from None


def write(table: pa.Table, final: RemotePath, overwrite: bool, options: dict,
          check: Callable[[], None]) -> int:
    """Encode ``table`` into memory, call ``check`` (the batch did not change meanwhile), commit it as
    ``final``; returns its bytes. FileExistsError when the step exists and not ``overwrite``."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **options)
    data = sink.getvalue()
    check()
    commit(final, data, overwrite)
    return data.size


def commit(final: RemotePath, data: pa.Buffer, overwrite: bool) -> None:
    """Steps 2-4 of the module doc."""
    store = final.store
    line = checksums.sum_line(hashlib.sha256(memoryview(data)).hexdigest(), final.name).encode()
    side = checksums.sum_path(final)
    pending = checksums.pending_dir(final) / f"{_tag()}{checksums.SUM_SUFFIX}"
    store.put(pending.key, line, create=False)
    try:
        if not overwrite and not store.conditional:
            _claim(final, pending)
        store.put(final.key, data, create=not overwrite)
    except BaseException:
        try:
            _drop(pending)
        except OSError:
            pass
        raise
    # the step is visible with its pending checksum: what follows cannot fail it
    try:
        store.put(side.key, line, create=False)
        _drop(pending)
    except OSError:
        pass  # the pending checksum stays: readers accept it, clean_temp promotes it
    for d in paths.places(final.parent):
        try:
            (d / paths.skipped_of(final.name)).unlink(missing_ok=True)  # of this file: a shard's own record
        except OSError:
            pass


def _drop(p: RemotePath) -> None:
    """Delete the pending checksum ``p``. pyarrow's S3 leaves an empty folder marker (``<folder>/``) where
    it deletes a folder's last object: the folder is removed too, so no marker per step piles up."""
    p.unlink(missing_ok=True)
    if p.store.fsspec is None:
        try:
            p.parent.listdir()
        except FileNotFoundError:
            p.store.pa.delete_dir(p.parent.key)


def _claim(final: RemotePath, mine: RemotePath) -> None:
    """Without conditional writes: FileExistsError unless ``final`` is absent and ``mine`` is the only
    live pending checksum of it (module doc, step 3)."""
    if final.exists():
        raise FileExistsError(f"{final} exists")
    now = time.time()
    others = [p for p in mine.parent.iterdir() if p.name != mine.name and _live(p, now)]
    if others:
        raise FileExistsError(f"another writer is committing {final} at the same time (its pending checksum "
                              f"{others[0]}); without conditional writes neither may overwrite the other")


def _mtime(p: RemotePath) -> float:
    """When ``p`` was written; now where the file system does not say (so it counts as a live writer's)."""
    try:
        return p.stat().st_mtime or time.time()
    except FileNotFoundError:
        return 0.0


def clean_temp(split_dir: RemotePath) -> list[str]:
    """Pending checksums left by writers killed between steps 2 and 4: promoted where they match the
    committed step, deleted where the step holds other bytes (a race's loser) or is still missing
    after ``STALE_S`` (a writer gone before its PUT). Returns the names removed."""
    try:
        folders = (paths.side_dir(split_dir) / checksums.PENDING).iterdir()
    except FileNotFoundError:
        return []
    gone = []
    for folder in folders:
        final = split_dir / folder.name
        try:
            for p in folder.iterdir():
                recorded = checksums.read_sum(p)
                if not final.exists():
                    if _live(p, time.time()):
                        continue  # perhaps a live writer's
                elif recorded is not None and recorded == checksums.file_sha256(final):
                    side = checksums.sum_path(final)
                    if checksums.read_sum(side) != recorded:
                        split_dir.store.put(side.key, checksums.sum_line(recorded, final.name).encode(), create=False)
                _drop(p)
                gone.append(p.name)
        except OSError:
            continue
    return gone


def record_skipped(split_dir: RemotePath, step: int, reason: str, name: str | None = None) -> bool:
    """``commit.record_skipped`` on object storage: one PUT of the record (best effort); none for a step
    whose file is there (committed by a writer that raced this one), looked at before and after the PUT."""
    try:
        d = paths.side_dir(split_dir)
        rec = d / (paths.skipped_of(name) if name else paths.skipped_name(step))
        final = split_dir / (name or paths.step_name(step))
        if final.exists():
            return False
        split_dir.store.put(rec.key, manifest.skipped_record(step, reason).encode(), create=False)
        if final.exists():  # committed meanwhile: its commit may have deleted the record before our PUT
            rec.unlink(missing_ok=True)
            return False
        return True
    except (OSError, pa.ArrowException):
        return False


class NoIndex:
    """The column index (``store/index.py``) is kept for local dumps only: on object storage a writer
    keeps none and ``Reader.column`` reads each step's column from its file."""

    def take(self, step: int, table: Any) -> None:
        return None

    def add(self, *args: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def values(self, name: str, steps: list[int], shards: dict | None = None) -> dict:
        return {}

    def arrays(self, keys: list, steps: list[int], shards: dict | None = None) -> dict:
        return {}

    def table(self, keys: list, steps: list[int], shards: dict | None = None) -> tuple:
        return [], None, []


def dataset(files: list[RemotePath]) -> Any:
    """The step files of one split as one ``pyarrow.dataset`` (what DuckDB scans for ``trajstore sql``):
    the union of their columns by name (a column a step lacks is NULL there)."""
    import pyarrow.dataset as ds  # here: it loads pandas, which nothing else of the store needs

    store = files[0].store
    schemas = [pq.read_schema(f.open_input()) for f in files]
    schema = pa.unify_schemas([s.remove_metadata() for s in schemas], promote_options="permissive")
    return ds.dataset([f.key for f in files], schema=schema, format="parquet", filesystem=store.pa)
