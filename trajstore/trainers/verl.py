"""verl 0.9.1: a drop-in for verl's ``RolloutSkip`` that records and replays with trajstore.

Turned on by verl's own config keys (``RayPPOTrainer`` runs in verl's ``TaskRunner`` process, which
imports this module when it loads the manager class; the two class keys are not in verl's yaml, hence ``+``)::

    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=trajstore.trainers.verl.AgentLoopManager
    +actor_rollout_ref.rollout.checkpoint_manager_class=trajstore.trainers.verl.CheckpointEngineManager
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
workers at the first step that generates. When every step the run takes (1..total training steps) is
replayed and validation is off (``servers_needed(config) == ""``), ``init_workers()`` starts no LLM server
either (``LLMServerManager``: no vLLM/SGLang replica, no router) and ``fit()``'s weight updates do nothing
(``CheckpointEngineManager``); otherwise both are verl's. A dump problem never stops training: it is
logged at ERROR (a batch trajstore cannot store is recorded as skipped, ``trajstore verify`` lists it).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from omegaconf import OmegaConf
from verl.checkpoint_engine import CheckpointEngineManager as _CheckpointEngineManager
from verl.experimental.agent_loop.agent_loop import AgentLoopManager as _AgentLoopManager
from verl.protocol import DataProto
from verl.trainer.ppo import ray_trainer
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.import_utils import load_class_from_fqn
from verl.utils.ray_utils import auto_await
from verl.utils.skip.base_skip import SkipAction, register_skip
from verl.utils.skip.config import SkipManagerConfig
from verl.utils.skip.rollout_skip import RolloutSkip as _RolloutSkip
from verl.utils.skip.skip_manager import SkipManager
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.llm_server import LLMServerManager as _LLMServerManager

from ..record.recorder import Recorder
from ..store import listing

__all__ = ["RolloutSkip", "AgentLoopManager", "LLMServerManager", "CheckpointEngineManager", "NoServers",
           "servers_needed", "record_fit_batches", "FIT_ENV"]

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
        return listing.list_steps(d) if d.is_dir() else []

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
            if isinstance(self.llm_client, NoServerClient):
                raise RuntimeError(
                    f"step {SkipManager.step}: this run started no LLM server (every step was in the dump "
                    f"when the trainer started), but this batch is not in the dump now; run again to generate it")
            await _AgentLoopManager._init_agent_loop_workers(self)
        return await super().generate_sequences(prompts)

    @staticmethod
    def _replays(prompts: DataProto) -> bool:
        s, step = _skip(), SkipManager.step
        return (s is not None and step in s.steps and not SkipManager._should_bypass_for_validation((None, prompts), {})
                and s.meet_precondition(step))


MANAGER_KEY = "actor_rollout_ref.rollout.agent.agent_loop_manager_class"
CHECKPOINT_KEY = "actor_rollout_ref.rollout.checkpoint_manager_class"


def _is(config: Any, key: str, cls: type) -> bool:
    fqn = OmegaConf.select(config, key)
    try:
        return bool(fqn) and issubclass(load_class_from_fqn(fqn, key), cls)
    except Exception:  # noqa: BLE001 - a class that does not load is verl's error to report, later
        return False


def servers_needed(config: Any) -> str:
    """Why the run verl's trainer is set up with ``config`` needs its LLM servers; "" when it replays every
    step (steps 1..total training steps, as ``RolloutSkip`` decides) and nothing else generates."""
    if not OmegaConf.select(config, "skip.rollout.enable", default=False):
        return "skip.rollout.enable is off"
    for key, cls in ((MANAGER_KEY, AgentLoopManager), (CHECKPOINT_KEY, CheckpointEngineManager)):
        if not _is(config, key, cls):
            return f"+{key}=trajstore.trainers.verl.{cls.__name__} is not set"
    if OmegaConf.select(config, "trainer.val_before_train", default=True) or \
            (OmegaConf.select(config, "trainer.test_freq", default=-1) or -1) > 0:
        return "validation generates (trainer.val_before_train=False trainer.test_freq=-1 turn it off)"
    total = OmegaConf.select(config, "trainer.total_training_steps") or \
        OmegaConf.select(config, "actor_rollout_ref.actor.optim.total_training_steps")  # set by RayPPOTrainer
    if not total or total < 1:
        return "the number of training steps is not known"
    local = omega_conf_to_dataclass(config.skip, dataclass_type=SkipManagerConfig).rollout  # as SkipManager.init
    skip = RolloutSkip(local, config)
    missing = [s for s in range(1, int(total) + 1) if s not in skip.steps or not skip.meet_precondition(s)]
    if missing:
        return f"steps {missing} of 1..{total} are not replayed from {skip.path} (skip.rollout.steps, action)"
    return ""


class NoServers(list):
    """The LLM server replicas of a run that replays every step: none."""


class NoServerClient(LLMServerClient):
    """The LLM client of a run that started no server: a request is an error."""

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no LLM server was started: every step was in the dump when the trainer started")


class LLMServerManager(_LLMServerManager):
    """verl's ``LLMServerManager``; ``create`` starts no server (no vLLM/SGLang replica, no router) when
    ``servers_needed(config)`` is "", i.e. the run replays every step. ``RayPPOTrainer.init_workers`` uses
    it: importing this module sets ``verl.trainer.ppo.ray_trainer.LLMServerManager`` to it (verl has no
    config key for this class), before ``init_workers`` calls it."""

    @classmethod
    @auto_await
    async def create(cls, *args: Any, **kwargs: Any) -> _LLMServerManager:
        config = kwargs["config"] if "config" in kwargs else args[0]
        why = servers_needed(config)
        if why:
            if OmegaConf.select(config, "skip.rollout.enable", default=False):
                log.info("[trajstore RolloutSkip] LLM servers start: %s", why)
            return await super().create(*args, **kwargs)
        log.info("[trajstore RolloutSkip] every step is replayed from the dump: no LLM server is started")
        inst = cls.__new__(cls)
        inst.rollout_replica_class = None  # verl's __init__ then imports no engine (vLLM, SGLang)
        inst.__init__(*args, **kwargs)
        inst.rollout_replicas, inst.server_handles, inst.server_addresses = NoServers(), [], []
        inst.global_load_balancer = None
        return inst

    def get_client(self, client_cls: type[LLMServerClient] | None = None, **kwargs: Any) -> LLMServerClient:
        if isinstance(self.rollout_replicas, NoServers):
            return NoServerClient(config=self.config)
        return super().get_client(client_cls, **kwargs)


class CheckpointEngineManager(_CheckpointEngineManager):
    """verl's ``CheckpointEngineManager`` (``+actor_rollout_ref.rollout.checkpoint_manager_class``); with
    the replicas of a run that started no LLM server (``NoServers``), weight updates do nothing."""

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict:
        if isinstance(self.replicas, NoServers):
            return {}
        return await super().update_weights(global_steps)


ray_trainer.LLMServerManager = LLMServerManager  # read by RayPPOTrainer.init_workers after this import
