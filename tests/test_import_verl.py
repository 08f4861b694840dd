"""`trajstore import` of verl RolloutSkip dumps (``<step>/gen_batch.dp`` + ``meta.json``, written by
``DataProto.save_to_disk``, a pickle): only with trust_pickle, verl never imported, each step back as
the DataProto it was (verl's own class where verl is loaded)."""

from __future__ import annotations

import importlib.util
import pickle
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import trajstore
from trajstore.cli import main
from trajstore.errors import ConfigError
from trajstore.inspection.importers import import_dump
from trajstore.testing import assert_batch_equal

from _import_sources import DataProto, as_module, verl_gen_output, write_verl_rollout_skip

HAVE_VERL = importlib.util.find_spec("verl") is not None


def _dp(seed: int, B: int = 4) -> DataProto:
    t, nt, mi = verl_gen_output(B=B, seed=seed)
    return DataProto(TensorDict(t, batch_size=[B]), nt, mi)


def _same(got, want: DataProto) -> None:
    assert_batch_equal(dict(got.batch.items()), dict(want.batch.items()))
    assert list(got.batch.keys()) == list(want.batch.keys())
    assert got.non_tensor_batch.keys() == want.non_tensor_batch.keys()
    for k, v in want.non_tensor_batch.items():
        assert got.non_tensor_batch[k].dtype == v.dtype and got.non_tensor_batch[k].tolist() == v.tolist()
    assert got.meta_info == want.meta_info


def test_rollout_skip_dump(tmp_path, capsys):
    steps = {s: _dp(s) for s in (1, 2, 4)}
    run = write_verl_rollout_skip(tmp_path / "rollout_dump", steps)
    loaded = "verl" in sys.modules  # False unless another test imported the real verl
    # without the flag: an error that says what the flag means, and nothing written
    assert main(["import", str(tmp_path / "rollout_dump"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--trust-pickle" in err and "runs code" in err and not (tmp_path / "out").exists()
    assert main(["import", str(tmp_path / "rollout_dump"), str(tmp_path / "out"), "--trust-pickle"]) == 0
    assert "split train: steps 1-2, 4  rows 12" in capsys.readouterr().out
    assert ("verl" in sys.modules) == loaded  # the importer never imports verl (nor ray)
    r = trajstore.Reader(tmp_path / "out")
    for s, dp in steps.items():
        got = r[s]
        _same(got, dp)
        assert r.meta(s) == {"global_steps": s, "imported_from": {
            "kind": "verl", "file": str((run / str(s) / "gen_batch.dp").relative_to(tmp_path / "rollout_dump"))}}
    # replayed as verl's class once verl.protocol is loaded (here the stand-in module of the test)
    if not loaded:
        with as_module("verl.protocol", DataProto):
            assert type(trajstore.Reader(tmp_path / "out")[1]) is DataProto


def test_numpy_serialization(tmp_path, monkeypatch):
    """verl's VERL_DATAPROTO_SERIALIZATION_METHOD=numpy pickles the TensorDict as raw bytes per field."""
    dp = _dp(7)
    dp.batch["logp_bf16"] = torch.randn(4, 6).to(torch.bfloat16)
    monkeypatch.setenv("VERL_DATAPROTO_SERIALIZATION_METHOD", "numpy")
    write_verl_rollout_skip(tmp_path / "d", {3: dp})
    monkeypatch.delenv("VERL_DATAPROTO_SERIALIZATION_METHOD")
    import_dump(tmp_path / "d", tmp_path / "out", trust_pickle=True)
    _same(trajstore.Reader(tmp_path / "out")[3], dp)


def test_incomplete_step_and_unstorable_batch_are_skipped(tmp_path):
    odd = _dp(3)
    odd.non_tensor_batch["extras"] = np.array([Fraction(1, 3)] * 4, dtype=object)  # no exact representation
    run = write_verl_rollout_skip(tmp_path / "d", {0: _dp(0), 1: odd, 2: _dp(2)})
    (run / "2" / "meta.json").unlink()  # RolloutSkip writes meta.json last: step 2 is incomplete
    rep = import_dump(tmp_path / "d", tmp_path / "out", trust_pickle=True)
    assert rep.splits() == {"train": [0]}
    why = {s.step: s.reason for s in rep.skipped}
    assert "Fraction" in why[1] and "meta.json" in why[2]
    assert 1 in trajstore.Reader(tmp_path / "out").skipped
    with pytest.raises(trajstore.BatchError, match="Fraction"):
        import_dump(tmp_path / "d", tmp_path / "out2", trust_pickle=True, strict=True)


def test_hostile_gen_batch_runs_nothing_without_trust(tmp_path, monkeypatch):
    run = write_verl_rollout_skip(tmp_path / "d", {0: _dp(0)})
    marker = tmp_path / "EXECUTED"

    class Evil:
        def __reduce__(self):
            return (Path(marker).touch, ())

    (run / "0" / "gen_batch.dp").write_bytes(pickle.dumps(Evil()))

    def boom(*a, **k):
        raise AssertionError("unpickler called without trust_pickle")

    with monkeypatch.context() as m:
        for name in ("Unpickler", "load", "loads"):
            m.setattr(pickle, name, boom)
        m.setattr(torch, "load", boom)
        with pytest.raises(ConfigError, match="--trust-pickle"):
            import_dump(tmp_path / "d", tmp_path / "out")
    assert not marker.exists()
    rep = import_dump(tmp_path / "d", tmp_path / "out", trust_pickle=True)  # trusted: its code runs
    assert marker.exists() and "not a DataProto" in rep.skipped[0].reason


def test_several_runs_are_refused(tmp_path):
    write_verl_rollout_skip(tmp_path / "d", {0: _dp(0)}, gbs=2)
    write_verl_rollout_skip(tmp_path / "d", {0: _dp(0)}, gbs=4)
    with pytest.raises(ConfigError, match="2 RolloutSkip runs"):
        import_dump(tmp_path / "d", tmp_path / "out", trust_pickle=True)
    rep = import_dump(tmp_path / "d" / "exp_proj" / "GBS4_N2_in4_out6", tmp_path / "out", trust_pickle=True)
    assert rep.splits() == {"train": [0]}


@pytest.mark.skipif(not HAVE_VERL, reason="verl is not installed (the copy in _import_sources is used above)")
def test_real_verl_writes_the_same_bytes(tmp_path):
    """Where verl is installed: the real DataProto.save_to_disk writes the bytes the test copy writes."""
    from verl.protocol import DataProto as RealDataProto

    t, nt, mi = verl_gen_output(seed=5)
    real = RealDataProto(batch=TensorDict(t, batch_size=[4]), non_tensor_batch=nt, meta_info=mi)
    a = write_verl_rollout_skip(tmp_path / "real", {0: real}, real_cls=RealDataProto)
    b = write_verl_rollout_skip(tmp_path / "copy", {0: DataProto(TensorDict(t, batch_size=[4]), nt, mi)})
    assert (a / "0" / "gen_batch.dp").read_bytes() == (b / "0" / "gen_batch.dp").read_bytes()
    import_dump(tmp_path / "real", tmp_path / "out", trust_pickle=True)
    assert type(trajstore.Reader(tmp_path / "out")[0]) is RealDataProto
