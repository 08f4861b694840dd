"""The Recorder's log of dumped and replayed steps (``trajstore/record/recorder.py``): one INFO line per step
(step, file, trajectories, tokens, bytes; a dumped step's once committed, from the writer's thread),
and the disk a whole run needs, estimated from the steps dumped so far."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..base.text import human_bytes
from .config import DumpReplayConfig
from ..format.batch.masks import count_tokens
from ..write.writer import Committed

__all__ = ["tokens_of", "log_step", "DumpLog"]

log = logging.getLogger("trajstore.recorder")


def tokens_of(plain: Any) -> Callable[[], int | None]:
    """The number of valid tokens of a plain batch (``format.batch.masks.count_tokens``), read later: a
    CUDA count is copied to host memory behind an event now, so neither this call nor the read
    blocks on the caller's GPU work."""
    n = count_tokens(plain)
    if isinstance(n, torch.Tensor) and n.is_cuda:
        host = n.to("cpu", non_blocking=True)  # into pinned memory
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(n.device))
        return lambda: (ev.synchronize(), int(host))[1]
    return lambda: None if n is None else int(n)


def log_step(what: str, step: int, f: Path, rows: int | None, tokens: int | None, size: int) -> None:
    log.info("trajstore %s step=%d path=%s trajectories=%s tokens=%s bytes=%d", what, step, f, rows, tokens, size)


class DumpLog:
    """The dumped steps' log lines and sizes, fed by the writer's ``on_commit`` (on its thread)."""

    def __init__(self, cfg: DumpReplayConfig, path: Path):
        self.cfg, self.path = cfg, path
        self._lock = threading.Lock()
        self._landing: dict[int, deque] = {}  # step -> token counts of its appends not yet committed
        self.sizes: list[int] = []

    def appending(self, step: int, tokens: Callable[[], int | None]) -> None:
        with self._lock:
            self._landing.setdefault(step, deque()).append(tokens)

    def landing(self, step: int) -> bool:
        """Whether an append of ``step`` is not committed yet."""
        with self._lock:
            return step in self._landing

    def forget(self, step: int | None = None) -> None:
        """Drop the last append of ``step`` (it was refused), or every one (all settled: the failed)."""
        with self._lock:
            if step is None:
                self._landing.clear()
            elif self._landing.get(step):
                self._landing[step].pop()
                if not self._landing[step]:
                    del self._landing[step]

    def committed(self, c: Committed) -> None:
        with self._lock:
            q = self._landing.get(c.step)
            tokens = q.popleft() if q else (lambda: None)
            if q is not None and not q:
                del self._landing[c.step]
            self.sizes.append(c.bytes)
            first = len(self.sizes) == 1
        log_step("dump", c.step, c.path, c.rows, tokens(), c.bytes)
        if first:
            self._log_estimate(c.bytes)

    def estimate(self, total_steps: int) -> dict:
        c = self.cfg
        sel = [s for s in range(total_steps) if c.selects(s)]
        pinned = [s for s in sel if s in c.pin_steps]
        rot = len(sel) - len(pinned)
        kept = len(pinned) + (rot if c.max_keep is None else min(c.max_keep, rot))
        with self._lock:
            per = sum(self.sizes) / len(self.sizes) if self.sizes else None
        return {"dumped": len(sel), "kept": kept, "bytes_per_step": per,
                "bytes": None if per is None else int(per * kept)}

    def _log_estimate(self, size: int) -> None:
        n = self.cfg.total_steps
        if n is None:
            log.info("trajstore dump %s: one step is %s on disk; Recorder.estimate(total_steps) or total_steps "
                     "in the config gives the disk a whole run needs", self.path, human_bytes(size))
            return
        e = self.estimate(n)
        log.info("trajstore dump %s: one step is %s on disk; a run of %d steps records %d and keeps %d: "
                 "about %s", self.path, human_bytes(size), n, e["dumped"], e["kept"], human_bytes(e["bytes"]))
