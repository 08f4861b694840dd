"""The configuration of the dump/replay switch (``trajstore.Recorder``): :class:`DumpReplayConfig`,
its parsing from a dict or from ``TRAJSTORE_*`` environment variables, and where a dump goes.

Paths.  ``path=None`` means ``trajstore_dumps/<run id>``; the run id is ``run_id``, else
``$TRAJSTORE_RUN_ID``, else torchrun's ``$TORCHELASTIC_RUN_ID`` (shared by the ranks of one
launch), else one made per process from the time, the pid and random bits, so runs never
share a default path.  When the world size is above 1 every rank writes its shard of each step of the
one logical split (``Writer(rank=, world_size=)``, docs/FORMAT.md section 1), and at replay each rank
reads its slice of each logical step (``balance``). A dump of trajstore before 0.2 made one split per
rank (``train-rank3``); replaying it, each rank still reads its own split (:func:`location`).
"""

from __future__ import annotations

import difflib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ..base.text import parse_steps
from ..device import decode_pool
from ..errors import ConfigError, ConfigWarning, warn
from ..format.file.parquet import check_encodings
from ..store import fs, manifest, paths
from ..store.fs import resolve

__all__ = ["DumpReplayConfig", "default_run_id", "location", "ENV_VARIABLES", "check_env"]

_process_run_id: str | None = None


def default_run_id() -> str:
    """``$TRAJSTORE_RUN_ID``, else ``$TORCHELASTIC_RUN_ID``, else an id made once per process."""
    global _process_run_id
    for var in ("TRAJSTORE_RUN_ID", "TORCHELASTIC_RUN_ID"):
        v = os.environ.get(var, "")
        if v and v != "none":
            return v
    if _process_run_id is None:
        _process_run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{os.urandom(2).hex()}"
    return _process_run_id


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


def _masks(v: Any) -> dict[str, list[str]] | None:
    """``{mask field: [field, ...]}`` from a mapping or its JSON text (None: infer every mask)."""
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none", "null")):
        return None
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise ConfigError(f"DumpReplayConfig.masks: {v!r} is not JSON ({e}); use e.g. "
                              '\'{"completion_mask": ["old_per_token_logps"]}\'') from None
    ok = isinstance(v, Mapping) and all(
        isinstance(k, str) and not isinstance(f, str | bytes) and hasattr(f, "__iter__") and all(isinstance(x, str) for x in f)
        for k, f in v.items())
    if not ok:
        raise ConfigError(f"DumpReplayConfig.masks: {v!r} is not a mapping of a mask field to a list of field names, "
                          'e.g. {"completion_mask": ["old_per_token_logps"]}')
    return {k: list(f) for k, f in v.items()}


@dataclass(frozen=True)
class DumpReplayConfig:
    """Which steps of a training loop to dump, or where to replay them from.

    ``dump``/``replay``: the mode (both true is an error; neither: off).  ``path``: the
    dump (required to replay; by default a fresh ``trajstore_dumps/<run id>`` when
    dumping).  ``split``: the loop's name in the dump (``"train"``, ``"eval"``...).
    Steps dumped: every ``every``-th (step % every == 0), or exactly ``steps`` when given,
    plus ``pin_steps`` always.  ``max_keep``: keep at most this many unpinned steps,
    deleting the oldest; ``pin_steps`` are never deleted.  ``resume``: continue a dump
    that already holds steps.  ``strict``: raise what would otherwise be logged and
    gone past: an environment difference at replay, a batch that cannot be dumped (by default
    its step is recorded as skipped and training goes on).  ``device``: where replayed tensors go (default CPU).
    ``run_id``: names the default path.  ``total_steps``: for the disk estimate.
    ``prefetch``: at replay, read the next recorded step in the background while the
    current one trains (one extra batch in memory).  ``masks``: which per-token fields follow
    which mask, where names and shapes do not tell (``{"completion_mask": ["old_per_token_logps"]}``,
    passed to ``Writer(masks=...)``; docs/FORMAT.md 3.4; as a variable, JSON).  ``encodings``:
    ``"portable"`` (default: every Parquet reader reads the dump) or ``"compact"``
    (BYTE_STREAM_SPLIT: smaller, faster to read with trajstore, unreadable by fastparquet), passed
    to ``Writer(encodings=...)``; docs/FORMAT.md 3.5.  ``balance``: at replay on several ranks, how a
    logical step is cut into the ranks' slices: ``"contiguous"`` (default: equal chunks in order, like
    verl's ``DataProto.chunk``; the dumped shards when replayed on the dump's world size) or ``"tokens"``
    (token-balanced, equal sizes); ``Reader(rank=, world_size=, balance=)``.  ``outputs``: at replay, the
    dump ``Recorder.record(step, outputs, split="outputs")`` writes the replaying run's outputs to (the
    replayed dump is only read; when dumping they go next to the inputs); docs/PRECISION.md.
    ``threads``: the thread budget of the dump's Writer and the replay's Reader (``threads=``; default:
    this process's cores shared among the ranks of this host, README "Threads").

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
    masks: dict[str, list[str]] | None = None
    encodings: str = "portable"
    balance: str = "contiguous"
    outputs: str | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
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
        s("steps", parse_steps(self.steps, what="DumpReplayConfig.steps"))
        s("pin_steps", parse_steps(self.pin_steps, what="DumpReplayConfig.pin_steps") or ())
        s("max_keep", _int("max_keep", self.max_keep, 1, none_ok=True))
        s("total_steps", _int("total_steps", self.total_steps, 0, none_ok=True))
        s("threads", _int("threads", self.threads, 1, none_ok=True))
        if self.steps is not None and self.every != 1:
            raise ConfigError(f"DumpReplayConfig: both steps={list(self.steps)} and every={self.every} are "
                              "given; give one of them")
        if self.device is not None:
            try:
                s("device", str(torch.device(self.device)))
            except (RuntimeError, TypeError) as e:
                raise ConfigError(f"DumpReplayConfig.device: {self.device!r} is not a torch device ({e})") from None
        s("masks", _masks(self.masks))
        check_encodings(self.encodings, "DumpReplayConfig.encodings")
        if self.outputs is not None:
            if not isinstance(self.outputs, str | os.PathLike) or not str(self.outputs):
                raise ConfigError(f"DumpReplayConfig.outputs: {self.outputs!r} is not a path")
            s("outputs", str(self.outputs))
        if self.balance not in ("contiguous", "tokens"):
            raise ConfigError(f"DumpReplayConfig.balance: {self.balance!r}; use 'contiguous' or 'tokens'")
        v = self.run_id
        if v is not None and (not isinstance(v, str) or "/" in v or v in ("", ".", "..")):
            raise ConfigError(f"DumpReplayConfig.run_id: {v!r} must be a non-empty name without '/'")

    def selects(self, step: int) -> bool:
        """Whether a dump records ``step``."""
        if step in self.pin_steps:
            return True
        return step in self.steps if self.steps is not None else step % self.every == 0

    def to_dict(self) -> dict:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping | None) -> DumpReplayConfig:
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
    def from_env(cls, prefix: str = "TRAJSTORE_", environ: Mapping | None = None) -> DumpReplayConfig:
        """From ``<prefix><OPTION>`` variables (``TRAJSTORE_DUMP``, ``TRAJSTORE_MAX_KEEP``...);
        unset or empty variables keep the defaults; any other ``<prefix>*`` variable is a
        ``ConfigWarning`` naming the closest known one (``check_env``)."""
        env = os.environ if environ is None else environ
        names = [prefix + f.name.upper() for f in fields(cls)]
        check_env(env, prefix, ENV_VARIABLES if prefix == "TRAJSTORE_" else names)
        d = {f.name: env[prefix + f.name.upper()] for f in fields(cls)
             if env.get(prefix + f.name.upper(), "") != ""}
        return cls.from_dict(d)


# Every TRAJSTORE_* environment variable trajstore reads, in one place: DumpReplayConfig.from_env warns
# (ConfigWarning) about any other, naming the closest of these (tests/test_docs.py checks the package
# reads no variable missing here)
ENV_VARIABLES: dict[str, str] = {
    **{f"TRAJSTORE_{f.name.upper()}": f"DumpReplayConfig.{f.name} (from_env)" for f in fields(DumpReplayConfig)},
    fs.ENV: "which library serves a URL (store/fs.py)",
    "TRAJSTORE_MAX_DECODED_BYTES": "the decoded-size bound of a step (format/file/validate.py)",
    "TRAJSTORE_VERL_FIT": "verl's switch also records fit()'s batch after advantages (trainers/verl.py)",
    decode_pool.ENV: "0: a replay to a GPU stages through pinned memory, no pool built; 1: waits for the pinned "
                     "decode's build (default: built in the background; device/decode_pool.py; README)",
    decode_pool.CACHE_ENV: "where that pinned pool's build is kept (device/decode_pool.py)",
}
# read by the project's own test suite (tests/conftest.py, tests/test_corrupt.py), not by the package:
# never warned about, and not listed among the variables a user may set
TEST_VARIABLES: dict[str, str] = {
    "TRAJSTORE_EXAMPLES": "Hypothesis examples per test (tests/conftest.py)",
    "TRAJSTORE_FUZZ_SCALE": "length of the fuzz runs (tests/test_corrupt.py)",
    "TRAJSTORE_FUZZ_FIGURES": "where the fuzz counts go (tests/test_corrupt.py)",
}


def check_env(environ: Mapping | None = None, prefix: str = "TRAJSTORE_", known: Any = None) -> list[str]:
    """Warn (``ConfigWarning``) about each ``<prefix>*`` variable that is not ``known`` (default:
    ``ENV_VARIABLES``), naming the closest known one, as ``TRAJSTORE_DUMPP=1`` would otherwise leave
    dumping off without a word; returns the unknown names."""
    env = os.environ if environ is None else environ
    known = sorted(ENV_VARIABLES if known is None else known)
    bad = sorted(k for k in env if isinstance(k, str) and k.startswith(prefix) and k not in known
                 and k not in TEST_VARIABLES)
    for k in bad:
        close = difflib.get_close_matches(k, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}? " if close else ""
        warn(f"environment variable {k} is not one trajstore reads, so it is ignored; {hint}known: "
             f"{', '.join(known)}", ConfigWarning)
    return bad


def location(cfg: DumpReplayConfig, world_size: int, rank: int) -> tuple[Path, str]:
    """``(path, split)`` of the dump ``cfg`` names for rank ``rank`` of ``world_size`` processes: the
    split ``cfg.split``, or at replay of a dump with one split per rank (trajstore before 0.2) and no
    ``cfg.split``, this rank's ``<split>-rank<rank>`` (see the module doc); ConfigError when replaying
    without a path."""
    split = paths.check_split(cfg.split)
    if cfg.path is not None:
        root = resolve(cfg.path, "the dump path (DumpReplayConfig.path / TRAJSTORE_PATH)")
        bad = manifest.not_a_folder(root)
        if bad:  # found before training starts, not at the first dumped step
            raise ConfigError(f"DumpReplayConfig.path (TRAJSTORE_PATH): {bad}")
        old = f"{split}-rank{rank}"
        if cfg.replay and world_size > 1 and not (root / split).is_dir() and (root / old).is_dir():
            split = paths.check_split(old)
        return root, split
    if cfg.replay:
        raise ConfigError("replay needs the path of the dump: set DumpReplayConfig.path (or TRAJSTORE_PATH)")
    return Path.cwd() / "trajstore_dumps" / (cfg.run_id or default_run_id()), split
