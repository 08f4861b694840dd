"""Atomic commit of a step file with its checksum, clean-up of interrupted writes, and the
record of a step that was not written (docs/RELIABILITY.md). Checksums, records and temporaries
go to the split's side folder (``paths.side_dir``: ``<dump>/_trajstore/<split>/``, or the split
folder itself in a dump of layout 1); the split folder receives only the committed step file."""

from __future__ import annotations

import os
import re
from pathlib import Path

from . import checksums, remote
from .files import fsync, fsync_dir, stale_temps, write_durable
from .fs import is_remote
from .paths import TMP_PREFIX, places, side_dir, skipped_name, skipped_of, skipped_record

__all__ = ["commit", "clean_temp", "record_skipped"]


def commit(tmp: Path, final: Path, overwrite: bool) -> None:
    """Make ``tmp`` (from ``paths.temp_path``) visible as ``final``, with its checksum: see
    docs/RELIABILITY.md.

    1. fsync ``tmp`` and write its SHA-256 to a fsynced temporary sidecar (in the side folder);
    2. link ``tmp`` to ``final`` (no clobber; FileExistsError if committed) or replace it;
    3. rename the temporary sidecar over ``step_N.sha256``.
    A crash between 2 and 3 leaves a temporary sidecar that matches the new file:
    readers accept it and ``clean_temp`` promotes it.
    """
    fsync(tmp)
    digest = checksums.file_sha256(tmp)
    side = checksums.sum_path(final)
    side_tmp = side.parent / f".{side.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        write_durable(side_tmp, checksums.sum_line(digest, final.name))
        if overwrite:
            os.replace(tmp, final)
        else:
            try:
                os.link(tmp, final)
            finally:
                tmp.unlink(missing_ok=True)
    except BaseException:
        side_tmp.unlink(missing_ok=True)
        raise
    # the step is visible and its bytes are on disk: what follows cannot fail it
    try:
        os.replace(side_tmp, side)
    except OSError:
        pass  # side_tmp stays: readers accept it as the step's checksum, clean_temp promotes it
    for d in places(final.parent):
        try:
            (d / skipped_of(final.name)).unlink(missing_ok=True)  # of this file: a shard's own record
        except OSError:
            pass
    fsync_dir(final.parent)
    if side.parent != final.parent:
        fsync_dir(side.parent)


def clean_temp(split_dir: Path, keep_own: bool = False, shard: str | None = None) -> list[str]:
    """Remove leftovers of interrupted writes (promoting a temporary checksum that
    matches its committed step); returns the names removed.  Temporaries of other live
    processes are kept, and this process's own too with ``keep_own`` (another Writer of
    this process may be writing them). Looks in the side folder and the split folder.
    ``shard`` (``".rank00002-of-00004."``): only that rank's files, else ("") only those of whole steps:
    the ranks of a dump may run on other hosts, where a pid says nothing (docs/RELIABILITY.md)."""
    if is_remote(split_dir):
        return remote.clean_temp(split_dir)
    gone = []
    for d in places(split_dir):
        for n in stale_temps(d, TMP_PREFIX, keep_own):
            if shard is not None and not (shard in n if shard else ".rank" not in n):
                continue  # another rank's (or, for a whole-step writer, any rank's)
            m = re.match(r"^\.(step_\d{8,}(?:\.rank\d{5,}-of-\d{5,})?)\.sha256\.tmp-", n)
            if m and _promote(split_dir, m.group(1), d / n):
                continue
            (d / n).unlink(missing_ok=True)
            gone.append(n)
        for n in os.listdir(d) if d.is_dir() else []:
            if n.endswith(checksums.SUM_SUFFIX) and not (split_dir / n).with_suffix(".parquet").exists():
                (d / n).unlink(missing_ok=True)  # checksum of a step that was never committed
                gone.append(n)
    return gone


def _promote(split_dir: Path, stem: str, side_tmp: Path) -> bool:
    final = split_dir / f"{stem}.parquet"
    try:
        recorded = checksums.read_sum(side_tmp)
        if not final.exists() or recorded is None or checksums.file_sha256(final) != recorded:
            return False
        side = side_tmp.parent / f"{stem}{checksums.SUM_SUFFIX}"
        if checksums.read_sum(side) != recorded:
            os.replace(side_tmp, side)
            fsync_dir(side.parent)
            return True
    except OSError:
        return False
    return False


def record_skipped(split_dir: Path, step: int, reason: str, name: str | None = None) -> bool:
    """Record that ``step`` (its file ``name``: a shard's, ``paths.shard_name``) was not written (e.g.
    disk full) so readers can say so.

    Best effort: returns False if the record itself cannot be written (the disk may be full).
    """
    if is_remote(split_dir):
        return remote.record_skipped(split_dir, step, reason, name)
    d = side_dir(split_dir)
    path = d / (skipped_of(name) if name else skipped_name(step))
    tmp = d / f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        if d != split_dir and not split_dir.is_dir():
            return False  # no such split
        d.mkdir(exist_ok=True)
        write_durable(tmp, skipped_record(step, reason))
        os.replace(tmp, path)
        fsync_dir(d)
        return True
    except OSError:
        return False
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
