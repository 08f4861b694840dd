"""Arrow's process-wide CPU pool sized for the reads in flight, and given back once none is (README
"Threads").

Arrow sizes its CPU pool from ``OMP_NUM_THREADS``, which torchrun sets to 1: in every rank
``pyarrow.cpu_count()`` is then 1, and a step's row groups would decode on one thread whatever the
rank's budget (``threads.budget``). ``arrow_pool(n)`` around a read raises the pool to ``n`` where it is
smaller (``pyarrow.set_cpu_count``). ``arrow_pool(n, exact=True)``, around each read of a replay that
decodes several steps at once, one a thread (``threads.serial``: a deep prefetch), sets it to ``n``
(``threads.arrow_share``: three quarters of the budget, the rest left to those threads' joins),
lowering it where it is larger: on 16 cores that replay at prefetch 8 was faster with Arrow's pool at 12
threads than at 16 in each of 8 paired rounds, and the same at prefetch 4 (benchmarks/RESULTS.md, issue 23,
tenth round). Concurrent reads (prefetch threads, several
Readers) share one resize: the pool is the largest size among them (a plain read's at least the size
found), never lowered while one of them runs, and restored to the size found before the first of them
once the last one has ended and the pool has been idle for ``LINGER`` seconds (a timer): a read that
follows within that moment (a replay loop) finds the same threads. Restoring at once made back-to-back
reads slower (Arrow starts a thread per task up to the pool's size and lets extra threads exit when it
shrinks, so each read started its threads anew; measured in README "Threads"). A pool at least ``n``
(set by the user, or sized from the cores) is never touched by a plain read, so never shrunk by one; a
size someone else set while it was resized is the one kept (a later read resizes it again where it is
below its budget, or where a deep prefetch's share differs). A failing ``set_cpu_count`` never fails a
read: it is logged once and the read goes on with the pool as it is. A forked child, and the process at
exit, get the size found back at once.

May import: pyarrow (this module alone of ``base/``), the standard library.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa

__all__ = ["arrow_pool", "settle", "LINGER"]

LINGER = 0.5  # seconds the pool stays raised after the last read, for the next one

log = logging.getLogger("trajstore.reader")

_lock = threading.Lock()
_reads = 0  # reads in flight
_found: int | None = None  # the pool's size before trajstore first resized it (None: not resized)
_set = 0  # the size trajstore last set
_timer: threading.Timer | None = None  # the restore waiting for the pool to stay idle
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
                        "with the pool as it is", n, type(e).__name__, e)
        return False


def _enter(n: int, exact: bool) -> None:
    global _reads, _found, _set, _timer
    with _lock:
        cur = pa.cpu_count()
        if _found is not None and not _reads and cur != _set:
            _found = None  # resized by someone else while it lingered: that size is the one to keep
        base = cur if _found is None else _found  # the size found before trajstore resized it
        target = n if exact else max(n, base)
        if _reads:  # never lowered while a read is in flight
            target = max(target, cur)
        if target != cur and _resize(target):
            if _found is None:
                _found = cur
            _set = target
        if _timer is not None:
            _timer.cancel()
            _timer = None
        _reads += 1


def _exit() -> None:
    global _reads, _timer
    with _lock:
        _reads -= 1
        if _reads or _found is None:
            return
        if LINGER <= 0:
            _restore()
            return
        _timer = threading.Timer(LINGER, settle)
        _timer.daemon = True
        _timer.name = "trajstore-arrow-pool"
        _timer.start()


def _restore() -> None:  # (under the lock)
    global _found, _timer
    if pa.cpu_count() == _set:  # else resized by someone else meanwhile: theirs stays
        _resize(_found)
    _found, _timer = None, None


def settle() -> bool:
    """Restore Arrow's pool now if no read holds it raised (what the timer does after ``LINGER``); False
    where a read is still in flight (the pool is then left as it is)."""
    with _lock:
        if _reads == 0 and _found is not None:
            if _timer is not None:
                _timer.cancel()
            _restore()
        return _reads == 0


@contextmanager
def arrow_pool(n: int, exact: bool = False) -> Iterator[None]:
    """Arrow's CPU pool has at least ``n`` threads inside the block, or (``exact``) ``n`` where no other
    read is in flight (see the module doc)."""
    _enter(n, exact)
    try:
        yield
    finally:
        _exit()


def _after_fork() -> None:  # a forked child has none of the reads in flight, nor the timer
    global _lock, _reads, _timer
    _lock, _reads, _timer = threading.Lock(), 0, None
    settle()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
atexit.register(settle)
