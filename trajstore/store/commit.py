"""Atomic commit of a step file with its checksum, clean-up of interrupted writes, and the
record of a step that was not written (docs/RELIABILITY.md). Checksums, records and temporaries
go to the split's side folder (``paths.side_dir``: ``<dump>/_trajstore/<split>/``, or the split
folder itself in a dump of layout 1); the split folder receives only the committed step file."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path

from ..errors import FormatError
from . import checksums, remote
from .files import fsync, fsync_dir, stale_temps, write_durable
from .fs import is_remote
from .manifest import skipped_record
from .paths import (
    SUM_RE,
    TMP_PREFIX,
    TMP_SUM_RE,
    check_real_dirs,
    places,
    side_dir,
    skipped_name,
    skipped_of,
    step_name,
)

__all__ = ["commit", "prepare", "forget", "clean_temp", "record_skipped"]


_prepared: dict[Path, tuple[tuple[int, int, int], str]] = {}  # temporary -> (its stat, its SHA-256)
_prepared_lock = threading.Lock()


def _sig(tmp: Path) -> tuple[int, int, int]:
    st = os.stat(tmp)
    return st.st_ino, st.st_size, st.st_mtime_ns


def prepare(tmp: Path) -> None:
    """Step 1's costly part ahead of ``commit``, on any thread and in any order: fsync ``tmp`` and
    hash it. ``commit`` of the same, unchanged ``tmp`` then skips them; ``forget`` drops what an
    uncommitted temporary left here."""
    fsync(tmp)
    digest = checksums.file_sha256(tmp)
    with _prepared_lock:
        _prepared[tmp] = (_sig(tmp), digest)


def forget(tmp: Path) -> None:
    with _prepared_lock:
        _prepared.pop(tmp, None)


def _synced_digest(tmp: Path) -> str:
    """``tmp``'s SHA-256 once its bytes are on disk: from ``prepare`` where it saw this very file."""
    with _prepared_lock:
        pre = _prepared.pop(tmp, None)
    if pre is not None and pre[0] == _sig(tmp):
        return pre[1]
    fsync(tmp)
    return checksums.file_sha256(tmp)


def commit(tmp: Path, final: Path, overwrite: bool) -> None:
    """Make ``tmp`` (from ``paths.temp_path``) visible as ``final``, with its checksum: see
    docs/RELIABILITY.md.

    1. fsync ``tmp`` and write its SHA-256 to a fsynced temporary sidecar (in the side folder);
    2. link ``tmp`` to ``final`` (no clobber; FileExistsError if committed) or replace it;
    3. rename the temporary sidecar over ``step_N.sha256``.
    Step 1's fsync and hash may have been done by ``prepare`` (the writer's workers do it in parallel,
    before the commits take their turns in append order).
    A crash between 2 and 3 leaves a temporary sidecar that matches the new file:
    readers accept it and ``clean_temp`` promotes it. Steps 2 and 3 run under the split's commit
    lock (``_commit_lock``), so of writers racing on one step the last to commit leaves both its file
    and its checksum: a step and its checksum change together.
    """
    digest = _synced_digest(tmp)
    side = checksums.sum_path(final)
    side_tmp = side.parent / f".{side.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        write_durable(side_tmp, checksums.sum_line(digest, final.name))
    except BaseException:
        side_tmp.unlink(missing_ok=True)
        raise
    with _commit_lock(final.parent):
        try:
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


@contextlib.contextmanager
def _commit_lock(split_dir: Path):
    """An exclusive lock of the split's commits across processes and threads: ``flock`` on the split
    folder itself (released when its holder dies; ``columns.py`` locks the side folder). Without it, two
    writers overwriting one step could leave the file of one and the checksum of the other, which
    ``verify`` reports as damage (issue 17). A file system without ``flock`` commits unlocked."""
    fd = os.open(split_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # no flock here (some network file systems): unlocked, as before
        yield
    finally:
        os.close(fd)  # releases the lock


def clean_temp(split_dir: Path, keep_own: bool = False, shard: str | None = None) -> list[str]:
    """Remove leftovers of interrupted writes (promoting a temporary checksum that
    matches its committed step); returns the names removed.  Temporaries of other live
    processes are kept, and this process's own too with ``keep_own`` (another Writer of
    this process may be writing them). Looks in the side folder and the split folder.
    ``shard`` (``".rank00002-of-00004."``): only that rank's files, else ("") only those of whole steps:
    the ranks of a dump may run on other hosts, where a pid says nothing (docs/RELIABILITY.md)."""
    if is_remote(split_dir):
        return remote.clean_temp(split_dir)
    check_real_dirs(split_dir)  # never delete through a linked folder (docs/RELIABILITY.md, threat model)
    gone = []
    for d in places(split_dir):
        for n in stale_temps(d, TMP_PREFIX, keep_own):
            if shard is not None and not (shard in n if shard else ".rank" not in n):
                continue  # another rank's (or, for a whole-step writer, any rank's)
            m = TMP_SUM_RE.match(n)
            if m and _promote(split_dir, m.group(1), d / n):
                continue
            (d / n).unlink(missing_ok=True)
            gone.append(n)
        for n in os.listdir(d) if d.is_dir() else []:
            m = SUM_RE.match(n)  # only a step file's checksum: never another *.sha256 of the folder
            if m and not os.path.lexists(split_dir / f"{m.group(1)}.parquet"):
                (d / n).unlink(missing_ok=True)  # checksum of a step that was never committed
                gone.append(n)
    return gone


def _promote(split_dir: Path, stem: str, side_tmp: Path) -> bool:
    final = split_dir / f"{stem}.parquet"
    with _commit_lock(split_dir):  # a live writer's commit of the step does not interleave
        return _promote_locked(final, stem, side_tmp)


def _promote_locked(final: Path, stem: str, side_tmp: Path) -> bool:
    try:
        recorded = checksums.read_sum(side_tmp)
        if not final.exists() or recorded is None or checksums.file_sha256(final) != recorded:
            return False
        side = side_tmp.parent / f"{stem}{checksums.SUM_SUFFIX}"
        if checksums.read_sum(side) != recorded:
            os.replace(side_tmp, side)
            fsync_dir(side.parent)
            return True
    except (OSError, FormatError):  # FormatError: not a regular file (store/regular.py); left to readers
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
    final = split_dir / (name or step_name(step))
    tmp = d / f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        if d != split_dir and not split_dir.is_dir():
            return False  # no such split
        if os.path.lexists(final):
            return False  # committed (by another writer racing on the step): not skipped
        d.mkdir(exist_ok=True)
        write_durable(tmp, skipped_record(step, reason))
        os.replace(tmp, path)
        if os.path.lexists(final):  # committed meanwhile: its commit may have looked for a record before ours
            path.unlink(missing_ok=True)
            return False
        fsync_dir(d)
        return True
    except OSError:
        return False
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
