"""The dump/replay switch for a training loop.

>>> rec = trajstore.Recorder(trajstore.DumpReplayConfig.from_env())
>>> engine = None if rec.replaying else build_inference_engine()
>>> for step in range(start_step, total_steps):
...     batch = rec.batch(step, lambda: engine.prepare_batch(dataloader))
...     train_step(batch)

* **off** (neither ``dump`` nor ``replay``): ``batch`` returns ``fn()``; nothing else runs.
* **dump**: ``batch`` calls ``fn``, records the result when the step is selected
  (``every``/``steps``/``pin_steps``) and returns it unchanged.  A batch that cannot be stored
  never stops training: the step is recorded as skipped with the reason (``Reader.skipped``,
  ``trajstore verify``) and logged at ERROR naming the field; ``strict`` raises instead.  Steps beyond ``max_keep``
  (oldest first, pinned steps never) are deleted.  A dump that already holds steps is
  continued (``resume=True``): they count towards ``max_keep`` and a step recorded again
  replaces the old one, which is what a run restarted from a checkpoint needs.
* **replay**: ``fn`` is never called; the recorded batch comes back (on CPU, or on
  ``device``), a step that is not in the dump raises ``StepNotFoundError``.  With ``prefetch``
  the next recorded step is read in the background (``Reader.iter``) while the current one
  trains; a step asked out of order is read at once and the read-ahead goes on from there.
  The dump's environment fingerprint is compared with this process's at start-up; every
  difference is logged as a warning, or raised as ``EnvironmentMismatchError`` when ``strict``.

With several ranks (``fingerprint.world()``: torch.distributed, else ``RANK``/``WORLD_SIZE``) each
rank dumps its shard of each step of the one split, and replays its slice of each logical step
(``balance``; any world size that divides the batch): ``trajstore/read/shards.py``.
The configuration, and where a dump goes by default (a run id), are in
``trajstore/record/config.py``.  Use another ``split`` (``"eval"``) for other loops of one run; two
dumping Recorders of one process on the same path and split are refused.

Each dumped or replayed step is logged (logger ``trajstore.recorder``, INFO) in one line:
step, file, trajectories, tokens, bytes.  A dumped step's line comes from the writer's thread
once the step is committed (``Writer(on_commit=...)``), with, after the first one, the disk a
whole run needs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

from ..base import fingerprint
from .config import DumpReplayConfig, location
from ..errors import BatchError, ConfigError, EnvironmentMismatchError
from ..format.batch import containers
from ..read.prefetch import ReadAhead
from ..read.reader import Reader
from ..store import commit, index
from ..store import listing, paths
from ..store.fs import source
from .log import DumpLog, log_step, tokens_of
from ..write.writer import Writer

__all__ = ["Recorder", "DumpReplayConfig"]

log = logging.getLogger("trajstore.recorder")

_active: set[tuple[str, str]] = set()  # (path, split) of open dumping Recorders in this process
_active_lock = threading.Lock()


class Recorder:
    """Dump or replay the batches of a training loop (see the module doc)."""

    def __init__(self, cfg: DumpReplayConfig | Mapping | None = None, **overrides: Any):
        if cfg is None:
            cfg = DumpReplayConfig.from_env()
        elif isinstance(cfg, Mapping):
            cfg = DumpReplayConfig.from_dict(cfg)
        elif not isinstance(cfg, DumpReplayConfig):
            raise ConfigError(f"Recorder(cfg): expected a DumpReplayConfig or a dict, got {type(cfg).__name__}")
        if overrides:
            cfg = DumpReplayConfig.from_dict({**cfg.to_dict(), **overrides})
        self.cfg = cfg
        self.mode = "dump" if cfg.dump else "replay" if cfg.replay else "off"
        self._off = self.mode == "off"
        self.world_size, self.rank, _ = fingerprint.world()
        self.path, self.split = location(cfg, self.world_size, self.rank)
        self.differences: dict = {}
        self._writer: Writer | None = None
        self._reader: Reader | None = None
        self._kept: list[int] = []  # dumped steps on disk, oldest first (pinned ones included)
        self._dumped = DumpLog(cfg, self.path)
        self._key: tuple[str, str] | None = None
        self._ahead: ReadAhead | None = None  # replay: the next step, read while the caller trains
        self._replayed: Callable[[], None] | None = None  # replay to CUDA: the last step's log line, not yet written
        self._others: dict[str, Writer] = {}  # record(..., split=): the writers of other splits (outputs)
        if self.mode == "replay":
            self._open_replay()

    # -- public
    @property
    def replaying(self) -> bool:
        return self.mode == "replay"

    @property
    def dumping(self) -> bool:
        return self.mode == "dump"

    @property
    def steps(self) -> list[int]:
        """Replay: the steps in the dump; dump: the steps recorded and kept so far."""
        if self._reader is not None:
            return self._reader.steps
        return list(self._kept)

    def selected(self, step: int) -> bool:
        """Whether a dump records ``step``."""
        return self.cfg.selects(step)

    def batch(self, step: int, fn: Callable[[], Any], meta: dict | None = None) -> Any:
        """The batch of ``step``: ``fn()`` (recorded when dumping) or the recorded one."""
        if self._off:
            return fn()
        if self.mode == "replay":
            return self.load(step)
        b = fn()
        if self.cfg.selects(step):
            self.record(step, b, meta)
        return b

    def record(self, step: int, batch: Any, meta: dict | None = None, *, split: str | None = None,
               ids: Any = None) -> None:
        """Record ``batch`` as ``step`` (dump mode), then apply ``max_keep``.

        ``split``: another split of this run, e.g. ``"outputs"``: the trainer's per-trajectory outputs
        (recomputed logprobs, per-sample loss, entropy, values) next to the inputs, with per-step
        scalars (loss, grad-norm) in ``meta``; each rank records its own rows, joined like any sharded
        step. When dumping they go to this dump; at replay to the dump ``cfg.outputs``, each row with
        the trajectory id of the row it was computed from (``ids``, default ``self.ids(step)``, the rows
        this rank was given), so a comparison joins them whatever the layout (docs/PRECISION.md). When
        dumping, rank r's rows are taken as the rows of its input shard, in order (or pass ``ids``).
        Off: nothing is recorded. A batch that cannot be stored is logged and skipped, as in ``batch``."""
        if split is not None and split != self.split:
            return self._record_other(step, batch, meta, paths.check_split(split), ids)
        if self.mode != "dump":
            raise ConfigError(f"record(step={step}): this Recorder is in {self.mode!r} mode, not 'dump'")
        step = paths.check_step(step)
        w = self._open_writer()
        landing = False
        try:
            self._dumped.appending(step, tokens_of(containers.unwrap(batch)[0]))
            landing = True
            w.append(step, batch, meta, ids=ids)
        except BaseException as e:
            if landing:
                self._dumped.forget(step)
            self._skip(w, step, e)
            return
        if step in self._kept:
            self._kept.remove(step)
        self._kept.append(step)
        self._rotate()

    def ids(self, step: int) -> Any:
        """The trajectory ids of the rows ``load(step)`` gives this rank (``Reader.ids``: ``[B, 2]`` int64
        of ``(step, row)`` of the logical batch as dumped), at replay."""
        if self._reader is None:
            raise ConfigError(f"ids(step={step}): this Recorder is in {self.mode!r} mode; ids of the rows a rank "
                              "gets are known at replay (when dumping, a rank's rows are its shard's)")
        return self._reader.ids(step)

    def _skip(self, w: Writer, step: int, e: BaseException) -> None:
        """A batch that could not be recorded: raised when strict (or not a BatchError), else recorded as
        skipped and logged, and training goes on."""
        if self.cfg.strict or not isinstance(e, BatchError):
            raise e
        commit.record_skipped(w.dir, step, f"{type(e).__name__}: {e}", w.final(step).name)  # Reader.skipped
        log.error("trajstore dump step=%d was not recorded, training goes on (strict=True raises): %s: %s",
                  step, type(e).__name__, e)

    def _record_other(self, step: int, batch: Any, meta: dict | None, split: str, ids: Any) -> None:
        """``record(..., split=split)``: this rank's rows of ``step`` in another split (see ``record``)."""
        if self._off:
            return
        step = paths.check_step(step)
        if self.mode == "replay":
            if self.cfg.outputs is None:
                raise ConfigError(f"record(step={step}, split={split!r}) at replay: set DumpReplayConfig.outputs (or "
                                  "TRAJSTORE_OUTPUTS) to the dump this run's outputs go to; the replayed dump "
                                  f"{self.path} is only read")
            if ids is None:
                ids = self.ids(step)
        w = self._others.get(split)
        if w is None:
            root = self.path if self.mode == "dump" else self.cfg.outputs
            if self.mode == "replay" and "://" not in root and Path(root).resolve() == Path(str(self.path)).resolve():
                raise ConfigError(f"DumpReplayConfig.outputs is the replayed dump {self.path}; give the replay's "
                                  "outputs a dump of their own, so both runs' outputs can be compared")
            w = self._others[split] = Writer(root, split=split, overwrite=True, masks=self.cfg.masks,
                                             on_error="raise" if self.cfg.strict else "warn",
                                             encodings=self.cfg.encodings, **self._shard())
        try:
            w.append(step, batch, meta, ids=ids)
        except BaseException as e:
            self._skip(w, step, e)

    def load(self, step: int) -> Any:
        """The recorded batch of ``step`` (replay mode), on ``cfg.device`` if set, else CPU."""
        if self._reader is None:
            raise ConfigError(f"load(step={step}): this Recorder is in {self.mode!r} mode, not 'replay'")
        step = paths.check_step(step)
        fs = self._reader.files(step)  # StepNotFoundError past the last dumped step
        # read to cfg.device: padded fields are built there (trajstore/device/pad.py)
        b = self._read(step) if self.cfg.prefetch else self._reader.read(step, device=self.cfg.device)
        self._log_replayed()
        if log.isEnabledFor(logging.INFO):
            try:  # the log line's trajectories: of the whole step (a rank's slice: not counted)
                rows = None if self._reader._slice else sum(pq.read_metadata(source(f)).num_rows for f in fs)
            except Exception:  # noqa: BLE001 - only for the log line
                rows = None
            tokens, size = tokens_of(containers.unwrap(b)[0]), sum(f.stat().st_size for f in fs)
            self._replayed = lambda: log_step("replay", step, fs[0], rows, tokens(), size)
            if self.cfg.device is None or torch.device(self.cfg.device).type != "cuda":
                self._log_replayed()  # else at the next load or close: a CUDA count is read once the batch is there
        return b

    def _log_replayed(self) -> None:
        line, self._replayed = self._replayed, None
        if line is not None:
            line()

    def meta(self, step: int) -> dict:
        """The ``meta`` recorded with ``step`` (replay mode)."""
        if self._reader is None:
            raise ConfigError(f"meta(step={step}): this Recorder is not replaying")
        return self._reader.meta(step)

    def estimate(self, total_steps: int) -> dict:
        """Disk a dump of ``total_steps`` steps (0 .. total_steps-1) will need, from the
        mean size of the steps dumped so far: ``{"dumped", "kept", "bytes_per_step", "bytes"}``
        (``bytes`` is None before the first step is on disk)."""
        if type(total_steps) is not int or total_steps < 0:
            raise ConfigError(f"estimate(total_steps={total_steps!r}): expected an int >= 0")
        return self._dumped.estimate(total_steps)

    def info(self, total_steps: int | None = None) -> dict:
        """Mode, path, split, steps, bytes on disk, and an estimate for ``total_steps``."""
        steps = self.steps
        files = [f for s in steps for f in (self._reader.files(s) if self._reader else [self._final(s)])]
        d = {"mode": self.mode, "path": str(self.path), "split": self.split, "steps": steps,
             "bytes_on_disk": sum(f.stat().st_size for f in files if f.exists()),
             "differences": dict(self.differences)}
        if total_steps is None:
            total_steps = self.cfg.total_steps
        if total_steps is not None and self.mode == "dump":
            d["estimate"] = self.estimate(total_steps)
        return d

    def close(self) -> None:
        """Wait for every dumped step to be on disk (and logged); stop reading ahead."""
        self._log_replayed()
        if self._ahead is not None:
            self._ahead, ahead = None, self._ahead
            ahead.close()
        while self._others:
            self._others.popitem()[1].close()
        if self._writer is not None:
            try:
                self._writer.close()
            finally:
                self._dumped.forget()
                with _active_lock:
                    _active.discard(self._key)
                self._writer = None

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Recorder(mode={self.mode!r}, path={str(self.path)!r}, split={self.split!r})"

    # -- internals
    def _read(self, step: int) -> Any:
        """``step`` through the read-ahead: taken from it when it reads ``step`` next, else read at once
        by a new one that goes on from there."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.step != step:
            if ahead is not None:
                ahead.close()
            ahead = ReadAhead(self._reader, step, self.cfg.device)
        try:
            b = ahead.take()
        except BaseException:
            ahead.close()
            raise
        if ahead.step is None:
            ahead.close()
        else:
            self._ahead = ahead
        return b

    def _open_writer(self) -> Writer:
        if self._writer is not None:
            return self._writer
        key = (str(self.path.resolve()), self.split)
        with _active_lock:
            if key in _active:
                raise ConfigError(f"another Recorder of this process is already dumping to {self.path} split "
                                  f"{self.split!r}; give each loop its own split (e.g. 'eval') or path")
            _active.add(key)
        self._key = key
        try:
            existing = self._own_steps()
            if existing and not self.cfg.resume:
                raise ConfigError(f"dump {self.path} split {self.split!r} already holds {len(existing)} step(s) "
                                  f"({existing[0]}..{existing[-1]}); set resume=True to continue it, or "
                                  "choose another path or split")
            self._writer = Writer(self.path, split=self.split, overwrite=True, on_commit=self._dumped.committed,
                                  on_error="raise" if self.cfg.strict else "warn", masks=self.cfg.masks,
                                  encodings=self.cfg.encodings, threads=self.cfg.threads, **self._shard())  # dumping never stops training
        except BaseException:
            with _active_lock:
                _active.discard(key)
            raise
        self._kept, self._final = existing, self._writer.final  # the file of each step this process dumps
        if existing:
            log.info("trajstore dump %s split %s: continuing after %d step(s) already recorded (%d..%d); "
                     "steps recorded again replace the old ones", self.path, self.split, len(existing),
                     existing[0], existing[-1])
        return self._writer

    def _rotate(self) -> None:
        c = self.cfg
        if c.max_keep is None:
            return
        rot = [s for s in self._kept if s not in c.pin_steps]
        gone = rot[: max(0, len(rot) - c.max_keep)]
        for s in gone:
            f = self._writer.final(s)  # this rank's shard when several ranks dump
            if self._dumped.landing(s):  # still in the background queue: let it land, then delete it
                try:
                    self._writer.flush()
                finally:
                    self._dumped.forget()  # every append is committed or failed now
            f.unlink(missing_ok=True)
            self._kept.remove(s)
            log.info("trajstore dump step=%d removed (max_keep=%d) path=%s", s, c.max_keep, f)
        if gone:
            index.prune(self._writer.dir)  # index segments none of whose steps is left

    def _shard(self) -> dict:
        """The ``rank``/``world_size`` of this rank's Writer or Reader: none for one process, or at replay of
        a dump with one split per rank (``config.location``)."""
        old = self.split != self.cfg.split
        return {} if self.world_size <= 1 or old else {"rank": self.rank, "world_size": self.world_size}

    def _own_steps(self) -> list[int]:
        """The steps of the split this process dumped: whole steps, or with several ranks its own shards'."""
        sh, d = self._shard(), self.path / self.split
        if not sh:
            return listing.list_steps(d)
        parts = listing.scan(d).parts
        return sorted(s for s, by in parts.items() if sh["rank"] in by.get(sh["world_size"], ()))

    def _open_replay(self) -> None:
        sh = self._shard()
        self._reader = Reader(self.path, split=self.split, threads=self.cfg.threads, **sh, **({"balance": self.cfg.balance} if sh else {}))
        recorded = self._reader.manifest.get("environment", {})
        self.differences = fingerprint.compare(recorded)
        if self.differences:
            msg = (f"replay of {self.path} split {self.split!r}: the environment differs from the one "
                   f"recorded at dump time, so results may not be bit-identical: "
                   f"{fingerprint.format_differences(self.differences)}")
            if self.cfg.strict:
                raise EnvironmentMismatchError(msg + "; match the environment, or set strict=False to "
                                               "replay anyway")
            log.warning(msg)
