"""The batches of ``tests/data/v1_dump``: a small dump written by trajstore 0.1.0 (format 1) before
the package was restructured, kept so every later version is checked to read it bit for bit.

Each batch is built from fixed numbers (no random generator), so the test rebuilds it exactly.
``cd tests && python _legacy.py OUT`` wrote the dump; it is not run by the tests.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from trajstore.format.batch.containers import DataProtoLike


def _padded(side: str) -> dict:
    B, T = 4, 7
    lengths = torch.tensor([7, 3, 5, 1])
    ar = torch.arange(T)
    mask = ar[None, :] < lengths[:, None] if side == "right" else ar[None, :] >= (T - lengths)[:, None]
    ids = (torch.arange(B * T).reshape(B, T) * 37 % 1000).masked_fill(~mask, 0)
    lp = (-(torch.arange(B * T, dtype=torch.float32).reshape(B, T) + 1) / 16).masked_fill(~mask, 0.0)
    lp_bf16 = lp.to(torch.bfloat16)
    garbage = torch.arange(B * T, dtype=torch.float32).reshape(B, T) / 8  # padding not constant
    return {
        "input_ids": ids.to(torch.int64),
        "attention_mask": mask,
        "loss_mask": mask.to(torch.int32) * (ar[None, :] % 2 == 0).to(torch.int32),
        "logprobs": lp_bf16,
        "values": garbage,
        "versions": torch.full((B, T), 3, dtype=torch.int16).masked_fill(~mask, -1),
        "hidden": torch.arange(B * T * 2, dtype=torch.float16).reshape(B, T, 2),
        "rewards": torch.tensor([1.0, -0.5, 0.25, 0.0]),
        "uid": np.array(["a", "b", "c", "d"]),
        "extra": {"score": np.arange(B, dtype=np.float64) / 3, "tag": ["x", None, "z", "w"]},
        "temperature": 0.7,
        "scale": torch.tensor(2.5, dtype=torch.float64),
    }


def _packed() -> dict:
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    N = int(cu[-1])
    return {
        "input_ids": torch.arange(N, dtype=torch.int64) * 11,
        "position_ids": torch.cat([torch.arange(3), torch.arange(1), torch.arange(5)]),
        "logprobs": -torch.arange(N, dtype=torch.float32) / 7,
        "cu_seqlens": cu,
        "max_seqlen": 5,
        "rewards": torch.tensor([0.5, 1.0, -1.0], dtype=torch.float32),
    }


def _plain() -> dict:
    return {
        "rewards": np.array([1, 2, 3], dtype=np.uint32),
        "names": ["p", "q", "r"],
        "meta": [{"k": 1}, {"k": [1, 2]}, None],
        "flags": (True, False, True),
    }


def _trajectories() -> list:
    return [
        {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.bool),
         "reward": 1.0, "image": torch.arange(12, dtype=torch.uint8).reshape(3, 4), "turns": 2},
        None,
        {"input_ids": torch.tensor([[4, 5]]), "attention_mask": torch.tensor([[True, False]]),
         "reward": -0.5, "turns": 1, "note": "short"},
    ]


def _tensordict():
    from tensordict import TensorDict

    td = TensorDict({"obs": torch.arange(6, dtype=torch.float32).reshape(3, 2),
                     "act": torch.tensor([0, 1, 1])}, batch_size=[3])
    td["sub"] = TensorDict({"x": torch.arange(3, dtype=torch.int8)}, batch_size=[3])
    return td


def _dataproto():
    from tensordict import TensorDict

    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    td = TensorDict({"input_ids": torch.tensor([[5, 6, 0], [7, 8, 9]]), "attention_mask": m}, batch_size=[2])
    return DataProtoLike(batch=td, non_tensor_batch={"uid": np.array(["u0", "u1"], dtype=object)},
                         meta_info={"temperature": 1.0, "global_steps": 4})


def batches() -> dict[str, list[tuple[int, object, dict]]]:
    """split -> [(step, batch, meta)] as appended to the fixture dump."""
    return {
        "train": [(0, _padded("right"), {"lr": 1e-6}), (1, _padded("left"), {}), (2, _packed(), {}),
                  (3, _plain(), {"note": "plain"}), (4, _trajectories(), {})],
        "containers": [(0, _tensordict(), {}), (1, _dataproto(), {})],
    }


def write(path: str) -> None:
    import trajstore

    for split, steps in batches().items():
        with trajstore.Writer(path, split=split) as w:
            for step, batch, meta in steps:
                w.append(step, batch, meta=meta)


if __name__ == "__main__":
    write(sys.argv[1])
