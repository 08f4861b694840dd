"""Durable file operations of the store: fsync of files and folders, exclusive durable writes,
and whether the process that owns a temporary file is still running."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync", "fsync_dir", "write_durable", "alive"]


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


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
