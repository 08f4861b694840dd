"""A fault-injecting layer: make the Nth write-path call under a directory fail with ENOSPC/EIO.

    with inject(root, "fsync", errno.EIO, nth=1):
        ...   # the first fsync of a file under root raises OSError(EIO)

Points: "data" (the Parquet bytes written by pyarrow.parquet.write_table, after ``after_bytes``),
"open", "write", "fsync", "link", "replace" (os-level calls the commit makes).  ``persist=True``
keeps failing from the Nth call on (a full disk); otherwise the fault fires once (a transient
error).  Only calls on paths under ``root`` count, so the rest of the process is unaffected; calls
on the split's index (``_trajstore/<split>/index/``, or ``<split>/_index/`` of layout 1; best effort, faulted in tests/test_index.py) do not
count unless ``root`` is that folder.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import io
import os
import threading
from pathlib import Path

import pyarrow.parquet as pq

POINTS = ("data", "open", "write", "fsync", "link", "replace")


class Fault:
    def __init__(self, root, point, err, nth, persist, after_bytes):
        assert point in POINTS, point
        self.root, self.point, self.err = os.path.realpath(root), point, err
        self.nth, self.persist, self.after_bytes = nth, persist, after_bytes
        self.calls = 0
        self.fired = 0
        self.fds: set[int] = set()
        self.lock = threading.Lock()

    def under(self, p) -> bool:
        try:
            p = os.path.realpath(os.fspath(p))
        except TypeError:
            return False
        if not p.startswith(self.root + os.sep):
            return False
        parts = p[len(self.root):].split(os.sep)
        side = [i for i, x in enumerate(parts) if x == "_trajstore"]  # _trajstore/<split>/index/
        return "_index" not in parts and not any(parts[i + 2:i + 3] == ["index"] for i in side)

    def hit(self, point: str, target: str = "") -> None:
        if point != self.point:
            return
        with self.lock:
            self.calls += 1
            fire = self.calls == self.nth or (self.persist and self.calls > self.nth)
            if fire:
                self.fired += 1
        if fire:
            raise OSError(self.err, os.strerror(self.err), target)


class _FailingFile(io.RawIOBase):
    def __init__(self, f, fault: Fault, name: str):
        self.f, self.fault, self.name, self.n = f, fault, name, 0

    def writable(self):
        return True

    def write(self, b):
        if self.n + len(b) > self.fault.after_bytes:
            self.fault.hit("data", self.name)
        self.n += len(b)
        return self.f.write(b)

    def close(self):
        self.f.close()
        super().close()


@contextlib.contextmanager
def inject(root, point: str, err: int = _errno.ENOSPC, nth: int = 1, persist: bool = False,
           after_bytes: int = 0):
    fault = Fault(root, point, err, nth, persist, after_bytes)
    real = {n: getattr(os, n) for n in ("open", "write", "fsync", "link", "replace", "close")}
    real_write_table = pq.write_table

    def o_open(path, flags, *a, **k):
        # reads of a dump's files (store/regular.py: read-only, non-blocking) are not on the write path
        if fault.under(path) and not flags & os.O_NONBLOCK:
            fault.hit("open", os.fspath(path))
            fd = real["open"](path, flags, *a, **k)
            fault.fds.add(fd)
            return fd
        return real["open"](path, flags, *a, **k)

    def o_close(fd):
        fault.fds.discard(fd)
        return real["close"](fd)

    def o_write(fd, data):
        if fd in fault.fds:
            fault.hit("write", f"fd {fd}")
        return real["write"](fd, data)

    def o_fsync(fd):
        if fd in fault.fds:
            fault.hit("fsync", f"fd {fd}")
        return real["fsync"](fd)

    def o_link(src, dst, *a, **k):
        if fault.under(dst):
            fault.hit("link", os.fspath(dst))
        return real["link"](src, dst, *a, **k)

    def o_replace(src, dst, *a, **k):
        if fault.under(dst):
            fault.hit("replace", os.fspath(dst))
        return real["replace"](src, dst, *a, **k)

    def write_table(table, where, *a, **k):
        if isinstance(where, str | Path) and fault.under(where):
            with open(where, "wb") as f:
                return real_write_table(table, _FailingFile(f, fault, os.fspath(where)), *a, **k)
        return real_write_table(table, where, *a, **k)

    patches = {"open": o_open, "close": o_close, "write": o_write, "fsync": o_fsync, "link": o_link,
               "replace": o_replace}
    for n, fn in patches.items():
        setattr(os, n, fn)
    pq.write_table = write_table
    try:
        yield fault
    finally:
        for n, fn in real.items():
            setattr(os, n, fn)
        pq.write_table = real_write_table
