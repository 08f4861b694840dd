"""`trajstore import` of torch.save folders as AReaL, slime and TRL users write them: read with
torch.load(weights_only=True) only, steps and splits from the names, every batch back exactly."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

import trajstore
from trajstore.cli import main
from trajstore.errors import ConfigError, FormatError
from trajstore.inspection.importers import import_dump
from trajstore.testing import assert_batch_equal


def areal_episode(T: int, seed: int) -> dict:
    """One AReaL RLVR episode (workflow/rlvr.py): [1, T] tensors, versions -1 on the prompt."""
    g = torch.Generator().manual_seed(seed)
    P = T // 3
    return {"input_ids": torch.randint(0, 32000, (1, T), generator=g, dtype=torch.int32),
            "loss_mask": torch.tensor([[0] * P + [1] * (T - P)], dtype=torch.int32),
            "logprobs": torch.randn(1, T, generator=g),
            "versions": torch.tensor([[-1] * P + [3] * (T - P)], dtype=torch.int32),
            "attention_mask": torch.ones(1, T, dtype=torch.bool),
            "rewards": torch.tensor([1.0])}


def slime_sample(i: int) -> dict:
    """slime's Sample.to_dict() (slime/utils/types.py): __dict__ with status and the info dataclasses as values."""
    n = 2 + i
    return {"group_index": i // 2, "index": i, "prompt": [{"role": "user", "content": f"q{i}"}],
            "tokens": list(range(10, 14 + n)), "multimodal_inputs": None, "multimodal_train_inputs": None,
            "response": "x" * n, "response_length": n, "label": "4", "reward": 0.5 * i, "loss_mask": [1] * n,
            "weight_versions": ["7"], "rollout_log_probs": [-0.25] * n, "rollout_routed_experts": None,
            "remove_sample": False, "teacher_log_probs": None, "mopd_teacher_log_probs": None,
            "status": "completed", "metadata": {"raw_reward": 0.5 * i}, "generate_function_path": None,
            "train_metadata": None, "session_id": None, "non_generation_time": 0.0,
            "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                          "completion_token_num": 0},
            "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": 4}}


def trl_batch(B: int, P: int, C: int, seed: int) -> dict:
    """GRPOTrainer._generate_and_score_completions output (grpo_trainer.py L2898-2937), text model."""
    g = torch.Generator().manual_seed(seed)
    pm = (torch.arange(P).expand(B, P) >= torch.randint(0, P, (B, 1), generator=g)).long()
    cm = (torch.arange(C).expand(B, C) < torch.randint(1, C + 1, (B, 1), generator=g)).long()
    return {"prompt_ids": torch.randint(1, 100, (B, P), generator=g) * pm, "prompt_mask": pm,
            "completion_ids": torch.randint(1, 100, (B, C), generator=g) * cm, "completion_mask": cm,
            "advantages": torch.randn(B, generator=g), "num_items_in_batch": torch.tensor(int(cm.sum())),
            "old_per_token_logps": torch.randn(B, C, generator=g) * cm}


def test_areal_trajectory_dump(tmp_path):
    """AReaL's trajectory dump: step_{step:06d}.pt (single controller) and step_{step:06d}_dp_{rank}.pt
    (SPMD), each torch.save of the list of trajectory dicts prepare_batch returned."""
    src = tmp_path / "trajectories"
    src.mkdir()
    batches = {}
    for step in (1, 2, 5):
        batches[("train", step)] = [areal_episode(8 + 3 * i, step * 10 + i) for i in range(3)]
        torch.save(batches[("train", step)], src / f"step_{step:06d}.pt")
    for rank in (0, 3):
        batches[(f"train-dp{rank}", 7)] = [areal_episode(5 + rank, rank)]
        torch.save(batches[(f"train-dp{rank}", 7)], src / f"step_{7:06d}_dp_{rank}.pt")
    rep = import_dump(src, tmp_path / "out")
    assert rep.kind == "pt" and not rep.skipped
    assert rep.splits() == {"train": [1, 2, 5], "train-dp0": [7], "train-dp3": [7]}
    for (split, step), b in batches.items():
        r = trajstore.Reader(tmp_path / "out", split)
        assert_batch_equal(r[step], b)
        assert r.meta(step) == {"imported_from": {"kind": "pt", "file": f"step_{step:06d}" +
                                                  (f"_dp_{split[-1]}" if "dp" in split else "") + ".pt"}}
    assert trajstore.verify(tmp_path / "out").ok


def test_slime_debug_rollout_data(tmp_path):
    """slime --save-debug-rollout-data /x/rollout_data_{rollout_id}.pt: torch.save(dict(rollout_id=..,
    samples=[Sample.to_dict()...], metadata=...)), eval rollouts as eval_<id>: the dict comes back as saved."""
    src = tmp_path / "slime_debug"
    src.mkdir()
    saved = {}
    for rid, name, split in ((0, "0", "train"), (1, "1", "train"), (1, "eval_1", "eval")):
        saved[(split, rid)] = {"rollout_id": rid, "metadata": {"weight_version": rid},
                               "samples": [slime_sample(i) for i in range(4)]}
        torch.save(saved[(split, rid)], src / f"rollout_data_{name}.pt")
    rep = import_dump(src, tmp_path / "out")
    assert rep.splits() == {"eval": [1], "train": [0, 1]} and not rep.skipped
    for (split, rid), obj in saved.items():
        got = trajstore.Reader(tmp_path / "out", split)[rid]
        assert_batch_equal(got, obj)
        assert got == obj  # plain Python values, compared as such too


def test_trl_batches_and_cli(tmp_path, capsys):
    """A TRL user's torch.save(batch, f"step_{i}.pt") of the trainer's batch dict, through the command."""
    src = tmp_path / "trl"
    src.mkdir()
    batches = {i: trl_batch(4, 5 + i, 7, i) for i in range(3)}
    for i, b in batches.items():
        torch.save(b, src / f"step_{i}.pt")
    assert main(["import", str(src), str(tmp_path / "out"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [(i["split"], i["step"], i["rows"]) for i in rep["imported"]] == [("train", i, 4) for i in range(3)]
    r = trajstore.Reader(tmp_path / "out")
    for i, b in batches.items():
        assert_batch_equal(r[i], b)
    # a second import of the same files keeps the steps an earlier run imported (docs/IMPORT.md)
    assert main(["import", str(src), str(tmp_path / "out")]) == 0
    assert "3 of them by an earlier run from the same files" in capsys.readouterr().out
    assert main(["import", str(src), str(tmp_path / "out"), "--overwrite"]) == 0
    assert "imported 3 step(s)" in capsys.readouterr().out


def test_file_needing_more_than_weights_only_is_refused_without_trust(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    b = {"input_ids": torch.arange(6).view(2, 3), "uid": np.array(["a", "b"], dtype=object)}
    torch.save(b, src / "step_3.pt")
    with pytest.raises(ConfigError) as e:
        import_dump(src, tmp_path / "out")
    msg = str(e.value)
    assert "step_3.pt" in msg and "--trust-pickle" in msg and "runs code" in msg and "numpy" in msg
    assert main(["import", str(src), str(tmp_path / "out2")]) == 2
    assert "--trust-pickle" in capsys.readouterr().err
    rep = import_dump(src, tmp_path / "out3", trust_pickle=True)
    assert rep.splits() == {"train": [3]}
    assert_batch_equal(trajstore.Reader(tmp_path / "out3")[3], b)


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path(self.marker).touch, ())


def test_hostile_pt_runs_nothing_without_trust(tmp_path, monkeypatch):
    """A .pt whose pickle would create a file when loaded: refused, the file is not created, and no
    unrestricted unpickler is ever called."""
    src = tmp_path / "src"
    src.mkdir()
    marker = tmp_path / "EXECUTED"
    torch.save({"x": torch.arange(3), "evil": _Evil(str(marker))}, src / "step_0.pt")

    def boom(*a, **k):
        raise AssertionError("unrestricted unpickler called without trust_pickle")

    monkeypatch.setattr(pickle, "Unpickler", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    with pytest.raises(ConfigError, match="--trust-pickle"):
        import_dump(src, tmp_path / "out")
    assert not marker.exists()
    monkeypatch.undo()
    import_dump(src, tmp_path / "out2", trust_pickle=True)  # trusted: the file's code does run
    assert marker.exists()


def test_unreadable_and_unnamed_files_are_skipped_with_reasons(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"x": torch.arange(4)}, src / "step_0.pt")
    (src / "step_1.pt").write_bytes(b"not a torch file")
    torch.save({"x": torch.arange(4)}, src / "latest.pt")
    torch.save({"x": torch.zeros(2, 3), "y": torch.zeros(5)}, src / "step_2.pt")  # lengths 2 vs 5: not a batch
    rep = import_dump(src, tmp_path / "out")
    assert rep.splits() == {"train": [0]}
    why = {s.source: s.reason for s in rep.skipped}
    assert set(why) == {"step_1.pt", "latest.pt", "step_2.pt"}
    assert "cannot be read" in why["step_1.pt"] and "no step number" in why["latest.pt"]
    assert "2" in why["step_2.pt"] and "5" in why["step_2.pt"]
    r = trajstore.Reader(tmp_path / "out")
    assert 2 in r.skipped and "step_2.pt" in r.skipped[2]  # recorded in the dump as well
    assert "skipped 3 file(s)" in rep.summary()
    with pytest.raises((FormatError, trajstore.BatchError), match="strict"):
        import_dump(src, tmp_path / "out_strict", strict=True)


def test_nothing_to_import(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(trajstore.DumpNotFoundError):
        import_dump(tmp_path / "empty", tmp_path / "out")
    assert main(["import", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    with pytest.raises(ConfigError, match="kind"):
        import_dump(tmp_path / "empty", tmp_path / "out", kind="hdf5")


def test_single_file_without_step_number_is_step_0(tmp_path):
    """AReaL's debugging guide saves one rollout_batch result as batch_data.pt."""
    b = {"input_ids": torch.arange(12).view(3, 4), "attention_mask": torch.ones(3, 4, dtype=torch.long)}
    torch.save(b, tmp_path / "batch_data.pt")
    rep = import_dump(tmp_path / "batch_data.pt", tmp_path / "out", split="debug")
    assert rep.splits() == {"debug": [0]}
    assert_batch_equal(trajstore.Reader(tmp_path / "out", "debug")[0], b)
