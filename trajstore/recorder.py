"""The dump/replay switch for a training loop.

>>> rec = trajstore.Recorder(trajstore.DumpReplayConfig.from_env())
>>> engine = None if rec.replaying else build_inference_engine()
>>> for step in range(start_step, total_steps):
...     batch = rec.batch(step, lambda: engine.prepare_batch(dataloader))
...     train_step(batch)

* **off** (neither ``dump`` nor ``replay``): ``batch`` returns ``fn()``; nothing else runs.
* **dump**: ``batch`` calls ``fn``, records the result when the step is selected
  (``every``/``steps``/``pin_steps``) and returns it unchanged.  Steps beyond ``max_keep``
  (oldest first, pinned steps never) are deleted.  A dump that already holds steps is
  continued (``resume=True``): they count towards ``max_keep`` and a step recorded again
  replaces the old one, which is what a run restarted from a checkpoint needs.
* **replay**: ``fn`` is never called; the recorded batch comes back (on CPU, or on
  ``device``), a step that is not in the dump raises ``StepNotFoundError``.  The dump's
  environment fingerprint is compared with this process's at start-up; every difference
  is logged as a warning, or raised as ``EnvironmentMismatchError`` when ``strict``.

Paths.  ``path=None`` means ``trajstore_dumps/<run id>``; the run id is ``run_id``, else
``$TRAJSTORE_RUN_ID``, else torchrun's ``$TORCHELASTIC_RUN_ID`` (shared by the ranks of one
launch), else one made per process from the time, the pid and random bits, so runs never
share a default path.  When the world size is above 1 (``WORLD_SIZE``/``RANK`` or an
initialized ``torch.distributed``) the rank is appended to the split (``train-rank3``), so
ranks never write the same files, whatever the path.  Use another ``split`` (``"eval"``)
for other loops of one run; two dumping Recorders of one process on the same path and split
are refused.

Each dumped or replayed step is logged (logger ``trajstore.recorder``, INFO) in one line:
step, file, trajectories, tokens, bytes.  With a background writer the line of a dumped
step comes once the step is on disk (at a later ``batch`` call or at ``close``).
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from . import fingerprint
from .store import index as _index
from .store import paths
from .errors import ConfigError, EnvironmentMismatchError

__all__ = ["Recorder", "DumpReplayConfig"]

log = logging.getLogger("trajstore.recorder")

_active: set[tuple[str, str]] = set()  # (path, split) of open dumping Recorders in this process
_active_lock = threading.Lock()
_process_run_id: str | None = None


def default_run_id() -> str:
    global _process_run_id
    for var in ("TRAJSTORE_RUN_ID", "TORCHELASTIC_RUN_ID"):
        v = os.environ.get(var, "")
        if v and v != "none":
            return v
    if _process_run_id is None:
        _process_run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{os.urandom(2).hex()}"
    return _process_run_id


def _tokens(plain: Any):
    """Number of valid tokens in a plain batch, as a (possibly CUDA) tensor or int; None if unknown.
    Never synchronizes with the GPU; the value is read once the step is on disk."""
    import torch

    if isinstance(plain, Mapping):
        cu = plain.get("cu_seqlens")
        if isinstance(cu, torch.Tensor) and cu.ndim == 1 and cu.numel():
            return cu[-1]
        m = plain.get("attention_mask")
        if isinstance(m, torch.Tensor) and m.ndim >= 2:
            m = m != 0
            while m.ndim > 2:
                m = m.all(-1)
            return m.sum()
        return None
    if isinstance(plain, list | tuple):
        n = 0
        for e in plain:
            if isinstance(e, Mapping):
                x = e.get("attention_mask", e.get("input_ids"))
                if x is None:
                    return None
                n += len(x)
        return n
    return None


_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}


def _bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    raise ConfigError(f"DumpReplayConfig.{name}: {v!r} is not a boolean; use true/false (or 1/0)")


def _int(name: str, v: Any, low: int, none_ok: bool = False) -> int | None:
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none", "null")):
        if none_ok:
            return None
        raise ConfigError(f"DumpReplayConfig.{name}: a value is required")
    try:
        i = int(v.strip()) if isinstance(v, str) else v.__index__() if not isinstance(v, bool) else None
    except (ValueError, AttributeError, TypeError):
        i = None
    if i is None or i < low:
        raise ConfigError(f"DumpReplayConfig.{name}: {v!r} is not an int >= {low}")
    return i


def _steps(name: str, v: Any) -> tuple[int, ...] | None:
    """Steps from a list/set/tuple or a string like "0,10,20-25" (ranges inclusive)."""
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none", "null", "all")):
        return None
    if isinstance(v, str):
        out: list[int] = []
        for part in v.replace(" ", "").split(","):
            a, sep, b = part.partition("-")
            lo = _int(name, a, 0)
            out.extend(range(lo, _int(name, b, lo) + 1) if sep else [lo])
        return tuple(sorted(set(out)))
    if isinstance(v, int) or not hasattr(v, "__iter__"):
        raise ConfigError(f"DumpReplayConfig.{name}: {v!r} is not a list of steps; use e.g. [0, 10, 20] "
                          "or \"0,10,20-25\" (every N steps is `every`)")
    return tuple(sorted({_int(name, s, 0) for s in v}))


@dataclass(frozen=True)
class DumpReplayConfig:
    """Which steps of a training loop to dump, or where to replay them from.

    ``dump``/``replay``: the mode (both true is an error; neither: off).  ``path``: the
    dump (required to replay; by default a fresh ``trajstore_dumps/<run id>`` when
    dumping).  ``split``: the loop's name in the dump (``"train"``, ``"eval"``...).
    Steps dumped: every ``every``-th (step % every == 0), or exactly ``steps`` when given,
    plus ``pin_steps`` always.  ``max_keep``: keep at most this many unpinned steps,
    deleting the oldest; ``pin_steps`` are never deleted.  ``resume``: continue a dump
    that already holds steps.  ``strict``: an environment difference at replay is an
    error, not a warning.  ``device``: where replayed tensors go (default CPU).
    ``run_id``: names the default path.  ``total_steps``: for the disk estimate.
    ``prefetch``: at replay, read the next recorded step in the background while the
    current one trains (one extra batch in memory).

    Build it from a dict (``from_dict``: YAML, Hydra, parsed arguments) or from
    ``TRAJSTORE_*`` environment variables (``from_env``: ``TRAJSTORE_DUMP=1``,
    ``TRAJSTORE_PATH=...``, ``TRAJSTORE_STEPS=0,10,20-25``, ``TRAJSTORE_MAX_KEEP=5``...).
    """

    dump: bool = False
    replay: bool = False
    path: str | None = None
    split: str = "train"
    every: int = 1
    steps: tuple[int, ...] | None = None
    max_keep: int | None = None
    pin_steps: tuple[int, ...] = ()
    resume: bool = True
    strict: bool = False
    device: str | None = None
    run_id: str | None = None
    total_steps: int | None = None
    prefetch: bool = True

    def __post_init__(self):
        s = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
        for k in ("dump", "replay", "resume", "strict", "prefetch"):
            s(k, _bool(k, getattr(self, k)))
        if self.dump and self.replay:
            raise ConfigError("DumpReplayConfig: dump and replay are both true; they are mutually exclusive: "
                              "dump records a run, replay drives a run from a dump")
        if self.path is not None:
            if not isinstance(self.path, str | os.PathLike) or not str(self.path):
                raise ConfigError(f"DumpReplayConfig.path: {self.path!r} is not a path")
            s("path", str(self.path) or None)
        if not isinstance(self.split, str):
            raise ConfigError(f"DumpReplayConfig.split: {self.split!r} is not a str")
        paths.check_split(self.split)
        s("every", _int("every", self.every, 1))
        s("steps", _steps("steps", self.steps))
        s("pin_steps", _steps("pin_steps", self.pin_steps) or ())
        s("max_keep", _int("max_keep", self.max_keep, 1, none_ok=True))
        s("total_steps", _int("total_steps", self.total_steps, 0, none_ok=True))
        if self.steps is not None and self.every != 1:
            raise ConfigError(f"DumpReplayConfig: both steps={list(self.steps)} and every={self.every} are "
                              "given; give one of them")
        if self.device is not None:
            import torch

            try:
                s("device", str(torch.device(self.device)))
            except (RuntimeError, TypeError) as e:
                raise ConfigError(f"DumpReplayConfig.device: {self.device!r} is not a torch device ({e})") from None
        for k in ("run_id",):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or "/" in v or v in ("", ".", "..")):
                raise ConfigError(f"DumpReplayConfig.{k}: {v!r} must be a non-empty name without '/'")

    def selects(self, step: int) -> bool:
        """Whether a dump records ``step``."""
        if step in self.pin_steps:
            return True
        return step in self.steps if self.steps is not None else step % self.every == 0

    def to_dict(self) -> dict:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping | None) -> "DumpReplayConfig":
        """From a mapping (a YAML section, a Hydra/OmegaConf node, a dict of parsed arguments); unknown keys
        are an error, so a typo cannot silently turn dumping off."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping) and hasattr(d, "items"):
            d = dict(d.items())
        if not isinstance(d, Mapping):
            raise ConfigError(f"DumpReplayConfig.from_dict: expected a mapping, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        bad = sorted(str(k) for k in d if k not in names)
        if bad:
            raise ConfigError(f"DumpReplayConfig: unknown option(s) {bad}; known: {sorted(names)}")
        return cls(**{k: (list(v) if not isinstance(v, str | bytes | Mapping) and hasattr(v, "__iter__")
                          else v) for k, v in d.items()})

    @classmethod
    def from_env(cls, prefix: str = "TRAJSTORE_", environ: Mapping | None = None) -> "DumpReplayConfig":
        """From ``<prefix><OPTION>`` variables (``TRAJSTORE_DUMP``, ``TRAJSTORE_MAX_KEEP``...);
        unset or empty variables keep the defaults."""
        env = os.environ if environ is None else environ
        d = {f.name: env[prefix + f.name.upper()] for f in fields(cls)
             if env.get(prefix + f.name.upper(), "") != ""}
        return cls.from_dict(d)


class Recorder:
    """Dump or replay the batches of a training loop (see the module doc)."""

    def __init__(self, cfg: DumpReplayConfig | Mapping | None = None, **overrides):
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
        self.split = cfg.split if self.world_size <= 1 else f"{cfg.split}-rank{self.rank}"
        paths.check_split(self.split)
        if cfg.path is not None:
            self.path = Path(cfg.path)
        elif self.mode == "replay":
            raise ConfigError("replay needs the path of the dump: set DumpReplayConfig.path "
                              "(or TRAJSTORE_PATH)")
        else:
            self.path = Path.cwd() / "trajstore_dumps" / (cfg.run_id or default_run_id())
        self.differences: dict = {}
        self._writer = None
        self._reader = None
        self._kept: list[int] = []      # dumped steps on disk, oldest first (pinned ones included)
        self._pending: list[tuple] = []  # dumped steps whose log line waits for the file
        self._sizes: list[int] = []
        self._estimated = False
        self._key = None
        self._pool = None
        self._ahead = None  # (step, future) read in the background while the caller trains
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

    def record(self, step: int, batch: Any, meta: dict | None = None) -> None:
        """Record ``batch`` as ``step`` (dump mode), then apply ``max_keep``."""
        if self.mode != "dump":
            raise ConfigError(f"record(step={step}): this Recorder is in {self.mode!r} mode, not 'dump'")
        from .format import containers as adapters

        step = paths.check_step(step)
        w = self._open_writer()
        self._drain()
        tokens = _tokens(adapters.unwrap(batch)[0])
        w.append(step, batch, meta)
        f = w.dir / paths.step_name(step)
        self._pending.append((step, f, tokens, time.time_ns()))
        if step in self._kept:
            self._kept.remove(step)
        self._kept.append(step)
        self._rotate()
        self._drain()

    def load(self, step: int) -> Any:
        """The recorded batch of ``step`` (replay mode), on ``cfg.device`` if set, else CPU."""
        if self._reader is None:
            raise ConfigError(f"load(step={step}): this Recorder is in {self.mode!r} mode, not 'replay'")
        step = paths.check_step(step)
        f = self._reader.file(step)  # StepNotFoundError past the last dumped step
        ahead, self._ahead = self._ahead, None
        b = ahead[1].result() if ahead is not None and ahead[0] == step else self._reader.read(step)
        if self.cfg.prefetch:
            self._read_ahead(step)
        from .format import containers as adapters

        self._log("replay", step, f, *self._file_stats(f, _tokens(adapters.unwrap(b)[0])))
        if self.cfg.device is not None:
            from . import torch_bridge

            b = torch_bridge.to_device(b, self.cfg.device)
        return b

    def _read_ahead(self, step: int) -> None:
        """Start reading the step after ``step`` in the background (one step ahead)."""
        from concurrent.futures import ThreadPoolExecutor

        steps = self._reader.steps
        i = bisect.bisect_right(steps, step)
        if i < len(steps):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="trajstore-replay")
            self._ahead = (steps[i], self._pool.submit(self._reader.read, steps[i]))

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
        self._drain()
        c = self.cfg
        sel = [s for s in range(total_steps) if c.selects(s)]
        pinned = [s for s in sel if s in c.pin_steps]
        rot = len(sel) - len(pinned)
        kept = len(pinned) + (rot if c.max_keep is None else min(c.max_keep, rot))
        per = sum(self._sizes) / len(self._sizes) if self._sizes else None
        return {"dumped": len(sel), "kept": kept, "bytes_per_step": per,
                "bytes": None if per is None else int(per * kept)}

    def info(self, total_steps: int | None = None) -> dict:
        """Mode, path, split, steps, bytes on disk, and an estimate for ``total_steps``."""
        self._drain()
        steps = self.steps
        files = [self.path / self.split / paths.step_name(s) for s in steps]
        d = {"mode": self.mode, "path": str(self.path), "split": self.split, "steps": steps,
             "bytes_on_disk": sum(f.stat().st_size for f in files if f.exists()),
             "differences": dict(self.differences)}
        if total_steps is None:
            total_steps = self.cfg.total_steps
        if total_steps is not None and self.mode == "dump":
            d["estimate"] = self.estimate(total_steps)
        return d

    def close(self) -> None:
        """Wait for every dumped step to be on disk and log it; stop reading ahead."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._ahead = None, None
        if self._writer is not None:
            try:
                self._writer.close()
            finally:
                self._drain(final=True)
                with _active_lock:
                    _active.discard(self._key)
                self._writer = None

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Recorder(mode={self.mode!r}, path={str(self.path)!r}, split={self.split!r})"

    # -- internals
    def _open_writer(self):
        if self._writer is not None:
            return self._writer
        from .writer import Writer

        key = (str(self.path.resolve()), self.split)
        with _active_lock:
            if key in _active:
                raise ConfigError(f"another Recorder of this process is already dumping to {self.path} split "
                                  f"{self.split!r}; give each loop its own split (e.g. 'eval') or path")
            _active.add(key)
        self._key = key
        try:
            existing = paths.list_steps(self.path / self.split)
            if existing and not self.cfg.resume:
                raise ConfigError(f"dump {self.path} split {self.split!r} already holds {len(existing)} step(s) "
                                  f"({existing[0]}..{existing[-1]}); set resume=True to continue it, or "
                                  "choose another path or split")
            self._writer = Writer(self.path, split=self.split, overwrite=True)
        except BaseException:
            with _active_lock:
                _active.discard(key)
            raise
        self._kept = existing
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
            f = self._writer.dir / paths.step_name(s)
            if not f.exists():
                self._writer.flush()  # still in the background queue: let it land, then delete it
            self._drain()
            f.unlink(missing_ok=True)
            self._kept.remove(s)
            log.info("trajstore dump step=%d removed (max_keep=%d) path=%s", s, c.max_keep, f)
        if gone:
            _index.prune(self._writer.dir)  # index segments none of whose steps is left

    def _drain(self, final: bool = False) -> None:
        while self._pending:
            step, f, tokens, t0 = self._pending[0]
            try:
                st = f.stat()
            except FileNotFoundError:
                st = None
            if st is None or st.st_mtime_ns < t0 - 2_000_000_000:  # not yet written (or the old file)
                if not final:
                    return
                self._pending.pop(0)
                continue
            self._pending.pop(0)
            rows, ntok, size = self._file_stats(f, tokens)
            self._sizes.append(size)
            self._log("dump", step, f, rows, ntok, size)
            if not self._estimated:
                self._estimated = True
                self._log_estimate(size)

    @staticmethod
    def _file_stats(f: Path, tokens) -> tuple[int | None, int | None, int]:
        import pyarrow.parquet as pq

        size = f.stat().st_size
        try:
            rows = pq.read_metadata(f).num_rows
        except Exception:  # noqa: BLE001 - only for the log line
            rows = None
        return rows, None if tokens is None else int(tokens), size

    def _log(self, what: str, step: int, f: Path, rows, tokens, size) -> None:
        log.info("trajstore %s step=%d path=%s trajectories=%s tokens=%s bytes=%d",
                 what, step, f, rows, tokens, size)

    def _log_estimate(self, size: int) -> None:
        n = self.cfg.total_steps
        if n is None:
            log.info("trajstore dump %s: one step is %s on disk; Recorder.estimate(total_steps) or "
                     "total_steps in the config gives the disk a whole run needs", self.path, _human(size))
            return
        e = self.estimate(n)
        log.info("trajstore dump %s: one step is %s on disk; a run of %d steps records %d and keeps %d: "
                 "about %s", self.path, _human(size), n, e["dumped"], e["kept"], _human(e["bytes"]))

    def _open_replay(self) -> None:
        from .reader import Reader

        self._reader = Reader(self.path, split=self.split)
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


def _human(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)
