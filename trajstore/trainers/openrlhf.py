"""OpenRLHF 0.11.2: its PPO trainer with each step's experiences dumped or replayed.

In the launcher (``openrlhf/cli/train_ppo_ray.py``, ``train``), one import changes::

    from trajstore.trainers.openrlhf import PPOTrainer   # instead of: from openrlhf.trainer.ppo_trainer import PPOTrainer

and the run gets ``TRAJSTORE_DUMP=1 TRAJSTORE_PATH=dumps/run1`` (dump) or ``TRAJSTORE_REPLAY=1
TRAJSTORE_PATH=dumps/run1`` (replay) in the environment of the trainer's Ray actor (the job's runtime
env, ``ray job submit --runtime-env-json='{"env_vars": {...}}'``); ``trajstore=`` (a ``DumpReplayConfig``
or a dict) passed to ``PPOTrainer.remote(...)`` sets it in code instead. Neither set: OpenRLHF's trainer,
unchanged.

The recorded call is ``experience_maker.make_experience_batch(rollout_samples)`` in the trainer's
``train_step``: its output, the list of ``Experience`` micro batches the actor (and critic) train on,
holds the sequences, action masks, old / reference log-probs, values, rewards, advantages and returns.
The step key is OpenRLHF's ``global_step`` (0 for the first step of a fresh run). What the samples
generator said of the step (``filter_pass_rate``, ``prompts_consumed``, ``exhausted``) is recorded
with it (``meta["openrlhf_samples"]``).

Replay: the samples generator never runs (no prompt is sent to vLLM, no reward function runs) and
neither does the experience maker (no actor, critic, reference or reward model forward pass): each
``generate_samples`` call answers the next step's recorded meta, ``make_experience_batch`` the recorded
experiences, from the trainer's start step (its checkpoint's when resuming) until the dump's last step,
where the episode ends. Weights are not broadcast to vLLM; launch the replay with ``--vllm.num_engines 0``
so that none is started (OpenRLHF allows it without ``--ds.packing_samples``; with it the engines start and
stay idle), and with ``--eval.steps -1`` (an evaluation needs the engines: ``fit`` refuses
another when there is an eval dataset).
"""

from __future__ import annotations

from typing import Any

import ray
from openrlhf.trainer import ppo_trainer

from ..record.config import DumpReplayConfig
from ..errors import ConfigError
from ..record.recorder import Recorder

__all__ = ["Switch", "RecordedPPOTrainer", "PPOTrainer", "ReplaySamples", "META_KEY"]

META_KEY = "openrlhf_samples"  # the step metadata key of what generate_samples said of the step
_DRAWN = ("filter_pass_rate", "prompts_consumed", "exhausted")


def _config(cfg: DumpReplayConfig | dict | None) -> DumpReplayConfig:
    if cfg is None:
        return DumpReplayConfig.from_env()
    return cfg if isinstance(cfg, DumpReplayConfig) else DumpReplayConfig.from_dict(cfg)


class ReplaySamples:
    """The samples generator at replay: ``generate_samples`` answers from the dump (the rollout samples
    are a placeholder the switched ``make_experience_batch`` never reads); no prompt is drawn or sent."""

    def __init__(self, rec: Recorder, step: int = 0):
        self.rec, self.step = rec, step

    def generate_samples(self, **_: Any) -> tuple[list, float | None, int, bool]:
        steps = self.rec.steps
        if not steps or self.step > steps[-1]:
            return [], None, 0, True  # past the dump's last step: the episode ends
        drawn = self.rec.meta(self.step).get(META_KEY) or {}  # StepNotFoundError for a step not dumped
        last = self.step == steps[-1]
        return ([f"replayed step {self.step}"], drawn.get("filter_pass_rate"), drawn.get("prompts_consumed", 0),
                bool(drawn.get("exhausted", False)) or last)

    def generate_eval_samples(self, **_: Any) -> list:
        raise ConfigError("evaluation at replay (TRAJSTORE_REPLAY): the replay starts no vLLM engine to "
                          "generate with; launch it with --eval.steps -1")


class Switch:
    """Mixin for OpenRLHF's (undecorated) ``PPOTrainer`` class, first in the bases: the experience maker
    step dumped or replayed (module doc). ``trajstore=``: the config (default: ``TRAJSTORE_*``)."""

    def __init__(self, *args: Any, trajstore: DumpReplayConfig | dict | None = None, **kwargs: Any):
        self.trajstore = rec = Recorder(_config(trajstore))
        super().__init__(*args, **kwargs)
        self._drawn: dict = {}
        if rec.replaying:
            self.samples_generator = ReplaySamples(rec)
            self.vllm_engines = None  # no weights to broadcast
        elif rec.dumping:
            own = self.samples_generator.generate_samples

            def generate_samples(**kw: Any) -> Any:
                out = own(**kw)
                self._drawn = dict(zip(_DRAWN, out[1:], strict=True))
                return out
            self.samples_generator.generate_samples = generate_samples

    def init_checkpoint_states(self) -> dict:
        states = super().init_checkpoint_states()
        if isinstance(self.samples_generator, ReplaySamples) and states.get("global_step", 0) > 0:
            self.samples_generator.step = states["global_step"]  # resumed: replay from the checkpoint's step
        return states

    def fit(self, global_step: int = 0) -> None:
        if isinstance(self.samples_generator, ReplaySamples):
            if self.eval_dataloader and getattr(self.args, "eval").steps != float("inf"):  # OpenRLHF's --eval.steps
                self.trajstore.close()
                self.samples_generator.generate_eval_samples()  # refused before the first step, not at the first evaluation
            self.samples_generator.step = global_step
        try:
            return super().fit(global_step)
        finally:
            self.trajstore.close()  # every dumped step on disk when fit returns

    def broadcast_to_vllm(self) -> None:
        if not isinstance(self.samples_generator, ReplaySamples):  # replay: no engine to send weights to
            super().broadcast_to_vllm()

    def train_step(self, rollout_samples: Any, global_step: int) -> Any:
        rec, maker = self.trajstore, self.experience_maker
        if rec.mode == "off":
            return super().train_step(rollout_samples, global_step)
        own = maker.make_experience_batch
        meta = {META_KEY: self._drawn} if rec.dumping else None
        maker.make_experience_batch = lambda samples: rec.batch(global_step, lambda: own(samples), meta)
        try:
            return super().train_step(rollout_samples, global_step)
        finally:
            del maker.make_experience_batch
            if isinstance(self.samples_generator, ReplaySamples):
                self.samples_generator.step = global_step + 1


class RecordedPPOTrainer(Switch, ppo_trainer.PPOTrainer.__ray_metadata__.modified_class.__ray_actor_class__):
    """OpenRLHF's ``PPOTrainer`` class (before ``ray.remote``) with the switch."""


PPOTrainer = ray.remote(RecordedPPOTrainer)
"""``RecordedPPOTrainer`` as a Ray actor class, as OpenRLHF's ``PPOTrainer`` is: ``PPOTrainer.remote(...)``."""
