"""Writer: append one step's batch as one Parquet file, atomically, in the background.

``append`` takes a snapshot of the batch and returns; encoding, compression and file I/O run on
background threads. What is recorded is the batch as it was at ``append``: CUDA tensors are
copied to pinned host memory (the calling thread does not block), CPU tensors and numpy arrays are
copied into reused host buffers (``copy=True``, the default; with ``copy=False`` CPU tensors are kept
and their version counters checked: an in-place update after ``append`` fails the step with
``WriterError``), tensors inside object arrays and containers too (``trajstore/write/snapshot.py`` says
exactly what is kept and how).

``workers`` threads encode and write several steps at once, committing them in append order
(``trajstore/write/pool.py``): the files are the same as with one worker.

The structure is checked on the caller's thread (types, dtypes, keys, shapes, lengths: never
values), so a malformed batch raises ``BatchError`` from ``append`` itself; the full checks run
with the encoding, in the background.

Memory is bounded: at ``max_pending_steps`` steps or ``max_pending_bytes`` bytes (tensor bytes)
not yet on disk, ``append`` waits; the time waited is logged (logger ``trajstore.writer``) and
counted in ``writer.stats``. A failure in the background is raised, as ``WriterError`` naming the
step, by the next ``append``, ``flush()`` or ``close()``; other steps keep being written.
``flush()`` waits for every pending step; an interpreter exit flushes open writers. What a writer
reports (``on_commit`` records, failures, waits, counters) is built in ``trajstore/write/reports.py``.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..base import threads as _threads
from ..device.pinned import PinnedPool
from ..format.batch import check
from ..format.batch import containers
from ..format.file.parquet import check_compression, check_encodings
from ..store import columns
from ..store import commit
from ..store import index
from ..store import manifest, paths
from ..store import remote
from ..store.fs import is_remote, resolve
from ..errors import ConfigError, StepExistsError, TrajstoreError, WriterError
from ..format.shard import ids as idcol
from .snapshot import Snapshot, check_meta, check_rank_field, nbytes_of
from .pool import Job, Pool, Steps
from . import reports
from .reports import Committed

__all__ = ["Writer", "Committed"]

log = logging.getLogger("trajstore.writer")


_live: set[Writer] = set()
_live_lock = threading.Lock()


@atexit.register
def _flush_at_exit() -> None:
    with _live_lock:
        writers = list(_live)
    for w in writers:
        try:
            w.close()
        except Exception as e:  # noqa: BLE001 - report every writer, never crash the exit
            log.error("trajstore: at exit, %r failed: %s", w, e)


# ----------------------------------------------------------------------------- writer
def default_workers(threads: int) -> int:
    """Background workers when ``Writer(workers=None)``: the writer's thread budget. They run at a lower
    CPU priority than the trainer (``pool.BACKGROUND_NICE``): a backlog is written on the cores the
    training process leaves idle, and its own threads come first."""
    return threads


def default_pending(workers: int) -> int:
    """``max_pending_steps`` when ``Writer(max_pending_steps=None)``: two steps per worker, at least 8
    (``max_pending_bytes`` bounds their memory whatever the count)."""
    return max(8, 2 * workers)


class Writer:
    """Append steps to a dump at ``path``; use as a context manager.

    >>> with trajstore.Writer("dumps/run1") as w:
    ...     w.append(0, batch, meta={"lr": 1e-6})     # returns at once; written in the background

    ``on_error="raise"`` (default) raises a step that failed in the background into the next
    ``append``/``flush``/``close``; ``on_error="warn"`` logs it (at ERROR) and goes on. Either way the
    failed step is recorded as ``_trajstore/<split>/step_N.skipped.json`` (``Reader.skipped``).
    ``max_pending_steps`` / ``max_pending_bytes`` bound the steps not yet on disk (``append``
    waits at the limit; see ``stats``; default ``max(8, 2 * workers)`` steps, 4 GiB); ``workers`` background
    threads (default: the thread budget, ``threads``, at a lower CPU priority than the trainer's threads) encode
    and write that many steps at once, each committed in append order (``trajstore/write/pool.py``).
    ``copy`` is ``append``'s default for ``copy`` (below). ``close()`` (or the ``with`` block)
    flushes and ends the threads; a writer never closed is flushed and closed at interpreter exit.
    The first append of CUDA tensors allocates pinned host memory; later steps reuse it.
    ``masks={"completion_mask": ["old_per_token_logps", ...]}`` declares which ``[B, W, ...]`` fields
    follow which mask field, where the names and shapes do not tell (docs/FORMAT.md section 3.4).
    Plain per-trajectory fields (``rewards``...) of the steps written are also kept in the split's
    index for ``Reader.column`` (``_trajstore/<split>/index/``, docs/FORMAT.md section 6): a segment every
    ``index.INDEX_EVERY`` steps and on ``flush``/``close``; an index error is only logged.
    ``encodings`` chooses the Parquet encodings (docs/FORMAT.md 3.5): "portable" (default), which
    every Parquet reader decodes, or "compact": BYTE_STREAM_SPLIT for tensor values, smaller
    float columns for readers that support it (pyarrow, pandas, Polars, DuckDB, DataFusion, Spark,
    Ray Data; not fastparquet). ``compression``: "zstd" (default, level 1), "zstd:<level>" (-7 to 22)
    or "lz4_raw": cheaper to decode, larger (docs/FORMAT.md 3.5).
    ``path`` may be a URL (``s3://bucket/run1``, ``gs://``, ``hdfs://``, any fsspec protocol; ``fs``: a
    ``pyarrow.fs.FileSystem`` or fsspec file system to use): each step is then one PUT of the whole
    object (``trajstore/store/fs.py``, docs/RELIABILITY.md "Object storage").
    ``on_commit`` is called on a background thread, in append order, with a :class:`Committed` record once each
    step is committed, before ``flush`` returns; an error it raises is logged, never raised.
    ``rank``/``world_size`` (SPMD): this process appends rank ``rank``'s shard of each step, one file
    ``step_<n>.rank<r>-of-<N>.parquet`` with an int32 ``rank`` column (a field named ``rank`` is refused);
    readers see a step once all N shards are committed (docs/FORMAT.md section 1).
    ``threads``: the writer's thread budget (``append``'s copies, the workers and their torch
    threads); default ``$TRAJSTORE_THREADS``, else this process's cores shared among the ranks of this
    host (``$LOCAL_WORLD_SIZE``), never ``OMP_NUM_THREADS`` (README, Threads); ``stats["threads"]``.
    """

    def __init__(self, path: str | Path, split: str = "train", *, overwrite: bool = False,
                 max_pending_steps: int | None = None, max_pending_bytes: int = 4 << 30, workers: int | None = None,
                 on_error: str = "raise", on_commit: Callable[[Committed], Any] | None = None,
                 masks: dict[str, list[str]] | None = None, encodings: str = "portable",
                 rank: int | None = None, world_size: int | None = None, fs: Any = None, copy: bool = True,
                 threads: int | None = None, compression: str = "zstd"):
        if on_error not in ("raise", "warn"):
            raise ConfigError(f"Writer({str(path)!r}): on_error must be 'raise' or 'warn', got {on_error!r}")
        if on_commit is not None and not callable(on_commit):
            raise ConfigError(f"Writer({str(path)!r}): on_commit must be callable, got {on_commit!r}")
        self.on_error, self.on_commit = on_error, on_commit
        self.encodings = check_encodings(encodings, f"Writer({str(path)!r})")
        self.compression = check_compression(compression, f"Writer({str(path)!r})")
        if masks is not None and not (isinstance(masks, dict) and all(
                type(k) is str and isinstance(v, list | tuple) and all(type(x) is str for x in v)
                for k, v in masks.items())):
            raise ConfigError(f"Writer({str(path)!r}): masks must be a dict {{mask field: [field names]}}, "
                              f"got {masks!r}")
        self.masks = {k: list(v) for k, v in masks.items()} if masks else None
        if type(copy) is not bool:
            raise ConfigError(f"Writer({str(path)!r}): copy must be True or False, got {copy!r}")
        self.copy = copy
        self.threads = _threads.budget(threads, f"Writer({str(path)!r})")
        workers = default_workers(self.threads) if workers is None else workers
        if max_pending_steps is None and type(workers) is int and workers >= 1:
            max_pending_steps = default_pending(workers)
        for name, v in (("workers", workers), ("max_pending_steps", max_pending_steps),
                        ("max_pending_bytes", max_pending_bytes)):
            if type(v) is not int or v < 1:
                raise ConfigError(f"Writer({str(path)!r}): {name} must be an int >= 1, got {v!r}")
        self.shard = paths.check_shard(rank, world_size, f"Writer({str(path)!r})")  # (rank, N) or None
        self.path = resolve(path, f"Writer({str(path)!r})", fs)  # a Path, or a RemotePath (store/fs.py)
        self.split = paths.check_split(split)
        self.overwrite = overwrite
        self.max_pending_steps, self.max_pending_bytes = max_pending_steps, max_pending_bytes
        self.manifest = (remote.create_manifest if is_remote(self.path) else manifest.create_manifest)(self.path)
        self.dir = self.path / self.split
        paths.make_split(self.dir)  # refuses a linked split or side folder before any clean-up (docs/RELIABILITY.md)
        with _live_lock:  # another open Writer of this process on this split may be mid-write
            busy = any(w.dir == self.dir and not w._closed for w in _live)
        mine = "" if self.shard is None else paths.shard_tag(*self.shard)
        commit.clean_temp(self.dir, keep_own=busy, shard=mine)  # a rank cleans its own files only
        if self.shard is None:  # other ranks' index temporaries may be live on other hosts
            index.clean_temp(self.dir, keep_own=busy)
        # Reader.column's index (store/index.py); object storage keeps none (store/remote.py)
        self._index = remote.NoIndex() if is_remote(self.dir) else index.Collector(self.dir, self.split, self.shard)
        self._columns = columns.SplitColumns(self.dir, clean=self.shard is None)  # one type per column name (docs/FORMAT.md 3.11)
        self._closed = False
        self._lock = threading.Lock()          # one append at a time
        self._cond = threading.Condition()     # guards everything below
        self._pending: dict[int, int] = {}     # step -> jobs queued or being written
        self._pending_bytes = 0
        self._errors: list[WriterError] = []
        self._last_log = -reports.LOG_EVERY_S
        self._stats = reports.counters()
        self._pool = PinnedPool(max_cached_bytes=max_pending_bytes)  # CUDA copies: pinned
        self._staging = PinnedPool(max_cached_bytes=max_pending_bytes, pin=False)  # CPU copies
        self._steps = Steps(self.dir, self.split, self.shard, self.masks, self.encodings, self._columns, self._index,
                            self.compression)
        self.workers = workers
        self._workers = Pool(workers, self._steps, self._finish, self.threads)
        with _live_lock:
            _live.add(self)

    # -- caller's side
    def append(self, step: int, batch: Any, meta: dict | None = None, *, overwrite: bool | None = None,
               copy: bool | None = None, ids: Any = None) -> None:
        """Record ``batch`` as step ``step``, with step metadata ``meta``: a dict of what a batch's
        non-tensor values may hold (numpy scalars and arrays, tuples, non-str keys, bytes, tensors),
        read back by ``Reader.meta`` with the same types.

        Returns once the batch is snapshotted (see the module doc): with ``copy=True`` (the
        writer's default, ``Writer(copy=...)``) CPU tensors and arrays are copied now, wherever they
        sit in the batch, so the caller may refill them right after ``append``. ``copy=False`` keeps
        CPU tensors by reference (no copy on the caller's thread): modifying one in place before it
        is written fails that step with ``WriterError`` (its version counter is checked).

        ``ids``: the trajectory id of each row (``Reader.ids`` of the rows this batch was computed from,
        ``[B, 2]`` of ``(step, row)``, or ``B`` rows of ``step``), stored in the step file's id columns
        (docs/FORMAT.md 3.13) so that a comparison joins its rows on them; without, a row's id is its
        place in the logical step."""
        t0 = time.perf_counter()
        with self._lock:
            if self._closed:
                raise WriterError(f"append(step={step}) on a closed Writer for {self.dir}; open a new Writer")
            step = paths.check_step(step)
            reports.raise_errors(self, f"; step {step} was not appended, call append again to record it")
            meta = check_meta(meta, step)
            ow = self.overwrite if overwrite is None else overwrite
            final = self.final(step)
            with self._cond:
                queued = step in self._pending
            if not ow and queued:
                raise StepExistsError(f"step {step} is already appended to {self.dir} and not yet written; "
                                      "pass overwrite=True to replace it, or use another step")
            if not ow and final.exists():
                raise StepExistsError(
                    f"step {step} already exists in {self.dir} ({final.name}); pass overwrite=True to "
                    "replace it, or write to another path or split"
                )
            whole = self.dir / paths.step_name(step)
            if self.shard is not None and whole.exists():
                raise StepExistsError(f"step {step} of {self.dir} is a whole step file ({whole.name}); a shard of it "
                                      "would make the step ambiguous; write to another path, split or step")
            plain, tag = containers.unwrap(batch)
            if self.shard is not None:
                check_rank_field(plain, step)
            if ids is not None:
                ids = idcol.normalize(ids, step, None)
                if isinstance(plain, dict):
                    idcol.check_fields(plain, step)
            check.check(plain, self.masks)  # types, keys, shapes, lengths: errors now, not one step later
            nbytes = nbytes_of(plain)
            self._admit(step, nbytes)  # before the copy: the buffers of steps written meanwhile are reused
            try:
                with _threads.using(self.threads):
                    snap = Snapshot(plain, self.copy if copy is None else bool(copy), self._pool, self._staging,
                                    self.masks)
            except BaseException:
                self._done(step, nbytes)
                raise
            job = Job(step, snap, tag, meta, ow, nbytes)
            job.ids = ids
            self._workers.submit(job)
        dt = time.perf_counter() - t0
        with self._cond:
            self._stats["appended"] += 1
            self._stats["append_s"] += dt
            self._stats["max_append_s"] = max(self._stats["max_append_s"], dt)

    def _admit(self, step: int, n: int) -> None:
        with self._cond:

            def full() -> bool:
                if not self._pending:
                    return False  # a step larger than the byte limit still goes, alone
                return (sum(self._pending.values()) >= self.max_pending_steps
                        or self._pending_bytes + n > self.max_pending_bytes)

            if full():
                t0 = time.perf_counter()
                while full():
                    self._cond.wait()
                reports.waited(self, step, time.perf_counter() - t0)
            self._pending[step] = self._pending.get(step, 0) + 1
            self._pending_bytes += n
            self._stats["bytes_in"] += n

    def _done(self, step: int, n: int) -> None:
        """A step admitted by ``_admit`` is written, failed or was never queued."""
        with self._cond:
            self._pending_bytes -= n
            self._pending[step] -= 1
            if not self._pending[step]:
                del self._pending[step]
            self._cond.notify_all()

    @property
    def stats(self) -> dict:
        """Counters: steps appended/written/failed, seconds spent in ``append`` (``append_s``,
        ``max_append_s``), seconds ``append`` waited at the pending limit (``wait_s``, ``waits``,
        ``max_wait_s``), background seconds summed over steps (``write_s``; a step's wait for its commit
        turn included), tensor bytes in, file bytes written,
        what is pending now, and the thread budget (``threads``) and background ``workers``."""
        with self._cond:
            return {**self._stats, "pending_steps": sum(self._pending.values()),
                    "pending_bytes": self._pending_bytes, "threads": self.threads, "workers": self.workers}

    def flush(self) -> None:
        """Wait until every appended step is on disk (or failed); raise the first failure."""
        with self._cond:
            while self._pending:
                if not self._workers.alive():
                    raise WriterError(f"the background writer of {self.dir} is gone with "
                                      f"{len(self._pending)} step(s) pending: {sorted(self._pending)}")
                self._cond.wait(1.0)
        self._index.flush()  # best effort, never raises
        reports.raise_errors(self)

    def close(self) -> None:
        """Flush, then stop the background threads. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            with self._lock:
                if not self._closed:
                    self._closed = True
                    self._workers.stop()
                    self._index.flush()  # rows of steps appended while close() flushed
                    with _live_lock:
                        _live.discard(self)

    # -- background side (trajstore/write/pool.py runs the steps; this is called in append order)
    def _finish(self, job: Job, nbytes: int, rows: int, err: BaseException | None, dt: float) -> None:
        reports.finish(self, job, nbytes, rows, err, dt)

    def final(self, step: int) -> Path:
        """The file step ``step`` is committed as: its step file, or this rank's shard file."""
        return self._steps.final(step)

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is already propagating: still write what was appended, never mask it
            self.close()
        except TrajstoreError as e:
            log.error("trajstore: closing %r after an exception: %s", self, e)

    def __repr__(self) -> str:
        sh = "" if self.shard is None else f", rank={self.shard[0]}, world_size={self.shard[1]}"
        return f"Writer({str(self.path)!r}, split={self.split!r}{sh})"

