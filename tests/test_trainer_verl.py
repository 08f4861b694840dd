"""The verl switch (``trajstore.trainers.verl``) on verl 0.9.1's own code (tests/frameworks.txt): verl's
``SkipManager`` built from verl's ``skip.rollout`` config picks trajstore's ``RolloutSkip``; the steps of
``tests/test_real_verl.py``'s ``fit()`` chain run through ``AgentLoopManager.generate_sequences`` (real
``AgentLoopWorker``s) with ``SkipManager.set_step``. The first run generates and records each step
(and, asked, the batch after ``compute_advantage``); a second run, with a new ``SkipManager`` as a new
trainer makes, replays each step without starting a worker or generating."""

import asyncio

import pytest
import torch
from omegaconf import OmegaConf

import trajstore

rv = pytest.importorskip("test_real_verl")  # verl's batches along fit(), and its scripted agent loop
from verl.experimental.agent_loop.agent_loop import AgentLoopManager as VerlManager  # noqa: E402
from verl.trainer.ppo import ray_trainer  # noqa: E402
from verl.utils.skip import SkipManager  # noqa: E402

from trajstore.trainers import verl as switch  # noqa: E402


@pytest.fixture(autouse=True)
def _skip_manager_back(monkeypatch):
    """SkipManager keeps its state on the class: put it back, so later tests generate as usual."""
    for k in ("config", "step", "skip_instances"):
        monkeypatch.setattr(SkipManager, k, getattr(SkipManager, k))


def config(dump_dir, action="cache"):
    return OmegaConf.create({
        "trainer": {"experiment_name": "e", "project_name": "p", "v1": {"trainer_mode": "sync"}},
        "data": {"train_batch_size": 2, "max_prompt_length": 8, "max_response_length": 6},
        "actor_rollout_ref": {"rollout": {"n": 2}},
        "skip": {"rollout": {"enable": True, "dump_dir": str(dump_dir), "steps": [1, 2, 3], "action": action}}})


def run(monkeypatch, cfg, generate):
    """Steps 1..3 of a trainer made with ``cfg``: (generation outputs, fit() batches). ``generate``: the
    agent-loop workers may start and generate; else starting or calling one fails the test."""
    SkipManager.init(cfg)  # what RayPPOTrainer.fit() does
    assert type(SkipManager.skip_instances["rollout"]) is switch.RolloutSkip
    made, verl_manager = [], rv._manager

    def manager(P, R, vlm, workers=2):  # the trainer's manager: ours, its workers not started yet
        mgr = object.__new__(switch.AgentLoopManager)
        mgr.config = cfg
        asyncio.run(mgr._init_agent_loop_workers())
        assert mgr.agent_loop_workers is None
        made.append(verl_manager(P, R, vlm, workers).agent_loop_workers)
        return mgr

    async def start(mgr):  # verl's start of the workers: ray actors, here in this process
        if not generate:
            raise AssertionError("replay started the agent-loop workers")
        mgr.agent_loop_workers = made[-1]

    monkeypatch.setattr(rv, "_manager", manager)
    monkeypatch.setattr(VerlManager, "_init_agent_loop_workers", start)
    gens, fits = [], []
    for step in (1, 2, 3):
        SkipManager.set_step(step)
        g, f = rv.batches(seed=step)
        gens.append(g)
        fits.append(f)
    SkipManager.skip_instances["rollout"].close()
    return gens, fits


def test_first_run_records_the_next_replays_without_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_trainer, "compute_advantage", ray_trainer.compute_advantage)  # restored after
    switch.record_fit_batches()  # TRAJSTORE_VERL_FIT=1
    cfg = config(tmp_path)
    gens, fits = run(monkeypatch, cfg, generate=True)
    path = tmp_path / "e_p" / "GBS2_N2_in8_out6"
    r = trajstore.Reader(path)
    assert r.steps == [1, 2, 3] and trajstore.Reader(path, split="fit").steps == [1, 2, 3]
    for step, g, f in zip((1, 2, 3), gens, fits, strict=True):
        rv._same(r[step], g)
        assert r.meta(step) == {"global_steps": step}
        rv._same(trajstore.Reader(path, split="fit")[step], f)

    again, fits2 = run(monkeypatch, cfg, generate=False)
    for g, h, f, f2 in zip(gens, again, fits, fits2, strict=True):
        rv._same(g, h)
        rv._same(f, f2)  # fit() goes on from the replayed output exactly as from the generated one
    assert trajstore.Reader(path, split="fit").steps == [1, 2, 3]  # replayed steps are not recorded again


def test_repeat_replays_the_nearest_recorded_step(tmp_path, monkeypatch):
    cfg = config(tmp_path)
    gens, _ = run(monkeypatch, cfg, generate=True)
    SkipManager.init(config(tmp_path, action="repeat"))
    s = SkipManager.skip_instances["rollout"]
    assert [s._find_latest_step(k) for k in (0, 2, 9)] == [1, 2, 3]
    rv._same(s.warp_function(9), gens[2])


def test_steps_not_listed_and_validation_run_as_usual(tmp_path, monkeypatch):
    cfg = config(tmp_path)
    cfg.skip.rollout.steps = [2]
    gens, _ = run(monkeypatch, cfg, generate=True)
    assert trajstore.Reader(tmp_path / "e_p" / "GBS2_N2_in8_out6").steps == [2]
    SkipManager.init(cfg)
    SkipManager.set_step(2)
    prompts = rv.DataProto.from_dict({"x": torch.zeros(1, 1)})
    assert switch.AgentLoopManager._replays(prompts)
    prompts.meta_info["validate"] = True  # validation generates, and is not recorded
    assert not switch.AgentLoopManager._replays(prompts)
    SkipManager.set_step(3)
    assert not switch.AgentLoopManager._replays(rv.DataProto.from_dict({"x": torch.zeros(1, 1)}))
