"""Writer: append one step's batch as one Parquet file, atomically, in the background.

``append`` takes a snapshot of the batch and returns; encoding, compression and file I/O run on
background thread(s). What is recorded is the batch as it was at ``append``:

* CUDA tensors are copied into reused pinned host buffers on a side stream that first waits on
  the caller's current stream; the caller's stream then waits (on the GPU, the calling thread does
  not block) for that copy, so later in-place updates queued on it cannot race the copy.
* CPU torch tensors are not copied. Their version counters (``t._version``) are recorded, and
  checked again before and after the step is encoded; if one changed (an in-place update after
  ``append``), the step is *not* written and ``WriterError`` names the step and field. Pass
  ``copy=True`` to clone CPU tensors on the caller's thread instead. Writes that bypass torch's
  counter (through a ``.numpy()`` view, ``.data`` or another alias of the memory) are not seen.
* numpy arrays have no version counter, so an in-place change could not be detected: numeric
  numpy arrays are always copied at ``append`` (a memcpy; they are small in RL batches); object
  and string arrays are copied shallowly.
* dicts, lists and tuples are rebuilt at ``append`` (a shallow copy of the structure, one level
  per container); Python scalars and strings are immutable. Other objects are kept by reference.

The structure is checked on the caller's thread (types, dtypes, keys, shapes, lengths: never
values), so a malformed batch raises ``BatchError`` from ``append`` itself; the full checks run
with the encoding, in the background.

Memory is bounded: at ``max_pending_steps`` steps or ``max_pending_bytes`` bytes (tensor bytes)
not yet on disk, ``append`` waits; the time waited is logged (logger ``trajstore.writer``) and
counted in ``writer.stats``. A failure in the background is raised, as ``WriterError`` naming the
step, by the next ``append``, ``flush()`` or ``close()``; other steps keep being written.
``flush()`` waits for every pending step; an interpreter exit flushes open writers.
"""

from __future__ import annotations

import atexit
import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from . import schema, torch_bridge
from .format import check as _batchcheck
from .format import containers as adapters
from .format.spec import where
from .store import commit as _commit
from .store import index as _index
from .store import paths
from .errors import ConfigError, StepExistsError, TrajstoreError, WriterError

__all__ = ["Writer"]

log = logging.getLogger("trajstore.writer")
MAX_META_BYTES = 1 << 20
ROW_GROUPS = 16  # at most this many row groups per step file: a reader decodes them on several cores
ROW_GROUP_BYTES = 4 << 20  # ...of at least this much Arrow data each (a small step is one row group)
ZSTD_LEVEL = 3
LOG_EVERY_S = 60.0  # at most one 'append waited' warning a minute per writer


def parquet_options(table) -> dict:
    """Per-column encodings, chosen by the encoding benchmark (benchmarks/RESULTS.md): on float32
    log-probs BYTE_STREAM_SPLIT (BSS) is the smallest (-7% vs plain, -41% vs dictionary); on Zipf
    token ids BSS is 7% smaller than plain and 5% larger than dictionary, but writes 2.4x faster
    than dictionary; DELTA_BINARY_PACKED is larger. zstd levels above 3 gained < 1% for 3x the
    write time. So: BSS for 16/32/64-bit tensor values, dictionary for everything else (masks,
    strings, JSON), zstd 3, and up to ``ROW_GROUPS`` row groups of at least ``ROW_GROUP_BYTES``
    so a reader decodes a large step on several cores, while a small step stays one row group
    (a smaller footer and one page per column: reading one column of many steps is ~3x faster)."""
    bss, dic = [], []
    for f in table.schema:
        t = f.type.value_type if hasattr(f.type, "value_type") else f.type
        # Parquet options name leaf columns: a list column's values are "<name>.list.element"
        names = [f.name, f"{f.name}.list.element"] if hasattr(f.type, "value_type") else [f.name]
        if (f.metadata or {}).get(b"trajstore.kind") in (b"token", b"sample", b"cell") and (
            t.bit_width in (16, 32, 64) and str(t) not in ("bool",)
        ):
            bss += names
        else:
            dic += names
    return {
        "compression": "zstd",
        "compression_level": ZSTD_LEVEL,
        "use_dictionary": dic,
        "use_byte_stream_split": bss,
        "write_statistics": ["step"],
        "row_group_size": max(1, -(-table.num_rows // max(1, min(ROW_GROUPS, table.nbytes // ROW_GROUP_BYTES)))),
    }


def check_meta(meta: Any, step: int) -> dict:
    if meta is None:
        return {}
    if type(meta) is not dict:
        raise ConfigError(f"step {step}: meta must be a dict, got {type(meta).__name__}")
    schema.check_json(meta, f"step {step} meta")
    n = len(json.dumps(meta))
    if n > MAX_META_BYTES:
        raise ConfigError(f"step {step}: meta is {n} bytes of JSON, the limit is {MAX_META_BYTES}; "
                          "store large values as batch fields instead")
    return meta


# ----------------------------------------------------------------------------- snapshot
class _Snapshot:
    """The batch of one step as it was at ``append``, plus what the background must check."""

    def __init__(self, copy: bool):
        self.copy = copy
        self.versions: list[tuple[str, torch.Tensor, int]] = []
        self.cuda: list[tuple[str, torch.Tensor]] = []
        self.nbytes = 0

    def take(self, v: Any, path: tuple) -> Any:
        if isinstance(v, torch.Tensor):
            self.nbytes += v.numel() * v.element_size()
            if v.device.type == "cuda":
                self.cuda.append((where(path), v))
                return _CudaSlot(len(self.cuda) - 1)
            if v.device.type != "cpu":
                return v.detach().cpu()
            if self.copy:
                return v.detach().clone()
            self.versions.append((where(path), v, v._version))
            return v
        if isinstance(v, np.ndarray):
            self.nbytes += v.nbytes
            return v.copy()
        if isinstance(v, dict):
            return {k: self.take(x, path + (k,)) for k, x in v.items()}
        if isinstance(v, list):
            return [self.take(x, path + (i,)) for i, x in enumerate(v)]
        if isinstance(v, tuple):
            return tuple(self.take(x, path + (i,)) for i, x in enumerate(v))
        return v

    def check(self, step: int) -> None:
        for name, t, ver in self.versions:
            if t._version != ver:
                raise WriterError(
                    f"step {step}: field {name!r} was modified in place after append (its tensor "
                    "version changed); the step was not written. Pass copy=True to append, or do not "
                    "modify the tensor before flush()"
                )


class _CudaSlot:
    def __init__(self, i: int):
        self.i = i


def _fill_cuda(v: Any, hosts: list) -> Any:
    if isinstance(v, _CudaSlot):
        return hosts[v.i]
    if isinstance(v, dict):
        return {k: _fill_cuda(x, hosts) for k, x in v.items()}
    if isinstance(v, list):
        return [_fill_cuda(x, hosts) for x in v]
    if isinstance(v, tuple):
        return tuple(_fill_cuda(x, hosts) for x in v)
    return v


class _Job:
    def __init__(self, step, batch, tag, meta, overwrite, snap, hosts, cuda_snaps):
        self.step, self.batch, self.tag, self.meta, self.overwrite = step, batch, tag, meta, overwrite
        self.snap, self.hosts, self.cuda_snaps = snap, hosts, cuda_snaps
        self.nbytes = snap.nbytes


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
class Writer:
    """Append steps to a dump at ``path``; use as a context manager.

    >>> with trajstore.Writer("dumps/run1") as w:
    ...     w.append(0, batch, meta={"lr": 1e-6})     # returns at once; written in the background

    ``on_error="raise"`` (default) raises a step that failed in the background into the next
    ``append``/``flush``/``close``; ``on_error="warn"`` logs a warning and goes on. Either way the
    failed step is recorded as ``step_N.skipped.json`` (``Reader.skipped``).
    ``max_pending_steps`` / ``max_pending_bytes`` bound the steps not yet on disk (``append``
    waits at the limit; see ``stats``); ``workers`` background threads write steps concurrently
    (with more than one, steps may be committed out of order). ``close()`` (or the ``with`` block)
    flushes and ends the threads; a writer never closed is flushed and closed at interpreter exit.
    The first append of CUDA tensors allocates pinned host memory; later steps reuse it.
    Plain per-trajectory fields (``rewards``...) of the steps written are also kept in the split's
    index for ``Reader.column`` (``<split>/_index/``, docs/FORMAT.md section 6): a segment every
    ``_index.INDEX_EVERY`` steps and on ``flush``/``close``; an index error is only logged.
    """

    def __init__(self, path: str | Path, split: str = "train", *, overwrite: bool = False,
                 max_pending_steps: int = 8, max_pending_bytes: int = 4 << 30, workers: int = 1,
                 on_error: str = "raise"):
        if on_error not in ("raise", "warn"):
            raise ConfigError(f"Writer({str(path)!r}): on_error must be 'raise' or 'warn', got {on_error!r}")
        self.on_error = on_error
        for name, v in (("max_pending_steps", max_pending_steps), ("max_pending_bytes", max_pending_bytes),
                        ("workers", workers)):
            if type(v) is not int or v < 1:
                raise ConfigError(f"Writer({str(path)!r}): {name} must be an int >= 1, got {v!r}")
        self.path = Path(path)
        self.split = paths.check_split(split)
        self.overwrite = overwrite
        self.max_pending_steps, self.max_pending_bytes = max_pending_steps, max_pending_bytes
        self.manifest = paths.create_manifest(self.path)
        self.dir = self.path / self.split
        self.dir.mkdir(exist_ok=True)
        with _live_lock:  # another open Writer of this process on this split may be mid-write
            busy = any(w.dir == self.dir and not w._closed for w in _live)
        _commit.clean_temp(self.dir, keep_own=busy)
        _index.clean_temp(self.dir, keep_own=busy)
        self._index = _index.Collector(self.dir, self.split)  # Reader.column's index (trajstore/_index.py)
        self._closed = False
        self._lock = threading.Lock()          # one append at a time
        self._cond = threading.Condition()     # guards everything below
        self._pending: dict[int, int] = {}     # step -> jobs queued or being written
        self._pending_bytes = 0
        self._errors: list[WriterError] = []
        self._last_log = -LOG_EVERY_S
        self._stats = {"appended": 0, "written": 0, "failed": 0, "append_s": 0.0, "max_append_s": 0.0,
                       "wait_s": 0.0, "waits": 0, "max_wait_s": 0.0, "write_s": 0.0,
                       "bytes_in": 0, "bytes_written": 0}
        self._pool = torch_bridge.PinnedPool(max_cached_bytes=max_pending_bytes)
        self._queue: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._run, name=f"trajstore-writer-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()
        with _live_lock:
            _live.add(self)

    # -- caller's side
    def append(self, step: int, batch: Any, meta: dict | None = None, *, overwrite: bool | None = None,
               copy: bool = False) -> None:
        """Record ``batch`` as step ``step`` (with JSON-able step metadata ``meta``).

        Returns once the batch is snapshotted (see the module doc); ``copy=True`` clones CPU
        tensors now, so the caller may modify them in place afterwards."""
        t0 = time.perf_counter()
        with self._lock:
            if self._closed:
                raise WriterError(f"append(step={step}) on a closed Writer for {self.dir}; open a new Writer")
            step = paths.check_step(step)
            self._raise_errors(f"; step {step} was not appended, call append again to record it")
            meta = check_meta(meta, step)
            ow = self.overwrite if overwrite is None else overwrite
            final = self.dir / paths.step_name(step)
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
            plain, tag = adapters.unwrap(batch)
            _batchcheck.check(plain)  # types, keys, shapes, lengths: errors now, not one step later
            snap = _Snapshot(copy)
            plain = snap.take(plain, ())
            hosts, cuda_snaps = [], []
            if snap.cuda:
                hosts, cuda_snaps = torch_bridge.snapshot_cuda([t for _, t in snap.cuda], self._pool)
            job = _Job(step, plain, tag, meta, ow, snap, hosts, cuda_snaps)
            self._admit(job, queued and len(self._threads) > 1)
            self._queue.put(job)
        dt = time.perf_counter() - t0
        with self._cond:
            self._stats["appended"] += 1
            self._stats["append_s"] += dt
            self._stats["max_append_s"] = max(self._stats["max_append_s"], dt)

    def _admit(self, job: _Job, same_step_pending: bool) -> None:
        with self._cond:
            n = job.nbytes

            def full() -> bool:
                if same_step_pending and job.step in self._pending:
                    return True  # keep two writes of one step in order
                if not self._pending:
                    return False  # a step larger than the byte limit still goes, alone
                return (sum(self._pending.values()) >= self.max_pending_steps
                        or self._pending_bytes + n > self.max_pending_bytes)

            if full():
                t0 = time.perf_counter()
                while full():
                    self._cond.wait()
                w = time.perf_counter() - t0
                s = self._stats
                s["wait_s"] += w
                s["waits"] += 1
                s["max_wait_s"] = max(s["max_wait_s"], w)
                now = time.monotonic()
                if now - self._last_log >= LOG_EVERY_S:  # the first wait, then at most once a minute
                    self._last_log = now
                    log.warning("append(step=%d) waited %.1f ms for the background writer of %s (limits: "
                                "%d steps, %d bytes pending; %d waits, %.3f s in all so far); raise "
                                "max_pending_steps/max_pending_bytes or workers, or dump less often",
                                job.step, w * 1e3, self.dir, self.max_pending_steps, self.max_pending_bytes,
                                s["waits"], s["wait_s"])
            self._pending[job.step] = self._pending.get(job.step, 0) + 1
            self._pending_bytes += n
            self._stats["bytes_in"] += n

    @property
    def stats(self) -> dict:
        """Counters: steps appended/written/failed, seconds spent in ``append`` (``append_s``,
        ``max_append_s``), seconds ``append`` waited at the pending limit (``wait_s``, ``waits``,
        ``max_wait_s``), background seconds (``write_s``), tensor bytes in, file bytes written,
        and what is pending now."""
        with self._cond:
            return {**self._stats, "pending_steps": sum(self._pending.values()),
                    "pending_bytes": self._pending_bytes}

    def flush(self) -> None:
        """Wait until every appended step is on disk (or failed); raise the first failure."""
        with self._cond:
            while self._pending:
                if not any(t.is_alive() for t in self._threads):
                    raise WriterError(f"the background writer of {self.dir} is gone with "
                                      f"{len(self._pending)} step(s) pending: {sorted(self._pending)}")
                self._cond.wait(1.0)
        self._index.flush()  # best effort, never raises
        self._raise_errors()

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
                    for _ in self._threads:
                        self._queue.put(None)
                    for t in self._threads:
                        t.join()
                    self._index.flush()  # rows of steps appended while close() flushed
                    with _live_lock:
                        _live.discard(self)

    def _raise_errors(self, suffix: str = "") -> None:
        with self._cond:
            errs, self._errors = self._errors, []
        if not errs:
            return
        if len(errs) == 1:
            e = errs[0]
            err = WriterError(f"{e}{suffix}")
        else:
            steps = [e.step for e in errs]
            err = WriterError(f"{len(errs)} steps failed in the background: {steps}; the first: {errs[0]}{suffix}")
        err.step = errs[0].step
        err.steps = [e.step for e in errs]
        raise err from (errs[0].__cause__ or errs[0])

    # -- background side
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            t0 = time.perf_counter()
            nbytes, err = 0, None
            try:
                nbytes = self._write(job)
            except BaseException as e:  # noqa: BLE001 - every failure is reported to the caller
                err = e
            finally:
                for c in job.cuda_snaps:
                    c.release()
                job.batch = job.hosts = job.snap = None
            with self._cond:
                s = self._stats
                s["write_s"] += time.perf_counter() - t0
                if err is None:
                    s["written"] += 1
                    s["bytes_written"] += nbytes
                else:
                    s["failed"] += 1
                    if self.on_error == "raise":
                        self._errors.append(_as_writer_error(err, job.step))
                        log.error("trajstore: step %d was not written: %s", job.step, err)
                    else:
                        log.warning("trajstore: step %d was not written (on_error='warn', the run goes on; "
                                    "the step is recorded as skipped in %s): %s", job.step, self.dir, err)
            if err is not None:  # best effort: readers then say why the step is missing
                _commit.record_skipped(self.dir, job.step, f"{type(err).__name__}: {err}")
            with self._cond:
                self._pending_bytes -= job.nbytes
                self._pending[job.step] -= 1
                if not self._pending[job.step]:
                    del self._pending[job.step]
                self._cond.notify_all()

    def _write(self, job: _Job) -> int:
        step, snap = job.step, job.snap
        for c in job.cuda_snaps:
            c.wait()
        batch = _fill_cuda(job.batch, job.hosts) if job.hosts else job.batch
        snap.check(step)
        table = schema.encode_plain(batch, job.tag, step=step, split=self.split, meta=job.meta)
        final = self.dir / paths.step_name(step)
        tmp = self.dir / paths.temp_name(step)
        try:
            pq.write_table(table, tmp, **parquet_options(table))
            index_rows = self._index.take(step, table)  # a copy, checked by snap.check below
            del table
            snap.check(step)  # the values may have changed while they were being encoded
            st = tmp.stat()
            size = st.st_size
            _commit.commit(tmp, final, job.overwrite)
            self._index.add(step, index_rows, st, final)  # never raises
            return size
        except FileExistsError:
            raise StepExistsError(
                f"step {step} was committed to {final} by someone else while it was being written; "
                "pass overwrite=True to replace it"
            ) from None
        except OSError as e:
            raise WriterError(f"step {step}: writing {final} failed: {e}; earlier steps are intact") from e
        finally:
            tmp.unlink(missing_ok=True)

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
        return f"Writer({str(self.path)!r}, split={self.split!r})"


def _as_writer_error(e: BaseException, step: int) -> WriterError:
    if isinstance(e, WriterError) and f"step {step}" in str(e):
        out = WriterError(str(e))
    else:
        out = WriterError(f"step {step} was not written: {type(e).__name__}: {e}")
    out.__cause__ = e
    out.step = step
    return out
