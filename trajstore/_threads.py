"""The process-wide thread pool of the decoder and of ``append``'s copies (numpy copies and torch
kernels release the GIL), forgotten in a forked child, and the per-thread switch that keeps a
decode on its own thread."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

__all__ = ["run_parallel", "serial", "is_serial", "balance", "threads", "PARALLEL_BYTES", "PIECE_BYTES"]


def balance(items: list, size: Callable[[Any], int], target: int) -> list[list]:
    """``items`` cut into consecutive groups of about ``target`` bytes (at most one per pool thread
    times two), so a round on the thread pool is a few tasks, not one per chunk."""
    total = sum(size(x) for x in items)
    n = max(1, min(len(items), 2 * threads(), total // target))
    groups: list[list] = [[] for _ in range(n)]
    acc, per = 0, total / n if total else 1
    for x in items:
        groups[min(n - 1, int(acc // per))].append(x)
        acc += size(x)
    return [g for g in groups if g]


def threads() -> int:
    return min(16, os.cpu_count() or 1)


PARALLEL_BYTES = 1 << 20  # below this, work runs on the caller's thread
PIECE_BYTES = 1 << 20  # a join copies in pieces of at most this, so every pool thread gets a share
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:  # a forked child (DataLoader worker) has none of the parent's threads
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


_serial = threading.local()


def serial(on: bool = True) -> None:
    """Decode on the calling thread only (no thread pool), for this thread: set by callers that
    decode several steps at once, one per thread (``Reader.iter`` with a deep prefetch)."""
    _serial.on = on


def is_serial() -> bool:
    return getattr(_serial, "on", False)


def run_parallel(fn: Callable[[Any], None], items: Iterable, nbytes: int) -> None:
    """``fn(item)`` for every item: on a shared thread pool when ``nbytes`` of work is worth it
    (numpy copies and torch kernels release the GIL). The first error is raised."""
    items = list(items)
    if nbytes < PARALLEL_BYTES or len(items) < 2 or is_serial() or \
            threading.current_thread().name.startswith("trajstore-decode"):
        for x in items:
            fn(x)
        return
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=threads(), thread_name_prefix="trajstore-decode")
    futures = [_pool.submit(fn, x) for x in items]
    wait(futures)  # one wake-up of the calling thread, not one per item
    for f in futures:
        f.result()
