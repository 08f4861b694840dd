"""Legacy dump files written exactly as each framework writes them, for tests/test_import_*.py.

verl and ROLL pickle their ``DataProto`` class, so a pickle names ``verl.protocol.DataProto`` (or ROLL's
class) and its ``__getstate__`` output. Neither package is installed in CI (verl imports ray, 79 MB), so
the classes below copy their ``__getstate__`` and ``save``/``dump`` code (verl 0.9.1 protocol.py
L377-L426; ROLL roll/distributed/scheduler/protocol.py and its rollout-mock ``_dump_batch``) and are
registered under the real module names while the file is written: the bytes are those the real class
writes (test_import_verl checks that against the real verl where it is installed)."""

from __future__ import annotations

import io
import os
import pickle
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict


@contextmanager
def as_module(name: str, cls: type):
    """``cls`` importable as ``name.<cls.__name__>`` (and its parent packages) while the block runs."""
    saved = {k: sys.modules.get(k) for k in _parents(name)}
    own = cls.__module__
    try:
        for k in _parents(name):
            if saved[k] is None:
                sys.modules[k] = types.ModuleType(k)
        mod = types.ModuleType(name)
        setattr(mod, cls.__name__, cls)
        sys.modules[name] = mod
        cls.__module__ = name
        yield cls
    finally:
        cls.__module__ = own
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


@dataclass
class DataProto:
    """verl 0.9.1 ``verl.protocol.DataProto``: its fields, ``__getstate__`` (default serialization) and
    ``save_to_disk``."""

    batch: TensorDict = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __getstate__(self):
        if os.getenv("VERL_DATAPROTO_SERIALIZATION_METHOD") == "numpy":
            return (None if self.batch is None else _serialize_tensordict(self.batch),
                    self.non_tensor_batch, self.meta_info)
        batch = self.batch
        if batch is not None and len(batch.keys()) > 0:
            batch = batch.contiguous().consolidate()
        buffer = io.BytesIO()
        torch.save(batch, buffer)
        return buffer.getvalue(), self.non_tensor_batch, self.meta_info

    def save_to_disk(self, filepath):
        with open(filepath, "wb") as f:
            pickle.dump(self, f)


def _serialize_tensordict(batch: TensorDict) -> tuple:
    """verl's serialize_tensordict / serialize_single_tensor (protocol.py L241-L259), non-nested tensors."""
    items = {k: (str(v.dtype).removeprefix("torch."), v.shape, v.flatten().contiguous().view(torch.uint8).numpy())
             for k, v in batch.items()}
    return tuple(batch.batch_size), str(batch.device) if batch.device is not None else None, items


def write_verl_rollout_skip(dump_dir: Path, steps: dict[int, Any], *, exp="exp", project="proj", gbs=2, n=2,
                            prompt_len=4, response_len=6, real_cls: type | None = None) -> Path:
    """RolloutSkip.prepare_data for each ``{step: DataProto}``: ``<dump_dir>/<exp>_<project>/GBS.._N.._in.._out../
    <step>/gen_batch.dp`` + ``meta.json``; returns the run folder."""
    run = dump_dir / f"{exp}_{project}" / f"GBS{gbs}_N{n}_in{prompt_len}_out{response_len}"
    for step, dp in steps.items():
        d = run / f"{step}"
        d.mkdir(parents=True, exist_ok=True)
        if real_cls is not None:
            dp.save_to_disk(d / "gen_batch.dp")
        else:
            with as_module("verl.protocol", DataProto):
                dp.save_to_disk(d / "gen_batch.dp")
        (d / "meta.json").write_text('{"global_steps": %d}' % step)
    return run


def verl_gen_output(B: int = 4, P: int = 4, R: int = 6, seed: int = 0) -> tuple[dict, dict, dict]:
    """(tensors, non_tensor_batch, meta_info) shaped like verl's generate_sequences output (RESEARCH.md):
    left-padded prompts, right-padded responses, a two-sided attention_mask."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, 1000, (B, P), generator=g)
    responses = torch.randint(1, 1000, (B, R), generator=g)
    pl = torch.randint(1, P + 1, (B,), generator=g)
    rl = torch.randint(1, R + 1, (B,), generator=g)
    pm = torch.arange(P).expand(B, P) >= (P - pl)[:, None]
    rm = torch.arange(R).expand(B, R) < rl[:, None]
    attention_mask = torch.cat([pm, rm], 1).long()
    tensors = {"prompts": prompts * pm, "responses": responses * rm, "response_mask": rm.long(),
               "input_ids": torch.cat([prompts * pm, responses * rm], 1), "attention_mask": attention_mask,
               "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
               "rollout_log_probs": torch.randn(B, R, generator=g) * rm}
    non_tensor = {"uid": np.array([f"uid-{i // 2}" for i in range(B)], dtype=object),
                  "data_source": np.array(["gsm8k"] * B, dtype=object)}
    meta = {"eos_token_id": 2, "pad_token_id": 0, "validate": False}
    return tensors, non_tensor, meta


@dataclass
class RollDataProto:
    """ROLL's ``DataProto`` pickling: ``__getstate__`` returns (BytesIO of torch.save(batch),
    non_tensor_batch, remote_batch, meta_info)."""

    _batch: TensorDict = None
    _non_tensor_batch: dict = field(default_factory=dict)
    _remote_batch: Any = None
    meta_info: dict = field(default_factory=dict)

    def __getstate__(self):
        buffer = io.BytesIO()
        batch = self._batch.contiguous().consolidate() if self._batch is not None else None
        torch.save(batch, buffer)
        return buffer, self._non_tensor_batch, self._remote_batch, self.meta_info


def write_roll_dump(dump_dir: Path, mode: str, steps: dict[int, RollDataProto]) -> None:
    """ROLL's rollout mock ``_dump_batch``: ``<dump_dir>/<mode>/step_{global_step:06d}.pkl``."""
    RollDataProto.__name__ = RollDataProto.__qualname__ = "DataProto"
    try:
        with as_module("roll.distributed.scheduler.protocol", RollDataProto):
            for step, batch in steps.items():
                path = os.path.join(dump_dir, mode, f"step_{step:06d}.pkl")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    pickle.dump(batch, f, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        RollDataProto.__name__ = RollDataProto.__qualname__ = "RollDataProto"
