"""What a writer tells of its steps (``Writer`` delegates here): the :class:`Committed` record handed to
``on_commit``, a step that failed in the background (its skipped record, the ``WriterError`` naming it,
raised into the next ``append``/``flush``/``close`` or logged with ``on_error="warn"``), the waits of
``append`` at the pending limit (logged at most once a minute), and the counters of ``Writer.stats``.

Log lines go to the logger ``trajstore.writer``."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BatchError, BatchWriteError, WriterError
from ..store import commit
from .pool import Job

__all__ = ["Committed", "counters", "waited", "finish", "raise_errors", "as_writer_error"]

log = logging.getLogger("trajstore.writer")
LOG_EVERY_S = 60.0  # at most one 'append waited' warning a minute per writer


@dataclass(frozen=True)
class Committed:
    """A step the writer committed, as given to ``Writer(on_commit=...)``: its ``step``, its file
    ``path``, the file's ``bytes``, the batch's ``rows`` (trajectories) and the background
    ``seconds`` it took (encode, write, commit)."""

    step: int
    path: Path
    bytes: int
    rows: int
    seconds: float


def counters() -> dict:
    """A new writer's counters (``Writer.stats`` adds what is pending now)."""
    return {"appended": 0, "written": 0, "failed": 0, "append_s": 0.0, "max_append_s": 0.0,
            "wait_s": 0.0, "waits": 0, "max_wait_s": 0.0, "write_s": 0.0,
            "bytes_in": 0, "bytes_written": 0}


def waited(w: Any, step: int, seconds: float) -> None:
    """``append(step)`` of writer ``w`` waited ``seconds`` at the pending limit: counted, and logged the
    first time, then at most once a minute. Called holding ``w._cond``."""
    s = w._stats
    s["wait_s"] += seconds
    s["waits"] += 1
    s["max_wait_s"] = max(s["max_wait_s"], seconds)
    now = time.monotonic()
    if now - w._last_log >= LOG_EVERY_S:  # the first wait, then at most once a minute
        w._last_log = now
        log.warning("append(step=%d) waited %.1f ms for the background writer of %s (limits: "
                    "%d steps, %d bytes pending; %d waits, %.3f s in all so far); raise "
                    "max_pending_steps/max_pending_bytes or workers, or dump less often",
                    step, seconds * 1e3, w.dir, w.max_pending_steps, w.max_pending_bytes,
                    s["waits"], s["wait_s"])


def finish(w: Any, job: Job, nbytes: int, rows: int, err: BaseException | None, dt: float) -> None:
    """Step ``job`` of writer ``w`` is committed (``err`` None; ``nbytes``: its file's size) or failed:
    counted, a failure recorded as skipped and kept for the next call (or logged), ``on_commit`` told;
    then the step leaves the pending ones. Called by ``trajstore/write/pool.py`` in append order."""
    recorded = False  # best effort: readers then say why the step is missing (none if it is there)
    if err is not None:
        try:
            recorded = commit.record_skipped(w.dir, job.step, f"{type(err).__name__}: {err}",
                                             w.final(job.step).name)
        except Exception as e:  # noqa: BLE001 - a record that cannot be written is said below
            log.debug("trajstore: skipped record of step %d not written: %s", job.step, e)
    with w._cond:
        s = w._stats
        s["write_s"] += dt
        if err is None:
            s["written"] += 1
            s["bytes_written"] += nbytes
        else:
            s["failed"] += 1
            if w.on_error == "raise":
                w._errors.append(as_writer_error(err, job.step))
                log.error("trajstore: step %d was not written: %s", job.step, err)
            else:
                log.error("trajstore: step %d was not written (on_error='warn', the run goes on; %s): %s",
                          job.step, f"the step is recorded as skipped in {w.dir}" if recorded else
                          "no skipped record was written: " + ("its step file is there (another writer "
                          "committed it)" if w.final(job.step).exists() else "the record could not be "
                          "written"), err)
    try:
        if err is None and w.on_commit is not None:
            _report(w, Committed(job.step, w.final(job.step), nbytes, rows, dt))
    finally:
        w._done(job.step, job.nbytes)


def _report(w: Any, rec: Committed) -> None:
    try:
        w.on_commit(rec)
    except BaseException as e:  # noqa: BLE001 - a callback must never stop the writer thread
        log.error("trajstore: on_commit(%r) of %r raised %s: %s; the step is written, the writer goes on",
                  rec, w, type(e).__name__, e, exc_info=True)


def raise_errors(w: Any, suffix: str = "") -> None:
    """Raise the steps of writer ``w`` that failed in the background since the last call, as one
    ``WriterError`` (``BatchWriteError`` if each was a ``BatchError``) naming them; ``suffix`` ends its message."""
    with w._cond:
        errs, w._errors = w._errors, []
    if not errs:
        return
    steps = [e.step for e in errs]
    msg = f"{errs[0]}{suffix}" if len(errs) == 1 else \
        f"{len(errs)} steps failed in the background: {steps}; the first: {errs[0]}{suffix}"
    cls = BatchWriteError if all(isinstance(e, BatchError) for e in errs) else WriterError
    raise cls(msg, step=steps[0], steps=steps) from (errs[0].__cause__ or errs[0])


def as_writer_error(e: BaseException, step: int) -> WriterError:
    """``e``, raised writing step ``step``, as the ``WriterError`` that names the step."""
    cls = BatchWriteError if isinstance(e, BatchError) else WriterError  # except BatchError catches it
    if isinstance(e, WriterError) and f"step {step}" in str(e):
        out = cls(str(e), step=step)
    else:
        out = cls(f"step {step} was not written: {type(e).__name__}: {e}", step=step)
    out.__cause__ = e
    return out
