"""Arrow's process-wide CPU pool raised to a read's thread budget while the read is in flight, and
given back once no such read is (README "Threads", docs/RELIABILITY.md "Threads and Arrow's pool").

Arrow sizes its CPU pool from ``OMP_NUM_THREADS``, which torchrun sets to 1: in every rank
``pyarrow.cpu_count()`` is then 1, and a step's row groups would decode on one thread whatever the
rank's budget (``threads.budget``). ``arrow_pool(n)`` around a read raises the pool to ``n`` where it is
smaller (``pyarrow.set_cpu_count``); concurrent reads (prefetch threads, several Readers) share one
raise: the pool is the largest budget among them, never lowered while one of them runs, and restored to
the size found before the first of them when the last one ends. A pool at least ``n`` (set by the user,
or sized from the cores) is never touched, so never shrunk. Restoring is eager: ``set_cpu_count`` itself
costs under a microsecond and Arrow starts pool threads as tasks come, so a raise costs a read at most
the start of its extra threads (measured in docs/RELIABILITY.md). If the pool was resized by someone
else meanwhile, that size is left as it is. A failing ``set_cpu_count`` never fails a read: it is logged
once and the read goes on with the pool as it is. A forked child gets the size found back.

May import: pyarrow (this module alone of ``base/``), the standard library.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa

__all__ = ["arrow_pool"]

log = logging.getLogger("trajstore.reader")

_lock = threading.Lock()
_reads = 0  # reads in flight that wanted more threads than the pool had before the first raise
_found: int | None = None  # the pool's size before that first raise (None: not raised)
_set = 0  # the size the raise set
_warned = False


def _resize(n: int) -> bool:
    """``pyarrow.set_cpu_count(n)``; False (logged once) where it fails."""
    global _warned
    try:
        pa.set_cpu_count(n)
        return True
    except Exception as e:  # never fail a read over the pool's size
        if not _warned:
            _warned = True
            log.warning("trajstore: could not resize Arrow's CPU pool to %d threads (%s: %s); reads go on "
                        "with the pool as it is (pyarrow.cpu_count() = %s)", n, type(e).__name__, e, _count())
        return False


def _count() -> int | str:
    try:
        return pa.cpu_count()
    except Exception as e:
        return f"unknown: {e}"


def _enter(n: int) -> bool:
    global _reads, _found, _set
    with _lock:
        if _found is None:
            cur = pa.cpu_count()
            if cur >= n or not _resize(n):
                return False
            _found, _set = cur, n
        elif n <= _found:
            return False
        elif n > _set and _resize(n):
            _set = n
        _reads += 1
        return True


def _exit() -> None:
    global _reads, _found
    with _lock:
        _reads -= 1
        if _reads == 0 and _found is not None:
            if pa.cpu_count() == _set:  # else resized by someone else meanwhile: theirs stays
                _resize(_found)
            _found = None


@contextmanager
def arrow_pool(n: int) -> Iterator[None]:
    """Arrow's CPU pool has at least ``n`` threads inside the block (see the module doc)."""
    entered = _enter(n)
    try:
        yield
    finally:
        if entered:
            _exit()


def _after_fork() -> None:  # a forked child has none of the reads in flight: its pool goes back
    global _lock, _reads, _found
    _lock, _reads = threading.Lock(), 0
    if _found is not None:
        found, _found = _found, None
        if pa.cpu_count() == _set:
            _resize(found)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
