"""TRL: ``GRPOTrainer`` and ``RLOOTrainer`` whose generate-and-score step is dumped or replayed.

>>> from trajstore.trainers.trl import GRPOTrainer      # instead of: from trl import GRPOTrainer
>>> trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...)
>>> trainer.train()

and run with ``TRAJSTORE_DUMP=1 TRAJSTORE_PATH=dumps/run1`` (dump) or ``TRAJSTORE_REPLAY=1
TRAJSTORE_PATH=dumps/run1`` (replay); ``trajstore=`` (a ``DumpReplayConfig`` or a dict) sets it in code
instead. Neither set: the trainer is TRL's, unchanged.

The recorded call is ``_generate_and_score_completions`` (TRL calls it from ``_prepare_inputs`` once
every ``steps_per_generation * num_iterations`` micro-steps): its output holds the prompts and
completions, rewards, advantages and old/ref log-probs. The step key is TRL's micro-step counter
``_step`` at that call. Dump: the method runs and its output is recorded, with the state of torch's
random generators right after it (``meta["trajstore_rng"]``). Replay: the method never runs (no
generation, no reward functions, no log-prob forward passes); the recorded output is returned and the
random generators are set to the recorded state, so ``_prepare_inputs``' shuffle and everything after it
draw what the dump run drew: the losses are the dump run's, bit for bit, on the same hardware.
Evaluation batches (the model not in training mode) are never recorded nor replayed.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import GRPOTrainer as _GRPOTrainer
from trl import RLOOTrainer as _RLOOTrainer

from ..record.config import DumpReplayConfig
from ..record.recorder import Recorder

__all__ = ["GRPOTrainer", "RLOOTrainer", "recorded", "RNG_KEY"]

RNG_KEY = "trajstore_rng"  # the step metadata key of the random generators' state


def rng_state() -> dict:
    """torch's CPU generator state, and each CUDA device's when CUDA is in use."""
    s = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["cpu"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _config(cfg: DumpReplayConfig | dict | None) -> DumpReplayConfig:
    if cfg is None:
        return DumpReplayConfig.from_env()
    return cfg if isinstance(cfg, DumpReplayConfig) else DumpReplayConfig.from_dict(cfg)


def recorded(base: type) -> type:
    """A subclass of TRL trainer class ``base`` (one defining ``_generate_and_score_completions`` and
    ``_step``, as ``GRPOTrainer`` and ``RLOOTrainer`` do) with the switch of the module doc."""

    class Recorded(base):
        def __init__(self, *args: Any, trajstore: DumpReplayConfig | dict | None = None, **kwargs: Any):
            cfg = _config(trajstore)
            super().__init__(*args, **kwargs)
            device = self.accelerator.device
            over = {"device": str(device)} if cfg.device is None and device.type != "cpu" else {}
            self.trajstore = Recorder(cfg, **over)  # replayed tensors where TRL computes

        def _generate_and_score_completions(self, inputs: Any) -> dict:
            rec, step = self.trajstore, self._step
            if rec.mode == "off" or not self.model.training:
                return super()._generate_and_score_completions(inputs)
            if rec.replaying:
                batch = rec.load(step)
                state = rec.meta(step).get(RNG_KEY)
                if isinstance(state, dict):  # this rank's (on another world size: the ranks' list, not used)
                    set_rng_state(state)
                return batch
            batch = super()._generate_and_score_completions(inputs)
            if rec.selected(step):
                rec.record(step, batch, meta={RNG_KEY: rng_state()})
            return batch

        def train(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().train(*args, **kwargs)
            finally:
                self.trajstore.close()  # every dumped step on disk when train() returns

    Recorded.__name__ = Recorded.__qualname__ = base.__name__
    Recorded.__module__ = __name__
    Recorded.__doc__ = f"TRL's ``{base.__name__}``, its generate-and-score step dumped or replayed by trajstore."
    return Recorded


GRPOTrainer = recorded(_GRPOTrainer)
RLOOTrainer = recorded(_RLOOTrainer)
