"""The thread budget of this process, the thread pools the decoder's joins and ``append``'s copies run
on (numpy copies and torch kernels release the GIL), forgotten in a forked child, and the per-thread
switch that keeps a decode on its own thread. A step's row groups decode on Arrow's pool, raised to
the budget while the read is in flight (``arrow_pool.py``).

The budget (README "Threads", docs/RELIABILITY.md): ``threads=`` of a Writer / Reader, else
``$TRAJSTORE_THREADS``, else the cores this process may run on (``os.sched_getaffinity``) shared among
the ranks of this host (``$LOCAL_WORLD_SIZE``, set by torchrun; else 1), at most ``MAX_DEFAULT``.
Never ``OMP_NUM_THREADS``, torch's thread count or ``pyarrow.cpu_count()``: torchrun sets
``OMP_NUM_THREADS=1``, which would leave every rank one thread, and N ranks each taking all the
cores would oversubscribe the host."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

from ..errors import ConfigError

__all__ = ["run_parallel", "map_parallel", "parallel", "serial", "is_serial", "balance", "threads", "budget", "using",
           "shared_pool", "submit", "arrow_share", "pieces", "cores", "local_ranks", "PARALLEL_BYTES", "PIECE_BYTES", "ENV",
           "MAX_DEFAULT"]

ENV = "TRAJSTORE_THREADS"
MAX_DEFAULT = 16  # the default budget's cap: more threads than this only contend for the GIL


def cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and ``taskset`` narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


def local_ranks() -> int:
    """The processes of this job on this host: ``$LOCAL_WORLD_SIZE`` (torchrun, accelerate, DeepSpeed's
    launcher), else 1 (a value that is not a positive integer counts as 1)."""
    v = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(v) if v.isdigit() and int(v) > 0 else 1


def _check(n: Any, what: str) -> int:
    if type(n) is not int or n < 1:
        raise ConfigError(f"{what}: the thread budget must be an int >= 1, got {n!r}; leave it unset for "
                          f"the cores of this process shared among the ranks of this host (README, Threads)")
    return n


def budget(threads: Any = None, who: str = "trajstore") -> int:
    """The threads a Writer or Reader of ``threads=`` uses (see the module doc)."""
    if threads is not None:
        return _check(threads, f"{who}: threads={threads!r}")
    v = os.environ.get(ENV, "").strip()
    if v:
        return _check(int(v) if v.isdigit() else v, f"{who}: ${ENV}={v!r}")
    return max(1, min(MAX_DEFAULT, cores() // local_ranks()))


_budget = threading.local()


@contextmanager
def using(n: int) -> Iterator[None]:
    """Work run by this thread inside the block (and the pools it hands work to) uses ``n`` threads."""
    old = getattr(_budget, "n", None)
    _budget.n = n
    try:
        yield
    finally:
        _budget.n = old


def threads() -> int:
    """The budget of the work on this thread: the one ``using`` set, else the process default."""
    n = getattr(_budget, "n", None)
    return budget() if n is None else n


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


PARALLEL_BYTES = 1 << 20  # below this, work runs on the caller's thread
PIECE_BYTES = 1 << 20  # a join copies in pieces of at most this, so every pool thread gets a share


def pieces(n: int, itemsize: int) -> list[slice]:
    """The slices of ``n`` values of ``itemsize`` bytes a copy on the pool is cut into: at most
    ``PIECE_BYTES`` each (``balance`` then groups them into a few tasks)."""
    step = max(1, PIECE_BYTES // max(1, itemsize))
    return [slice(i, i + step) for i in range(0, n, step)]


_pools: dict[int, ThreadPoolExecutor] = {}  # one pool per budget in use (usually one)
_pool_lock = threading.Lock()


def _forget_pool() -> None:  # a forked child (DataLoader worker) has none of the parent's threads
    global _pools, _pool_lock
    _pools, _pool_lock = {}, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


_serial = threading.local()


def serial(on: bool = True) -> None:
    """Decode on the calling thread only (no thread pool), for this thread: set by callers that
    decode several steps at once, one per thread (``Reader.iter`` with a deep prefetch)."""
    _serial.on = on


def is_serial() -> bool:
    return getattr(_serial, "on", False)


def arrow_share(n: int, direct: bool = False) -> int:
    """Arrow's CPU pool for a read of budget ``n`` on a serial thread (a deep prefetch decodes several
    steps at once, each joined on its own thread): three quarters of the budget, the rest left to
    those joins (``base/arrow_pool.py``; at most 3 threads, all of them). ``direct``: Arrow decodes into
    pinned memory (``device/decode_pool.py``), the joins hand its chunks over instead of copying them, and
    thirteen sixteenths do best (benchmarks/RESULTS.md, issue 23, eighteenth round; at most 5 threads, all of them)."""
    return n - (3 * n // 16 if direct else n // 4)


def _inline() -> bool:
    """Whether work of this thread runs on it alone: serial, or already on a pool thread."""
    return is_serial() or threading.current_thread().name.startswith("trajstore-decode")


def run_parallel(fn: Callable[[Any], None], items: Iterable, nbytes: int) -> None:
    """``fn(item)`` for every item: on a shared thread pool when ``nbytes`` of work is worth it
    (numpy copies and torch kernels release the GIL). The first error is raised."""
    map_parallel(fn, items, nbytes)


def parallel(nbytes: int) -> bool:
    """Whether ``nbytes`` of work of this thread goes to the pool (``map_parallel`` of several items)."""
    return nbytes >= PARALLEL_BYTES and threads() >= 2 and not _inline()


def shared_pool() -> ThreadPoolExecutor:
    """The shared thread pool of this thread's budget (made on first use)."""
    n = threads()
    with _pool_lock:
        pool = _pools.get(n)
        if pool is None:
            pool = _pools[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="trajstore-decode")
    return pool


def submit(fn: Callable[..., Any], *args: Any) -> Future | None:
    """``fn(*args)`` started on the shared pool without waiting for it (``Future``); where this
    thread's work runs on it alone (a budget of 1, ``serial``, or a pool thread) it runs now and
    None is returned."""
    if threads() < 2 or _inline():
        fn(*args)
        return None
    return shared_pool().submit(fn, *args)


def map_parallel(fn: Callable[[Any], Any], items: Iterable, nbytes: int) -> list:
    """``[fn(item) for item in items]``, the calls spread on a pool of this thread's budget when
    ``nbytes`` of work is worth it; the first error is raised."""
    items = list(items)
    if len(items) < 2 or not parallel(nbytes):
        return [fn(x) for x in items]
    pool = shared_pool()
    futures = [pool.submit(fn, x) for x in items]
    wait(futures)  # one wake-up of the calling thread, not one per item
    return [f.result() for f in futures]
