"""`trajstore import` of ROLL rollout-mock dumps (``<dump_dir>/<train|val>/step_000000.pkl``, pickled
``DataProto``): only with trust_pickle, ROLL never imported, modes become splits."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import trajstore
from trajstore.errors import ConfigError
from trajstore.inspection.importers import import_dump
from trajstore.testing import assert_batch_equal

from _import_sources import RollDataProto, write_roll_dump


def _batch(step: int, B: int = 3, T: int = 8) -> RollDataProto:
    g = torch.Generator().manual_seed(step)
    mask = (torch.arange(T).expand(B, T) < torch.randint(2, T + 1, (B, 1), generator=g)).long()
    td = TensorDict({"input_ids": torch.randint(1, 500, (B, T), generator=g) * mask, "attention_mask": mask,
                     "response_mask": mask.clone(), "scores": torch.randn(B, generator=g)}, batch_size=[B])
    nt = {"tags": np.array([f"sokoban-{i}" for i in range(B)], dtype=object),
          "env_ids": np.array([str(i) for i in range(B)], dtype=object)}
    return RollDataProto(td, nt, None, {"global_step": step, "is_offload_states": False})


def test_rollout_mock_dump(tmp_path):
    train = {s: _batch(s) for s in range(3)}
    val = {0: _batch(10)}
    write_roll_dump(tmp_path / "baseline_v1", "train", train)
    write_roll_dump(tmp_path / "baseline_v1", "val", val)
    with pytest.raises(ConfigError, match="ROLL.*--trust-pickle"):
        import_dump(tmp_path / "baseline_v1", tmp_path / "out")
    rep = import_dump(tmp_path / "baseline_v1", tmp_path / "out", trust_pickle=True)
    assert rep.kind == "roll" and rep.splits() == {"train": [0, 1, 2], "val": [0]} and not rep.skipped
    assert "roll" not in sys.modules
    for split, steps in (("train", train), ("val", val)):
        r = trajstore.Reader(tmp_path / "out", split)
        for s, want in steps.items():
            got = r[s]
            assert_batch_equal(dict(got.batch.items()), dict(want._batch.items()))
            assert {k: v.tolist() for k, v in got.non_tensor_batch.items()} == \
                {k: v.tolist() for k, v in want._non_tensor_batch.items()}
            assert got.meta_info == want.meta_info
            assert r.meta(s)["imported_from"] == {"kind": "roll", "file": f"{split}/step_{s:06d}.pkl"}


def test_remote_batch_is_skipped(tmp_path):
    b = _batch(0)
    b._remote_batch = {"logits_ref": "held by another worker"}
    write_roll_dump(tmp_path / "d", "train", {0: b, 1: _batch(1)})
    rep = import_dump(tmp_path / "d", tmp_path / "out", trust_pickle=True)
    assert rep.splits() == {"train": [1]} and "remote_batch" in rep.skipped[0].reason
