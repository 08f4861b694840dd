"""The SHA-256 of every step file: the ``step_N.sha256`` sidecar (``sha256sum`` format) that
``commit`` records before a step becomes visible, and reads checked against it (docs/RELIABILITY.md).
The sidecar lives in the split's side folder (``paths.side_dir``: ``<dump>/_trajstore/<split>/``),
or beside the step file in a dump of layout 1; a digest recorded in either place is accepted."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..errors import ChecksumError, foreign_errors
from ..format import limits
from . import paths
from .files import listdir
from .fs import is_remote
from .regular import CHUNK, MAX_SUM_BYTES, fd_path, open_checked, read_small, sha256_of

__all__ = ["SUM_SUFFIX", "sum_path", "file_sha256", "sum_line", "read_sum", "pending_sums", "check_digest",
           "check_file", "read_verified", "recorded"]

SUM_SUFFIX = ".sha256"
_SUM_RE = re.compile(r"^([0-9a-f]{64})  ([!-~]+)\n?\Z")  # one `sha256sum` line (ASCII name)


def sum_path(f: Path) -> Path:
    """Where ``commit`` records the checksum of step file ``f``."""
    return paths.side_dir(f.parent) / f.with_suffix(SUM_SUFFIX).name


def file_sha256(path: Path) -> str:
    """The SHA-256 of a step file: FormatError if it is not a regular file (``store/regular.py``)."""
    if is_remote(path):
        return path.sha256()  # streamed: regular.CHUNK bytes in memory at a time
    return _sha256_stat(path)[0]


def _sha256_stat(path: Path) -> tuple[str, os.stat_result]:
    fd, st = open_checked(path, "the step file")
    with os.fdopen(fd, "rb", buffering=0) as f:
        return sha256_of(f.read), st


def check_file(f: Path, step: int) -> None:
    """Hash step file ``f`` and check it against its recorded checksum (``trajstore verify``): a
    mismatch of a file replaced while it was hashed (another writer overwriting the step) is looked at
    again, as in ``read_verified``."""
    if is_remote(f):
        check_digest(f, step, file_sha256(f))
        return
    for attempt in range(3):
        digest, before = _sha256_stat(f)
        try:
            check_digest(f, step, digest)
            return
        except ChecksumError:
            if attempt == 2 or _same_file(before, f):
                raise


def sum_line(digest: str, name: str) -> str:
    """One line in ``sha256sum`` format, so ``cd <dump>/<split> && sha256sum -c ../_trajstore/<split>/*.sha256``
    also checks a split."""
    return f"{digest}  {name}\n"


def read_sum(path: Path) -> str | None:
    """The digest recorded in a checksum file (None if absent or malformed; FormatError naming it if it
    is not a regular file or larger than a checksum line can be: ``store/regular.py``)."""
    try:
        raw = read_small(path, "the checksum file", MAX_SUM_BYTES)
        m = _SUM_RE.match(raw.decode("ascii"))
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return m.group(1) if m else None


def pending_sums(split_dir: Path, step: int, stem: str | None = None) -> list[str]:
    """Digests in temporary checksum files of ``step`` (of file ``stem``.parquet: a shard's) (a commit
    interrupted after step 2), in the side folder and the split folder."""
    pre = f".{stem or f'step_{step:08d}'}.sha256.tmp-"
    out = []
    for d in paths.places(split_dir):
        try:
            names = [n for n in listdir(d) if n.startswith(pre)]
        except (FileNotFoundError, NotADirectoryError):
            continue
        out += [s for n in names if (s := read_sum(d / n))]
    return out


PENDING = ".pending"  # object storage: <side>/.pending/<step file name>/<writer>.sha256 (store/remote.py)


def pending_dir(f: Any) -> Any:
    """Where writers on object storage put the pending checksums of step file ``f`` (store/remote.py)."""
    return paths.side_dir(f.parent) / PENDING / f.name


def pending_objects(f: Any) -> list[str]:
    """Digests in the pending checksums of step file ``f`` on object storage."""
    try:
        return [s for p in pending_dir(f).iterdir() if (s := read_sum(p))]
    except FileNotFoundError:
        return []


def _sums(f: Path) -> list[str]:
    """The digests recorded for step file ``f``: the side folder's, then one beside it (layout 1)."""
    name = f.with_suffix(SUM_SUFFIX).name
    return [s for d in paths.places(f.parent) if (s := read_sum(d / name))]


def recorded(f: Path) -> list[str]:
    """The digests recorded at commit for step file ``f`` (none: a dump written without them)."""
    return _sums(f)


def check_digest(f: Path, step: int, digest: str) -> None:
    """Raise ChecksumError unless ``digest`` is one recorded for step file ``f``."""
    if is_remote(f):
        if digest in _sums(f):
            return  # the usual case: no listing of pending checksums
        recorded, pending = _sums(f), pending_objects(f)
    else:
        recorded, pending = _sums(f), pending_sums(f.parent, step, f.stem)
    if digest in recorded or digest in pending:
        return
    # a writer may have renamed its temporary checksum into place between the two looks
    recorded = _sums(f) or recorded
    if digest in recorded:
        return
    if not recorded and not pending:
        raise ChecksumError(
            f"{f}: step {step} has no recorded checksum ({sum_path(f)} is missing or malformed), so it "
            "cannot be verified; run `trajstore verify` on the dump, or pass verify=False to read it anyway"
        )
    raise ChecksumError(
        f"{f}: step {step} is damaged: its SHA-256 is {digest[:16]}..., the checksum recorded at "
        f"commit is {(recorded or pending)[0][:16]}...; restore the file from a copy or rewrite the step"
    )


def read_verified(f: Path, step: int) -> Any:
    """What pyarrow reads step file ``f`` from once its bytes are checked against the recorded checksum.
    A local file is hashed ``regular.CHUNK`` bytes at a time (never held whole) and then read through the
    very descriptor checked (``regular.fd_path``: the inode hashed, even if the name is replaced since);
    an object of object storage is fetched once (a new version is a new object) and read from that
    buffer, which must not be owned by a Python object (decoded arrays may point into it)."""
    if is_remote(f):  # one GET: the object is whole, and a new version is a new object
        with foreign_errors(f, "reading step {}", step, then="check the object and the store"), f.open_input() as src:
            n = src.size()
            if n > limits.MAX_DECODED_BYTES:  # held whole: within the one decode budget
                raise limits.over(f, n, "the step object, held whole to check its SHA-256 (verify=True)")
            data = src.read_buffer()
        check_digest(f, step, hashlib.sha256(memoryview(data)).hexdigest())
        return pa.BufferReader(data)
    for attempt in range(3):
        with foreign_errors(f, "reading step {}", step, then="check the file and the file system"):
            fd, before = open_checked(f, "the step file")  # a regular file: never a FIFO or a device
        try:
            with foreign_errors(f, "reading step {}", step, then="check the file and the file system"):
                digest = _fd_sha256(fd)
            try:
                check_digest(f, step, digest)
            except ChecksumError:
                if attempt == 2 or _same_file(before, f):
                    raise
                continue  # the step was overwritten while it was hashed: hash the new version
            return pa.OSFile(fd_path(fd, f))
        finally:
            os.close(fd)
    raise AssertionError("unreachable")


def _fd_sha256(fd: int) -> str:
    """The SHA-256 of the file open as ``fd`` from its start, ``regular.CHUNK`` bytes at a time (the
    descriptor's offset is left as it was: ``pread``)."""
    h, off = hashlib.sha256(), 0
    while b := os.pread(fd, CHUNK, off):
        h.update(b)
        off += len(b)
    return h.hexdigest()


def _same_file(st: os.stat_result, f: Path) -> bool:
    try:
        now = os.stat(f)
    except OSError:
        return False
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns) == (now.st_ino, now.st_dev, now.st_size, now.st_mtime_ns)
