"""Durable file operations of the store: fsync of files and folders, exclusive durable writes,
and which temporary files were left by a process that is gone.

Every temporary of the store is named ``<prefix>...tmp-<pid>[-<random>]``: the pid of the
process writing it, so a later writer can tell a leftover of a killed process from a write in
progress."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from ..errors import FormatError
from .fs import is_remote
from .regular import kind

__all__ = ["fsync", "fsync_dir", "write_durable", "alive", "stale_temps", "listdir", "mkdir_real", "check_real"]


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    try:
        fsync(path)
    except OSError:  # some filesystems refuse fsync on directories
        pass


def write_durable(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        data = text.encode()
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    finally:
        os.close(fd)


def mkdir_real(d: Path) -> None:
    """Make folder ``d`` of a dump (if missing), refusing a link or another file in its place (``check_real``)."""
    try:
        d.mkdir()
    except FileExistsError:
        pass
    check_real(d)


def check_real(d: Path) -> None:
    """FormatError if ``d`` is a symbolic link or another file where a folder of the dump should be
    (nothing there is fine): a writer writes and cleans up only in the dump's own folders."""
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        return
    raise FormatError(
        f"{d}: {kind(st.st_mode)} where the dump's folder {d.name!r} should be; a Writer writes and cleans up "
        "only in the dump's own folders (a link could make it delete or write files elsewhere: "
        "docs/RELIABILITY.md, threat model), so it refuses this dump: replace the link with the folder it "
        "points to (or write the dump where the link points)")


def listdir(folder: Any) -> list[str]:
    """``os.listdir``, also of a folder on object storage (a ``store.fs.RemotePath``)."""
    return folder.listdir() if is_remote(folder) else os.listdir(folder)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_temps(folder: Path, prefix: str, keep_own: bool = False) -> list[str]:
    """The names (sorted) of the temporaries ``<prefix>...tmp-<pid>...`` in ``folder`` whose writer is
    gone: no pid in the name, or a process that is not running. This process's own temporaries
    count as gone unless ``keep_own`` (another writer of this process may be writing them)."""
    try:
        names = sorted(listdir(folder))
    except OSError:
        return []
    out = []
    for n in names:
        if n.startswith(prefix) and ".tmp-" in n:
            pid = n.rsplit(".tmp-", 1)[1].split("-")[0]
            if pid.isascii() and pid.isdigit() and (int(pid) != os.getpid() or keep_own) and alive(int(pid)):
                continue  # a live writer's temporary
            out.append(n)
    return out
