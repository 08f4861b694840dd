"""verl 0.9.1: a drop-in for verl's ``RolloutSkip`` that records and replays with trajstore.

Turned on by verl's own config keys (``RayPPOTrainer`` runs in verl's ``TaskRunner`` process, which
imports this module when it loads the manager class)::

    actor_rollout_ref.rollout.agent.agent_loop_manager_class=trajstore.trainers.verl.AgentLoopManager
    skip.rollout.enable=True skip.rollout.dump_dir=dumps/run1 'skip.rollout.steps=[1,2,3]'

``RolloutSkip`` replaces verl's class of the same name in verl's skip registry (``skip.rollout``), and
keeps its meaning: for each step of ``skip.rollout.steps`` (``global_steps``, from 1),
``AgentLoopManager.generate_sequences`` returns the step's recorded output when the dump holds it
(``action: cache``; ``action: repeat``: the nearest recorded step, as verl's does), else runs and its
output is recorded. A first run therefore dumps, the next ones replay. Validation batches are never
recorded nor replayed (verl's ``SkipManager`` passes them through).

The dump is a trajstore dump at ``<dump_dir>/<experiment_name>_<project_name>/GBS<n>_N<n>_in<P>_out<R>``
(verl's folder scheme, so runs of other shapes never replay each other's batches), split ``train``:
one step file per ``global_steps``, the generation output as the ``DataProto`` it is (``meta_info``'s
timing included), ``{"global_steps": step}`` as its step metadata. With ``TRAJSTORE_VERL_FIT=1`` the
batch after rewards and advantages (what ``compute_advantage`` returns in ``fit()``) of each step that
generated is recorded too, in split ``fit``.

``AgentLoopManager`` is verl's, except that with ``skip.rollout.enable`` it starts its agent-loop
workers at the first step that generates: a run that replays every step never starts them. A dump
problem never stops training: it is logged at ERROR (a batch trajstore cannot store is recorded as
skipped, ``trajstore verify`` lists it).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopManager as _AgentLoopManager
from verl.protocol import DataProto
from verl.trainer.ppo import ray_trainer
from verl.utils.ray_utils import auto_await
from verl.utils.skip.base_skip import SkipAction, register_skip
from verl.utils.skip.rollout_skip import RolloutSkip as _RolloutSkip
from verl.utils.skip.skip_manager import SkipManager

from ..recorder import Recorder
from ..store import paths

__all__ = ["RolloutSkip", "AgentLoopManager", "record_fit_batches", "FIT_ENV"]

log = logging.getLogger("trajstore.trainers.verl")
FIT_ENV = "TRAJSTORE_VERL_FIT"


@register_skip("rollout")
class RolloutSkip(_RolloutSkip):
    """verl's ``RolloutSkip`` (same config, same actions) storing its steps in a trajstore dump."""

    print_mark = "[trajstore RolloutSkip] "

    def __init__(self, local_config: Any, global_config: Any):
        super().__init__(local_config, global_config)
        self.path = self._get_project_dump_dir()
        self._dump: Recorder | None = None
        self._fit: Recorder | None = None
        self._replay: Recorder | None = None
        self.generated: set[int] = set()  # steps this run generated (and dumped)

    def recorded(self) -> list[int]:
        """The steps the dump holds."""
        d = self.path / "train"
        return paths.list_steps(d) if d.is_dir() else []

    def _find_latest_step(self, step: int) -> int:
        """``step`` if recorded, else the last recorded step before it, else the first after it; -1: none."""
        have = self.recorded()
        if step in have:
            return step
        before = [s for s in have if s < step]
        after = [s for s in have if s > step]
        return before[-1] if before else after[0] if after else -1

    def meet_precondition(self, step: int, func: Any = None, *args: Any, **kwargs: Any) -> bool:
        found = step if self.action == SkipAction.CACHE and step in self.recorded() else (
            self._find_latest_step(step) if self.action == SkipAction.REPEAT else -1)
        if found == -1:
            log.info("%sstep %d is not in %s: it is generated and recorded", self.print_mark, step, self.path)
        return found != -1

    def warp_function(self, step: int, func: Any = None, *args: Any, **kwargs: Any) -> DataProto:
        load = step if self.action == SkipAction.CACHE else self._find_latest_step(step)
        if self._replay is None or load not in self._replay.steps:
            self._replay = Recorder(replay=True, path=str(self.path), prefetch=False)
        log.info("%sstep %d replayed from step %d of %s", self.print_mark, step, load, self.path)
        return self._replay.load(load)

    def prepare_data(self, step: int, result: Any, *args: Any, **kwargs: Any) -> None:
        self.generated.add(step)
        self._dump = self._record(self._dump, "train", step, result)

    def record_fit(self, step: int, batch: Any) -> None:
        """Record ``batch`` (``fit()``'s batch after advantages) as ``step`` of split ``fit``."""
        self._fit = self._record(self._fit, "fit", step, batch)

    def _record(self, rec: Recorder | None, split: str, step: int, batch: Any) -> Recorder | None:
        try:
            rec = rec or Recorder(dump=True, path=str(self.path), split=split, resume=True)
            rec.record(step, batch, meta={"global_steps": step})
        except Exception as e:  # noqa: BLE001 - a dump problem never stops training
            log.error("%sstep %d was not recorded to %s split %s, training goes on: %s: %s", self.print_mark,
                      step, self.path, split, type(e).__name__, e)
        return rec

    def close(self) -> None:
        """Wait for every recorded step to be on disk."""
        for rec in (self._dump, self._fit):
            if rec is not None:
                rec.close()


def _skip() -> RolloutSkip | None:
    s = SkipManager.skip_instances.get("rollout")
    return s if isinstance(s, RolloutSkip) and s.is_enabled() else None


_compute_advantage = ray_trainer.compute_advantage


def _compute_advantage_recorded(data: Any, *args: Any, **kwargs: Any) -> Any:
    """``fit()``'s ``compute_advantage``; its result recorded (split ``fit``) on a step that generated."""
    out = _compute_advantage(data, *args, **kwargs)
    s, step = _skip(), SkipManager.step
    if s is not None and step in s.generated:
        s.record_fit(step, out)
    return out


def record_fit_batches() -> None:
    """Record ``fit()``'s batch after rewards and advantages too (split ``fit``), on each step that
    generated: ``TRAJSTORE_VERL_FIT=1`` calls this in the trainer process."""
    ray_trainer.compute_advantage = _compute_advantage_recorded


class AgentLoopManager(_AgentLoopManager):
    """verl's ``AgentLoopManager``; with ``skip.rollout.enable`` its agent-loop workers start at the
    first step that generates (never, in a run that replays every step)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if os.environ.get(FIT_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
            record_fit_batches()

    def _deferred(self) -> bool:
        skip = self.config.get("skip") or {}
        return bool((skip.get("rollout") or {}).get("enable", False))

    async def _init_agent_loop_workers(self) -> None:
        if self._deferred():
            self.agent_loop_workers = None  # started by generate_sequences when a step generates
            return
        await super()._init_agent_loop_workers()

    @auto_await
    async def generate_sequences(self, prompts: DataProto) -> DataProto:
        if self.agent_loop_workers is None and not self._replays(prompts):
            await _AgentLoopManager._init_agent_loop_workers(self)
        return await super().generate_sequences(prompts)

    @staticmethod
    def _replays(prompts: DataProto) -> bool:
        s, step = _skip(), SkipManager.step
        return (s is not None and step in s.steps and not SkipManager._should_bypass_for_validation((None, prompts), {})
                and s.meet_precondition(step))
