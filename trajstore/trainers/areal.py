"""AReaL 1.0.4: ``debug.dump_rollout_data`` / ``debug.replay_rollout_data`` / ``debug.path`` on the
trainer's config, and the one wrap of its rollout engine behind them.

AReaL's trainer asks its train engine for each step's batch, ``actor.prepare_batch`` (or
``rollout_batch``), on every rank; that goes to the rollout engine (``RemoteSGLangEngine`` /
``RemotevLLMEngine``; in single-controller mode the ``TrainController`` asks the ``RolloutController``)
and, in SPMD mode, the data-parallel heads' batches are redistributed to every rank
(``DistRolloutCoordinator``). The mixin ``Switch`` goes first in a subclass of AReaL's trainer::

    from areal.trainer import PPOTrainer
    from trajstore.trainers.areal import PPOConfig, Switch

    class Trainer(Switch, PPOTrainer):
        pass

    config, _ = load_expr_config(args, PPOConfig)   # AReaL's PPOConfig plus ``debug``
    Trainer(config, train_dataset=..., valid_dataset=...).train(workflow=...)

and ``debug.dump_rollout_data=true debug.path=dumps/run1`` on the command line dumps,
``debug.replay_rollout_data=true debug.path=dumps/run1`` replays. During ``train``, the actor's
``prepare_batch`` and ``rollout_batch`` are wrapped in ``RecordedRollout``: dump records what each
returns on each rank (the Recorder writes one shard per rank, joined into the logical step), replay
returns the recorded batch of the step and calls neither. At replay ``_init_rollout`` builds no
inference engine (no server is launched or connected to) but a ``NoEngine``: the version bumps and
pauses the trainer sends to it are no-ops, and the actor's ``connect_engine`` and ``update_weights``
(which would join a weight-update group with the servers, or send them weights) do nothing.

The step key is the trainer's ``global_step`` (``RecordedRollout.step``: the first step of ``train``,
then one more per ``prepare_batch`` / ``rollout_batch`` call). Evaluation rollouts are never recorded.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from areal.api import cli_args

from ..errors import ConfigError
from ..record.recorder import Recorder

__all__ = ["DebugConfig", "RecordedRollout", "NoEngine", "Switch", "recorder", "PPOConfig", "GRPOConfig"]


@dataclass
class DebugConfig:
    """The trainer config's ``debug`` section: dump every step's rollout batch to ``path``, or replay
    the batches recorded there (mutually exclusive; neither: off)."""

    dump_rollout_data: bool = False
    replay_rollout_data: bool = False
    path: str | None = None


def recorder(debug: DebugConfig | None) -> Recorder:
    """The Recorder of a ``debug`` section (off when ``debug`` is None)."""
    if debug is None:
        return Recorder({})
    return Recorder({"dump": debug.dump_rollout_data, "replay": debug.replay_rollout_data, "path": debug.path})


def _done(value: Any = None) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


# what a trainer asks of its rollout engine besides batches; in replay (no engine) each is a no-op
# (export_stats: no rollout stats, an empty dict, which PPOTrainer merges into each step's stats)
_NO_ENGINE = {
    "export_stats": dict,
    "initialize": None, "destroy": None, "pause": None, "resume": None, "pause_generation": None,
    "continue_generation": None, "set_version": None, "onload": None, "offload": None,
    "config_perf_tracer": None, "save_perf_tracer": None, "init_weights_update_group": _done,
    "update_weights_from_distributed": _done, "update_weights_from_disk": _done, "update_weights": _done,
}


def _nothing(*_: Any, **__: Any) -> None:
    return None


class NoEngine:
    """What replay gives the trainer instead of an inference engine: the calls of ``_NO_ENGINE`` (the
    trainer's pauses, version bumps and weight updates) do nothing, ``get_version`` gives the last
    ``set_version``; any other (a generation, an evaluation) raises, naming it."""

    def __init__(self) -> None:
        self._version = 0

    def set_version(self, version: int) -> None:
        self._version = version

    def get_version(self) -> int:
        return self._version

    def __getattr__(self, name: str) -> Any:
        if name in _NO_ENGINE:
            result = _NO_ENGINE[name]
            return lambda *a, **k: None if result is None else result()
        raise AttributeError(f"{name}: replay (debug.replay_rollout_data) builds no inference engine, so "
                             f"{name} cannot run; the rollout batches come from the dump (turn the evaluator "
                             "off when replaying)")


class RecordedRollout:
    """``engine`` (AReaL's train engine, rollout engine or controller: anything with ``prepare_batch`` /
    ``rollout_batch``), those two calls recorded by ``rec`` (dump) or answered from it (replay, where
    ``engine`` may be None), one step per call from ``step``. Everything else is the engine's (without
    one: ``NoEngine``'s)."""

    def __init__(self, engine: Any, rec: Recorder, step: int = 0):
        if engine is None and not rec.replaying:
            raise ConfigError("RecordedRollout: an engine is needed unless replaying (debug.replay_rollout_data)")
        self.engine, self.rec, self.step = (NoEngine() if engine is None else engine), rec, step

    def prepare_batch(self, *args: Any, **kwargs: Any) -> list:
        return self._batch("prepare_batch", args, kwargs)

    def rollout_batch(self, *args: Any, **kwargs: Any) -> list:
        return self._batch("rollout_batch", args, kwargs)

    def _batch(self, name: str, args: tuple, kwargs: dict) -> list:
        step, self.step = self.step, self.step + 1
        return self.rec.batch(step, lambda: getattr(self.engine, name)(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["engine"], name)


class Switch:
    """Mixin for AReaL's ``PPOTrainer`` (first in the bases): the ``debug`` section of its config turns
    the dump or the replay of its rollout batches on (module doc)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        self.trajstore = recorder(getattr(config, "debug", None))
        super().__init__(config, *args, **kwargs)

    def _create_train_engine(self, *args: Any, **kwargs: Any) -> Any:
        engine = super()._create_train_engine(*args, **kwargs)
        if self.trajstore.replaying:  # no inference server to join a weight-update group with or send weights to
            engine.connect_engine = engine.update_weights = _nothing
        return engine

    def _init_rollout(self, rollout_config: Any, is_eval: bool = False, lora_path: str | None = None) -> Any:
        if self.trajstore.replaying:
            return NoEngine()  # no inference engine is built
        return super()._init_rollout(rollout_config, is_eval, lora_path)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        rec, actor = self.trajstore, self.actor
        if rec.mode == "off":
            return super().train(*args, **kwargs)
        info = getattr(self, "recover_info", None)  # AReaL's own first step (rl_trainer.py, train())
        own = None if rec.replaying else SimpleNamespace(prepare_batch=actor.prepare_batch,
                                                         rollout_batch=actor.rollout_batch)
        wrap = RecordedRollout(own, rec, info.last_step_info.next().global_step if info is not None else 0)
        actor.prepare_batch, actor.rollout_batch = wrap.prepare_batch, wrap.rollout_batch  # every rank's batch
        try:
            return super().train(*args, **kwargs)
        finally:
            del actor.prepare_batch, actor.rollout_batch
            rec.close()


def _with_debug(base: type) -> type:
    """AReaL's config class ``base`` with the ``debug`` section."""
    return dataclass(type(base.__name__, (base,), {"__annotations__": {"debug": DebugConfig},
                                                   "debug": field(default_factory=DebugConfig),
                                                   "__module__": __name__}))


PPOConfig = _with_debug(cli_args.PPOConfig)
GRPOConfig = _with_debug(cli_args.GRPOConfig)
