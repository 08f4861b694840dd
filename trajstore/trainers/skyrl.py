"""SkyRL (skyrl-train 0.3.1): ``RayPPOTrainer`` with its generator step dumped or replayed.

In the experiment's entrypoint, the switch goes first in the bases of SkyRL's experiment class::

    from skyrl_train.entrypoints.main_base import BasePPOExp
    from trajstore.trainers.skyrl import Exp

    class MyExp(Exp, BasePPOExp):       # get_trainer gives trajstore.trainers.skyrl.RayPPOTrainer
        pass

(an experiment with its own trainer class puts ``Switch`` first in that class's bases instead), and the
run gets ``+trajstore.dump=true +trajstore.path=DIR`` (dump) or ``+trajstore.replay=true
+trajstore.path=DIR`` (replay) on its command line: the ``trajstore`` section of SkyRL's config takes any
``DumpReplayConfig`` option. Without that section the ``TRAJSTORE_*`` variables of the trainer's process
are read (``TRAJSTORE_DUMP=1`` / ``TRAJSTORE_REPLAY=1``, ``TRAJSTORE_PATH``); neither: SkyRL's trainer,
unchanged.

The recorded call is the trainer's ``generate(generator_input)``: its ``GeneratorOutput`` (prompt and
response token ids, rewards, loss masks, rollout log-probs, stop reasons, rollout metrics; step-wise:
``trajectory_ids`` and ``is_last_step``), keyed by SkyRL's ``global_step`` (1 for the first step).

Replay: ``generate`` returns the recorded output (its ``rollout_metrics`` logged as SkyRL's own
``generate`` logs them) and never calls the generator; the trainer's inference engine client is a
``NoEngine`` whose ``wake_up`` / ``sleep`` do nothing; no weight-sync state is set up and no weights are
sent. ``Exp`` builds no inference engine at all (neither local nor remote) and hands the generator a
``NoEngine``. The rest of each step is SkyRL's: ``postprocess_generator_output``,
``convert_to_training_input``, the models' forward passes, advantages, ``train_critic_and_policy``,
checkpoints. An evaluation needs the engines: replay with ``trainer.eval_interval=-1`` (``train`` refuses
another). Dynamic sampling (several ``generate`` calls per step) is refused at start-up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf
from skyrl_train import trainer as _trainer
from skyrl_train.entrypoints import main_base

from ..record.config import DumpReplayConfig
from ..errors import ConfigError
from ..record.recorder import Recorder

__all__ = ["config", "NoEngine", "Switch", "RayPPOTrainer", "Exp"]


def config(cfg: DictConfig) -> DumpReplayConfig:
    """The switch's config: SkyRL config's ``trajstore`` section, else the ``TRAJSTORE_*`` variables."""
    section = OmegaConf.select(cfg, "trajstore", default=None)
    if section is None:
        return DumpReplayConfig.from_env()
    return DumpReplayConfig.from_dict(OmegaConf.to_container(section, resolve=True))


class NoEngine:
    """What replay has instead of SkyRL's ``InferenceEngineClient``: ``wake_up`` and ``sleep`` (the
    colocated trainer's calls) do nothing; anything else (a generation, an evaluation) raises, naming it."""

    async def wake_up(self, *_: Any, **__: Any) -> None:
        return None

    async def sleep(self, *_: Any, **__: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"{name}: replay (trajstore.replay / TRAJSTORE_REPLAY) builds no inference engine, so "
                             f"{name} cannot run; the generator outputs come from the dump (replay with "
                             "trainer.eval_interval=-1)")


class Switch:
    """Mixin for SkyRL's ``RayPPOTrainer`` (first in the bases): its ``generate`` step dumped or replayed
    (module doc)."""

    def __init__(self, cfg: DictConfig, *args: Any, **kwargs: Any):
        self.trajstore = rec = Recorder(config(cfg))
        if rec.mode != "off" and OmegaConf.select(cfg, "trainer.algorithm.dynamic_sampling.type") is not None:
            rec.close()
            raise ConfigError("trainer.algorithm.dynamic_sampling.type: dynamic sampling calls generate several "
                              "times per step, which the trajstore switch does not record; turn one of them off")
        super().__init__(cfg, *args, **kwargs)
        if rec.replaying:
            self.inference_engine_client = NoEngine()

    async def generate(self, input_batch: Any) -> Any:
        rec, step = self.trajstore, self.global_step
        if rec.replaying:
            out = rec.load(step)
            if out.get("rollout_metrics") is not None:
                self.all_metrics.update(out["rollout_metrics"])
            return out
        out = await super().generate(input_batch)
        if rec.dumping and rec.selected(step):
            rec.record(step, out)
        return out

    def init_weight_sync_state(self) -> None:
        if not self.trajstore.replaying:
            super().init_weight_sync_state()

    def sync_policy_weights_to_inference_engines(self) -> list:
        return [] if self.trajstore.replaying else super().sync_policy_weights_to_inference_engines()

    def train(self) -> None:
        if self.trajstore.replaying and (OmegaConf.select(self.cfg, "trainer.eval_interval", default=0) or 0) > 0:
            self.trajstore.close()
            raise ConfigError(f"trainer.eval_interval={self.cfg.trainer.eval_interval} at replay (trajstore.replay / "
                              "TRAJSTORE_REPLAY): an evaluation generates, and replay has no inference engine to "
                              "generate with; replay with trainer.eval_interval=-1")
        try:
            return super().train()
        finally:
            self.trajstore.close()  # every dumped step on disk when train returns


class RayPPOTrainer(Switch, _trainer.RayPPOTrainer):
    """SkyRL's ``RayPPOTrainer`` with the switch."""


@contextlib.contextmanager
def _no_engines() -> Iterator[None]:
    """``BasePPOExp._setup_trainer`` building no inference engine: its engine factories give none and its
    client is a ``NoEngine``."""
    names = ("create_ray_wrapped_inference_engines_from_config", "create_remote_inference_engines_from_config",
             "InferenceEngineClient")
    saved = {n: getattr(main_base, n) for n in names}
    for n in names[:2]:
        setattr(main_base, n, lambda *_, **__: [])
    main_base.InferenceEngineClient = lambda *_, **__: NoEngine()
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(main_base, n, v)


class Exp:
    """Mixin for SkyRL's ``BasePPOExp`` (first in the bases): its trainer is ``RayPPOTrainer`` above, and a
    replay builds no inference engine."""

    def get_trainer(self, *args: Any, **kwargs: Any) -> RayPPOTrainer:
        return RayPPOTrainer(*args, **kwargs)

    def _setup_trainer(self) -> Any:
        if not config(self.cfg).replay:
            return super()._setup_trainer()
        with _no_engines():
            return super()._setup_trainer()
