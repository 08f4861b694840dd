"""Recorder / DumpReplayConfig / fingerprint: the dump-replay switch of a training loop."""

import logging
import os

import pytest
import torch
from hypothesis import given, settings

import trajstore
from trajstore.base import fingerprint
from trajstore.errors import ConfigError, DumpNotFoundError, EnvironmentMismatchError, StepNotFoundError
from trajstore.record.recorder import DumpReplayConfig, Recorder
from trajstore.testing import assert_batch_equal, batches


@pytest.fixture(autouse=True)
def _restore_global_state(monkeypatch):
    """deterministic() flips process-wide switches; put them back after each test."""
    det, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    applied = fingerprint._applied
    for v in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TRAJSTORE_RUN_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(v, raising=False)
    yield
    torch.use_deterministic_algorithms(det, warn_only=warn)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
    fingerprint._applied = applied


def rollout(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(1, 6, (3,), generator=g)
    mask = torch.arange(6)[None] < lengths[:, None]
    return {"input_ids": torch.randint(0, 100, (3, 6), generator=g).masked_fill(~mask, 0),
            "attention_mask": mask, "rewards": torch.rand(3, generator=g), "prompt": ["a", "b", "c"]}


def never(step=None):
    def fn():
        raise AssertionError("the rollout function was called in replay mode")
    return fn


def dump(path, steps, **cfg):
    with Recorder(DumpReplayConfig(dump=True, path=str(path), **cfg)) as rec:
        for s in steps:
            rec.batch(s, lambda s=s: rollout(s))
    return rec


# ----------------------------------------------------------------------------- modes
def test_replay_never_calls_the_rollout_function(tmp_path):
    dump(tmp_path / "d", range(4))
    rec = Recorder(DumpReplayConfig(replay=True, path=str(tmp_path / "d")))
    assert rec.replaying and not rec.dumping and rec.steps == [0, 1, 2, 3]
    for s in range(4):
        assert_batch_equal(rollout(s), rec.batch(s, never()))


def test_dump_returns_the_batch_unchanged_and_off_is_a_pass_through(tmp_path, monkeypatch):
    b = rollout(0)
    with Recorder(DumpReplayConfig(dump=True, path=str(tmp_path / "d"))) as rec:
        assert rec.batch(0, lambda: b) is b
    monkeypatch.chdir(tmp_path)
    off = Recorder(DumpReplayConfig())
    assert off.mode == "off" and not off.replaying
    sentinel = object()
    assert off.batch(0, lambda: sentinel) is sentinel
    off.close()
    assert not (tmp_path / "trajstore_dumps").exists()


def test_replay_past_the_last_step_raises_step_not_found(tmp_path):
    dump(tmp_path / "d", range(3))
    rec = Recorder(DumpReplayConfig(replay=True, path=str(tmp_path / "d")))
    with pytest.raises(StepNotFoundError, match="step 3 .*from 0 to 2"):
        rec.batch(3, never())
    with pytest.raises(DumpNotFoundError):
        Recorder(DumpReplayConfig(replay=True, path=str(tmp_path / "missing")))


@settings(max_examples=30)
@given(batches())
def test_any_batch_dumps_and_replays_exactly(tmp_path_factory, batch):
    d = tmp_path_factory.mktemp("r") / "d"
    with Recorder(dump=True, path=str(d)) as rec:
        assert rec.batch(7, lambda: batch) is batch
    assert_batch_equal(batch, Recorder(replay=True, path=str(d)).batch(7, never()))


# ----------------------------------------------------------------------------- config
def test_config_validation():
    with pytest.raises(ConfigError, match="mutually exclusive"):
        DumpReplayConfig(dump=True, replay=True)
    with pytest.raises(ConfigError, match="unknown option.*'dupm'"):
        DumpReplayConfig.from_dict({"dupm": True})
    with pytest.raises(ConfigError, match="every"):
        DumpReplayConfig(every=0)
    with pytest.raises(ConfigError, match="max_keep"):
        DumpReplayConfig(max_keep=0)
    with pytest.raises(ConfigError, match="give one of them"):
        DumpReplayConfig(steps=[1, 2], every=5)
    with pytest.raises(ConfigError, match="not a boolean"):
        DumpReplayConfig.from_dict({"dump": "maybe"})
    with pytest.raises(ConfigError, match="split"):
        DumpReplayConfig(split="../x")
    with pytest.raises(ConfigError, match="device"):
        DumpReplayConfig(device="gpu7")
    with pytest.raises(ConfigError, match="pin_steps"):
        DumpReplayConfig(pin_steps=[-1])
    with pytest.raises(ConfigError, match="replay needs the path"):
        Recorder(DumpReplayConfig(replay=True))


def test_config_from_dict_and_env():
    c = DumpReplayConfig.from_dict({"dump": "true", "steps": "0,10,20-22", "pin_steps": (5,), "max_keep": "3",
                                    "path": "/tmp/x", "device": "cpu"})
    assert c.dump and c.steps == (0, 10, 20, 21, 22) and c.pin_steps == (5,) and c.max_keep == 3
    assert DumpReplayConfig.from_dict(c.to_dict()) == c
    env = {"TRAJSTORE_REPLAY": "1", "TRAJSTORE_PATH": "/data/run7", "TRAJSTORE_SPLIT": "eval",
           "TRAJSTORE_EVERY": "4", "TRAJSTORE_STRICT": "yes", "TRAJSTORE_MAX_KEEP": "", "OTHER": "x"}
    e = DumpReplayConfig.from_env(environ=env)
    assert (e.replay, e.dump, e.path, e.split, e.every, e.strict, e.max_keep) == \
        (True, False, "/data/run7", "eval", 4, True, None)
    assert DumpReplayConfig.from_env(environ={}) == DumpReplayConfig()


def test_step_selection(tmp_path):
    assert [s for s in range(10) if DumpReplayConfig(every=3).selects(s)] == [0, 3, 6, 9]
    assert [s for s in range(10) if DumpReplayConfig(every=3, pin_steps=[4]).selects(s)] == [0, 3, 4, 6, 9]
    assert [s for s in range(10) if DumpReplayConfig(steps="2,7").selects(s)] == [2, 7]
    rec = dump(tmp_path / "d", range(10), every=4, pin_steps=[5])
    assert trajstore.Reader(tmp_path / "d").steps == [0, 4, 5, 8] == rec.steps


# ----------------------------------------------------------------------------- rotation / resume
def test_rotation_keeps_pinned_steps(tmp_path):
    rec = dump(tmp_path / "d", range(8), max_keep=2, pin_steps=[1, 3])
    assert trajstore.Reader(tmp_path / "d").steps == [1, 3, 6, 7] == sorted(rec.steps)
    est = rec.estimate(100)
    kept_sizes = [os.path.getsize(tmp_path / "d" / "train" / f"step_{s:08d}.parquet") for s in (1, 3, 6, 7)]
    assert (est["dumped"], est["kept"]) == (100, 4)
    assert min(kept_sizes) / 2 < est["bytes_per_step"] < max(kept_sizes) * 2
    assert est["bytes"] == int(est["bytes_per_step"] * 4)
    assert DumpReplayConfig(every=10, max_keep=3, pin_steps=[5]).selects(5)
    assert Recorder(every=10, max_keep=3, pin_steps=[5]).estimate(100)["kept"] == 4  # 10 selected + pin 5


def test_resume_after_restart(tmp_path):
    dump(tmp_path / "d", range(5), max_keep=3)
    assert trajstore.Reader(tmp_path / "d").steps == [2, 3, 4]
    # restarted from a checkpoint at step 4: step 4 is re-generated (differently) and replaces the old one
    with Recorder(DumpReplayConfig(dump=True, path=str(tmp_path / "d"), max_keep=3)) as rec:
        assert rec.steps == []
        rec.batch(4, lambda: rollout(40))
        assert rec.steps == [2, 3, 4]  # the steps of the earlier process count towards max_keep
        rec.batch(5, lambda: rollout(5))
    r = trajstore.Reader(tmp_path / "d")
    assert r.steps == [3, 4, 5]
    assert_batch_equal(rollout(40), r[4])
    with pytest.raises(ConfigError, match="resume=True"):
        dump(tmp_path / "d", [9], resume=False)


# ----------------------------------------------------------------------------- paths
def test_default_paths_never_collide(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with Recorder(DumpReplayConfig(dump=True)) as a, Recorder(DumpReplayConfig(dump=True, split="eval")) as b:
        a.batch(0, lambda: rollout(0))
        b.batch(0, lambda: rollout(1))
        assert a.path == b.path and a.path.parent.name == "trajstore_dumps"  # one run: one dump, two splits
        with pytest.raises(ConfigError, match="already dumping"):
            Recorder(DumpReplayConfig(dump=True)).batch(0, lambda: rollout(0))
    assert trajstore.Reader(a.path, "eval").steps == [0]
    monkeypatch.setenv("TRAJSTORE_RUN_ID", "job42")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    rec = Recorder(DumpReplayConfig(dump=True))
    assert rec.path == tmp_path / "trajstore_dumps" / "job42"
    assert rec.split == "train"  # one logical split; rank 3 writes its own shard files of each step
    explicit = Recorder(DumpReplayConfig(dump=True, path=str(tmp_path / "x"), split="eval"))
    explicit.batch(0, lambda: rollout(0))
    explicit.close()  # ranks never share files, even on an explicit path
    assert [f.name for f in (tmp_path / "x" / "eval").iterdir()] == ["step_00000000.rank00003-of-00004.parquet"]
    del rec


def test_each_step_is_logged_with_an_estimate(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trajstore.recorder")
    dump(tmp_path / "d", range(2), total_steps=10, every=2, max_keep=3)
    lines = [r.getMessage() for r in caplog.records]
    step0 = [m for m in lines if m.startswith("trajstore dump step=0 ")]
    assert step0 and "trajectories=3 " in step0[0]
    assert f"tokens={int(rollout(0)['attention_mask'].sum())} " in step0[0]
    assert "bytes=" in step0[0] and "step_00000000.parquet" in step0[0]
    assert any("a run of 10 steps records 5 and keeps 3" in m for m in lines)
    caplog.clear()
    Recorder(replay=True, path=str(tmp_path / "d")).batch(0, never())
    assert any(m.startswith("trajstore replay step=0 ") and "trajectories=3" in m for m in
               [r.getMessage() for r in caplog.records])


# ----------------------------------------------------------------------------- fingerprint
def test_fingerprint_differences_are_reported(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    dump(tmp_path / "d", [0])
    assert Recorder(replay=True, path=str(tmp_path / "d")).differences == {}
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    monkeypatch.setenv("WORLD_SIZE", "1")
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    with caplog.at_level(logging.WARNING, logger="trajstore.recorder"):
        rec = Recorder(replay=True, path=str(tmp_path / "d"))
    assert set(rec.differences) == {"env.NCCL_ALGO", "backends.cudnn_benchmark"}
    assert rec.differences["env.NCCL_ALGO"] == (None, "Tree")
    assert "env.NCCL_ALGO: recorded None, now 'Tree'" in caplog.text
    assert_batch_equal(rollout(0), rec.batch(0, never()))  # a warning, the replay goes on
    with pytest.raises(EnvironmentMismatchError, match="NCCL_ALGO.*strict=False"):
        Recorder(replay=True, strict=True, path=str(tmp_path / "d"))


def test_compare_ignores_informational_keys():
    cur = fingerprint.collect()
    rec = {**cur, "host": "elsewhere", "argv": ["other"], "git_commit": "abc", "world_size": 8,
           "libraries": {**cur["libraries"], "vllm": "0.9.0"}}
    assert fingerprint.compare(rec, cur) == {"world_size": (8, cur["world_size"]),
                                             "libraries.vllm": ("0.9.0", None)}


def test_deterministic_sets_switches_and_is_recorded(tmp_path):
    out = trajstore.deterministic(seed=3)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8") and out["seed"] == 3
    a = torch.rand(3)
    trajstore.deterministic(seed=3)
    assert torch.equal(a, torch.rand(3))
    dump(tmp_path / "d", [0])
    env = trajstore.Reader(tmp_path / "d").manifest["environment"]
    assert env["deterministic"]["seed"] == 3 and env["backends"]["deterministic_algorithms"] is True
    assert env["world_size"] == 1 and "CUBLAS_WORKSPACE_CONFIG" in env["env"]


def test_replay_reads_the_next_step_ahead(tmp_path):
    dump(tmp_path / "d", [0, 2, 3, 5])
    with Recorder(replay=True, path=str(tmp_path / "d")) as rec:
        assert_batch_equal(rollout(0), rec.batch(0, never()))
        assert rec._ahead.step == 2  # read in the background while step 0 trains
        for s in (2, 5, 3, 0, 3):  # in order, skipping, going back: always the right batch
            assert_batch_equal(rollout(s), rec.batch(s, never()))
    with Recorder(replay=True, path=str(tmp_path / "d"), prefetch=False) as rec:
        assert_batch_equal(rollout(2), rec.batch(2, never()))
        assert rec._ahead is None


def test_info_counts_only_the_steps_kept(tmp_path):
    with Recorder(dump=True, path=str(tmp_path / "d"), max_keep=2) as rec:
        for s in range(5):
            rec.batch(s, lambda s=s: rollout(s))
    info = rec.info(total_steps=10)
    files = sorted((tmp_path / "d" / "train").glob("step_*.parquet"))
    assert info["steps"] == [3, 4] and len(files) == 2
    assert info["bytes_on_disk"] == sum(f.stat().st_size for f in files)
    assert info["estimate"]["kept"] == 2 and info["estimate"]["dumped"] == 10
    rep = Recorder(replay=True, path=str(tmp_path / "d")).info()
    assert rep["mode"] == "replay" and rep["bytes_on_disk"] == info["bytes_on_disk"]
