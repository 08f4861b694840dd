"""Only regular files are read from a dump, and its small files only up to a cap (docs/RELIABILITY.md,
threat model).

A dump is untrusted input: a FIFO named like a step file blocks ``open(2)`` until someone writes to it,
and ``/dev/zero`` linked in as ``trajstore.json`` reads forever. Every local file of a dump is opened
here: read-only, non-blocking (opening a FIFO returns at once instead of waiting for a writer), then
``fstat`` of the open descriptor decides. Anything but a regular file is a :class:`FormatError` naming
the file and what it is. Symbolic links are followed (a dump assembled with ``ln -s``/``cp -s`` reads as
its copy would), and what they point to must be a regular file too. Step files reach pyarrow as a
``pyarrow.OSFile`` of the checked descriptor (``/proc/self/fd/<n>`` on Linux: the very inode checked,
even if the name is replaced after the check), never as a name pyarrow opens by itself.

Manifests, column records, skip records and checksums are read through :func:`read_small`, capped at
:data:`MAX_SMALL_FILE_BYTES` (checksums at :data:`MAX_SUM_BYTES`): over the cap is a FormatError naming
the file and the cap, before more than the cap is read.

A ``RemotePath`` (object storage, ``store/fs.py``) has no special files; at most the cap + 1 bytes of
it are read."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from typing import Any

import pyarrow as pa

from ..errors import FormatError

__all__ = ["MAX_SMALL_FILE_BYTES", "MAX_SUM_BYTES", "CHUNK", "open_checked", "input_file", "read_small", "read_upto",
           "sha256_of", "not_regular", "kind", "fd_path", "entries"]

# the most bytes read of one manifest (trajstore.json), columns.json or skip record: ample for an
# environment fingerprint, far below what could hurt a reader
MAX_SMALL_FILE_BYTES = 16 << 20
MAX_SUM_BYTES = 4096  # a checksum file holds one `sha256sum` line
_PROC_FD = os.path.isdir("/proc/self/fd")  # Linux: reopen the checked descriptor, not the name


def kind(mode: int) -> str:
    """What a file of mode ``mode`` is, in words."""
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def not_regular(path: Any, what: str, mode: int | None) -> FormatError:
    its = kind(mode) if mode is not None else "a socket or another special file"
    links = "such a file is never read through a link" if mode is not None and stat.S_ISLNK(mode) else \
        "a symbolic link must point to one"
    return FormatError(
        f"{path}: {what} is {its}, not a regular file; trajstore reads only regular files from a dump ({links}), "
        "so it is not read: remove it, or replace it with the file it stands for (docs/RELIABILITY.md, threat model)")


def open_checked(path: Any, what: str = "the file", follow: bool = True) -> tuple[int, os.stat_result]:
    """A read-only descriptor of ``path`` and its ``fstat``, after checking it is a regular file
    (FormatError naming it otherwise; with ``follow=False`` a symbolic link is refused too); the
    caller closes it. FileNotFoundError (and other OSErrors of ``open``) pass through."""
    nofollow = 0 if follow else getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | nofollow)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket, or a device without its driver
            raise not_regular(path, what, _lmode(path)) from None
        if e.errno == errno.ELOOP and nofollow:  # the link itself
            raise not_regular(path, what, stat.S_IFLNK) from None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise not_regular(path, what, st.st_mode)
    return fd, st


def _lmode(path: Any) -> int | None:
    try:
        return os.stat(path).st_mode
    except OSError:
        return None


def input_file(path: Any, what: str = "the step file") -> Any:
    """What pyarrow reads the local file ``path`` from: a ``pyarrow.OSFile`` of the checked file."""
    fd, _ = open_checked(path, what)
    try:
        return pa.OSFile(fd_path(fd, path))
    finally:
        os.close(fd)


def fd_path(fd: int, path: Any) -> str:
    """A name that opens the file of descriptor ``fd`` (``path``'s, checked): ``/proc/self/fd/<n>`` on
    Linux, the very inode checked even if the name is replaced after the check; elsewhere ``path``
    itself, opened again right after the check (a file swapped in between is not checked again)."""
    return f"/proc/self/fd/{fd}" if _PROC_FD else os.fspath(path)


def read_small(path: Any, what: str, cap: int = MAX_SMALL_FILE_BYTES, follow: bool = True) -> bytes:
    """The bytes of a small file of a dump (manifest, record, checksum), at most ``cap`` of them:
    FormatError naming the file and the cap if it is larger, or if it is not a regular file (or, with
    ``follow=False``, a symbolic link)."""
    if not isinstance(path, os.PathLike | str):  # a RemotePath: no special files on object storage
        data = path.read_at_most(cap + 1)
        if len(data) > cap:
            raise _too_large(path, what, cap, None)
        return data
    fd, st = open_checked(path, what, follow)
    with os.fdopen(fd, "rb", buffering=0) as f:
        if st.st_size > cap:
            raise _too_large(path, what, cap, st.st_size)
        data = read_upto(f.read, cap + 1)  # the file may have grown since the fstat
    if len(data) > cap:
        raise _too_large(path, what, cap, None)
    return data


CHUNK = 8 << 20  # what one read of a dump's file asks for at most: memory grows with what is read, never by a cap


def read_upto(read: Any, n: int) -> bytes:
    """At most ``n`` bytes from ``read(k)`` (a file's or stream's read), asked ``CHUNK`` at a time:
    ``read(n)`` itself would allocate ``n`` bytes up front (a cap of 16 GiB + 1 under ``ulimit -v``)."""
    parts, got = [], 0
    while got < n:
        b = read(min(CHUNK, n - got))
        if not b:
            break
        parts.append(b if isinstance(b, bytes) else bytes(b))
        got += len(parts[-1])
    return b"".join(parts) if len(parts) != 1 else parts[0]


def sha256_of(read: Any) -> str:
    """The SHA-256 of everything ``read(k)`` gives, ``CHUNK`` bytes at a time (bounded memory)."""
    h = hashlib.sha256()
    while b := read(CHUNK):
        h.update(b)
    return h.hexdigest()


def entries(folder: Any, odd: Any) -> tuple[list[str], dict[str, str]]:
    """The names in local ``folder`` that are regular files (or links to one), and name -> what it is of
    the others for which ``odd(name)`` holds. The file type comes with the listing (``d_type``): no
    ``stat`` per file except for links. ([], {}) if there is no such folder."""
    try:
        it = os.scandir(folder)
    except FileNotFoundError:
        return [], {}
    names, other = [], {}
    with it:
        for e in it:
            try:
                if e.is_file():
                    names.append(e.name)
                    continue
            except OSError:
                pass
            if odd(e.name):
                try:
                    other[e.name] = kind(e.stat().st_mode)
                except OSError:
                    other[e.name] = "a dangling symbolic link"
    return names, other


def _too_large(path: Any, what: str, cap: int, size: int | None) -> FormatError:
    has = f"{size} bytes" if size is not None else "more"
    return FormatError(
        f"{path}: {what} holds {has}, over the {cap} bytes trajstore reads of such a file "
        "(trajstore.store.regular: MAX_SMALL_FILE_BYTES, MAX_SUM_BYTES); it is not a file trajstore wrote: "
        "the dump is damaged or hostile")
