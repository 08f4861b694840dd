"""The writer's background: a few threads encode and write several steps at once; every step is
committed in the order it was appended.

Each appended step is a :class:`Job` with a sequence number. A worker thread takes the next job
(first in, first out) and

1. waits for the snapshot's copies and encodes the batch into an Arrow table (``schema.encode_plain``:
   torch and numpy kernels, which release the GIL) -- concurrently with the other workers;
   Each worker's torch kernels use ``1/N`` of torch's threads (``_share_cores``);
2. fits the table's column types to the split's record (``store/columns.py``) -- in append order, so the
   type a column name gets does not depend on which worker came first;
3. writes the Parquet file to a temporary in the side folder (or, on object storage, into memory):
   pyarrow encodes and compresses with the GIL released; then fsyncs and hashes it (``commit.prepare``)
   -- concurrently;
4. checks the batch did not change (``append(copy=False)``), commits the file (``store/commit.py`` or
   ``store/remote.py``), indexes it and reports it (``finish``) -- in append order.

Steps 2 and 4 take turns by sequence number (:class:`Turns`). A job waits only for jobs appended
before it, each of them already taken by a worker (the queue is first in, first out), so the earliest
unfinished job never waits and the pool cannot deadlock. The files are the same, byte for byte, as
with one worker. Memory stays bounded by the writer's admission (``max_pending_steps`` /
``max_pending_bytes``): at most that many steps are in the pool, whatever the number of workers.
A crash at any point leaves at most temporaries, removed by the next writer of the split; every
committed step is whole.

The workers run at a lower CPU priority than the training process (``BACKGROUND_NICE`` added to each
worker thread's nice value, on Linux, where a thread's nice value is its own): with as many workers as
the writer's thread budget, a backlog of steps is written on every core the trainer leaves idle, and
the trainer's own threads go first where they want the cores.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..base import threads as _threads
from .. import schema
from ..errors import BatchError, StepExistsError, TrajstoreError, WriterError
from ..format.file.parquet import ZSTD_LEVEL, parquet_options
from ..format.shard.shards import RANK_COLUMN
from ..format.shard import ids as idcol
from .snapshot import Snapshot, with_rank
from ..store import commit, paths, remote
from ..store.fs import is_remote

__all__ = ["Job", "Turns", "Pool", "Steps"]

log = logging.getLogger("trajstore.writer")


class Job:
    """One appended step: its batch's snapshot, container tag, envelope meta and overwrite flag;
    ``nbytes`` its tensor bytes (counted against ``max_pending_bytes``); ``seq`` its place in append order."""

    def __init__(self, step: int, snap: Snapshot, tag: dict | None, meta: dict, overwrite: bool, nbytes: int):
        self.step, self.snap, self.tag, self.meta, self.overwrite = step, snap, tag, meta, overwrite
        self.nbytes, self.seq = nbytes, -1
        self.ids: Any = None  # the rows' trajectory ids (format/shard/ids.py), stored in their columns when given


class Turns:
    """Turns by sequence number: ``wait(seq)`` returns once every lower number called ``done``."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0

    def wait(self, seq: int) -> None:
        with self._cond:
            while self._next < seq:
                self._cond.wait()

    def done(self, seq: int) -> None:
        with self._cond:
            self._next = max(self._next, seq + 1)
            self._cond.notify_all()


class Steps:
    """How one step becomes a committed file of split folder ``dir`` (the writer's settings)."""

    def __init__(self, dir: Any, split: str, shard: tuple[int, int] | None, masks: dict | None, encodings: str,
                 columns: Any, index: Any, compression: tuple = ("zstd", ZSTD_LEVEL)):
        self.dir, self.split, self.shard, self.masks, self.encodings = dir, split, shard, masks, encodings
        self.compression = compression
        self.columns, self.index = columns, index

    def final(self, step: int) -> Path:
        """The file step ``step`` is committed as: its step file, or this rank's shard file."""
        if self.shard is None:
            return self.dir / paths.step_name(step)
        return self.dir / paths.shard_name(step, *self.shard)

    def encode(self, job: Job) -> pa.Table:
        """Stage 1: the step's Arrow table."""
        batch = job.snap.batch()
        job.snap.check(job.step)
        extra = job.meta if self.shard is None else {**job.meta, "shard": {"rank": self.shard[0],
                                                                            "world_size": self.shard[1]}}
        if job.ids is not None:
            extra = {**extra, **idcol.ENVELOPE}
        table = schema.encode_plain(batch, job.tag, step=job.step, split=self.split, extra=extra, masks=self.masks,
                                    unpadded=job.snap.unpadded)
        if self.shard is not None:
            table = with_rank(table, self.shard[0], job.step)
        if job.ids is not None:
            table = idcol.add(table, job.ids, job.step)
        return table

    def fit(self, job: Job, table: pa.Table) -> pa.Table:
        """Stage 2 (in append order): one type per column name (docs/FORMAT.md 3.11)."""
        table = self.columns.fit(job.step, table)  # its new columns recorded before the commit
        if self.shard is not None and RANK_COLUMN not in table.column_names:  # moved: the split holds another type
            raise BatchError(f"step {job.step}: {self.dir} holds a column 'rank' of another type (a field of whole "
                             "steps); shards of several ranks need that name for their int32 rank column")
        return table

    def write(self, job: Job, table: pa.Table) -> tuple:
        """Stage 3: the Parquet bytes, in a temporary file (or in memory for object storage);
        returns what ``commit`` needs."""
        final = self.final(job.step)
        opts = parquet_options(table, self.encodings, self.compression)
        with _translated(job, final):
            if is_remote(final):
                sink = pa.BufferOutputStream()
                pq.write_table(table, sink, **opts)
                return (final, None, sink.getvalue(), None, table.num_rows)
            tmp = paths.temp_path(self.dir, job.step, final.name)  # in the side folder: the split holds step files only
            try:
                pq.write_table(table, tmp, **opts)
                index_rows = self.index.take(job.step, table)  # a copy, checked by snap.check at the commit
                commit.prepare(tmp)  # its fsync and hash here, in parallel: the commits take turns
            except BaseException:
                commit.forget(tmp)
                tmp.unlink(missing_ok=True)
                raise
            return (final, tmp, None, index_rows, table.num_rows)

    def commit(self, job: Job, written: tuple) -> tuple[int, int]:
        """Stage 4 (in append order): commit what ``write`` wrote; returns (file bytes, rows)."""
        final, tmp, data, index_rows, rows = written
        job.snap.check(job.step)  # the values may have changed while they were being encoded
        with _translated(job, final):
            if tmp is None:
                remote.commit(final, data, job.overwrite)
                return data.size, rows
            st = tmp.stat()
            commit.commit(tmp, final, job.overwrite)
        self.index.add(job.step, index_rows, st, final)  # never raises
        return st.st_size, rows

    @staticmethod
    def discard(written: tuple | None) -> None:
        if written is not None and written[1] is not None:
            commit.forget(written[1])
            written[1].unlink(missing_ok=True)


class _translated:
    """OS errors of a step's write or commit as the writer's errors, naming the step and file."""

    def __init__(self, job: Job, final: Any):
        self.job, self.final = job, final

    def __enter__(self) -> None:
        return None

    def __exit__(self, tp: Any, e: BaseException | None, tb: Any) -> None:
        step, final = self.job.step, self.final
        if e is None or isinstance(e, TrajstoreError):
            return
        if isinstance(e, FileExistsError):
            if is_remote(final):
                raise StepExistsError(f"step {step} was committed to {final} by another writer while it was being "
                                      "written (its conditional PUT found the object); pass overwrite=True to "
                                      "replace it") from None
            raise StepExistsError(f"step {step} was committed to {final} by someone else while it was being "
                                  "written; pass overwrite=True to replace it") from None
        if isinstance(e, OSError):
            raise WriterError(f"step {step}: writing {final} failed: {e}; earlier steps are intact") from e


def _quietly(fn: Callable[[], Any], job: Job) -> None:
    """A clean-up that must not end the worker (its step's turn and bookkeeping still follow)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        log.error("trajstore: cleaning up after step %d failed: %s: %s", job.step, type(e).__name__, e)


_OPENMP: bool | None = None


def _openmp() -> bool:
    global _OPENMP
    if _OPENMP is None:
        _OPENMP = "parallel backend: OpenMP" in torch.__config__.parallel_info()
    return _OPENMP


def _share_cores(share: int) -> None:
    """On a worker thread: its torch kernels use ``share`` threads, so N workers encoding at once do
    not start N full thread teams (OpenMP backend only: there the count is per thread)."""
    try:
        torch.set_num_threads(share)
        torch.get_num_threads()  # torch takes this thread's count now (later, it would take the last one set)
    except RuntimeError as e:  # never fatal: the worker then uses torch's own setting
        log.warning("trajstore: a writer thread could not set its torch threads: %s", e)


BACKGROUND_NICE = 10  # what a worker thread adds to its nice value (the default of nice(1))


def _background_priority() -> None:
    """On a worker thread: lower its CPU priority by ``BACKGROUND_NICE`` (Linux only: elsewhere a
    priority call with a thread id would name a process). Never fatal."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
    except (AttributeError, OSError) as e:
        log.debug("trajstore: a writer thread kept its CPU priority: %s", e)


class Pool:
    """``n`` background threads running the four stages of each submitted job (module doc), then
    ``finish(job, file bytes, rows, error or None, seconds)`` in append order. ``finish`` must not raise."""

    def __init__(self, n: int, steps: Steps, finish: Callable[[Job, int, int, BaseException | None, float], None],
                 threads: int = 1):
        self.steps, self.finish, self.threads = steps, finish, threads
        self._queue: queue.Queue = queue.Queue()
        self._seq = 0
        self._fits, self._commits = Turns(), Turns()
        # each worker's share of the writer's thread budget for its torch kernels (not of torch's own
        # count: torchrun sets OMP_NUM_THREADS=1); torch also keeps the last count set as the one new
        # threads start with, so the caller's count is set again once every worker took its share
        # (else the caller's later threads, and the next Writer's workers, would start with the share)
        base = torch.get_num_threads()
        self._share = max(1, threads // n) if _openmp() else None
        self._ready = threading.Barrier(n + 1) if self._share is not None else None
        self._threads = [threading.Thread(target=self._run, name=f"trajstore-writer-{i}", daemon=True)
                         for i in range(n)]
        for t in self._threads:
            t.start()
        if self._ready is not None:
            try:
                self._ready.wait(timeout=60)
                torch.set_num_threads(base)
            except (threading.BrokenBarrierError, RuntimeError) as e:  # never fatal
                log.warning("trajstore: the writer could not restore torch's thread count: %s", e)

    def __len__(self) -> int:
        return len(self._threads)

    def submit(self, job: Job) -> None:
        """Queue ``job`` (called by one appending thread at a time: the writer's append lock)."""
        job.seq, self._seq = self._seq, self._seq + 1
        self._queue.put(job)

    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def stop(self) -> None:
        """End the threads once the queued jobs are done."""
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()

    def _run(self) -> None:
        _background_priority()
        if self._share is not None:
            _share_cores(self._share)
            try:
                self._ready.wait(timeout=60)
            except threading.BrokenBarrierError:
                pass
        with _threads.using(self.threads):  # the copies and joins of an encode: the writer's budget
            while True:
                job = self._queue.get()
                if job is None:
                    return
                self._one(job)

    def _one(self, job: Job) -> None:
        t0 = time.perf_counter()
        failed: list[BaseException] = []  # the first failure; the later stages are skipped

        def stage(fn: Callable[..., Any], *args: Any) -> Any:
            if failed:
                return None
            try:
                return fn(*args)
            except BaseException as e:  # noqa: BLE001 - every failure is reported to the caller
                failed.append(e)
                return None

        table = stage(self.steps.encode, job)
        self._fits.wait(job.seq)
        try:
            table = stage(self.steps.fit, job, table)
        finally:
            self._fits.done(job.seq)
        written = stage(self.steps.write, job, table)
        table = None
        self._commits.wait(job.seq)
        try:
            try:
                nbytes, rows = stage(self.steps.commit, job, written) or (0, 0)
            finally:
                _quietly(lambda: self.steps.discard(written), job)
                _quietly(job.snap.release, job)
                job.snap = None
            try:
                self.finish(job, nbytes, rows, failed[0] if failed else None, time.perf_counter() - t0)
            except BaseException as e:  # noqa: BLE001 - the pool must go on (flush would wait forever)
                log.error("trajstore: the writer's bookkeeping of step %d failed: %s: %s", job.step,
                          type(e).__name__, e, exc_info=True)
        finally:
            self._commits.done(job.seq)
