"""The verl switch (``trajstore.trainers.verl``) on verl 0.9.1's own code (tests/frameworks.txt), with verl's
``ppo_trainer.yaml`` composed with the switch's keys: verl's ``SkipManager`` picks trajstore's ``RolloutSkip``;
the steps of ``tests/test_real_verl.py``'s ``fit()`` chain run through ``AgentLoopManager.generate_sequences``
(real ``AgentLoopWorker``s) with ``SkipManager.set_step``. The first run generates and records each step
(and, asked, the batch after ``compute_advantage``); a second run replays each step without starting a
worker or generating. ``RayPPOTrainer.init_workers`` (verl's code, GPU worker groups stubbed) then builds
the trainer of a run that replays every step: verl's ``LLMServerManager.create`` and weight update made to
fail, it starts no LLM server, and ``fit()``'s server lines (weight updates, ``sleep_replicas``) do nothing;
a run that generates calls both."""

import asyncio
import types
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import trajstore

rv = pytest.importorskip("test_real_verl")  # verl's batches along fit(), and its scripted agent loop
import verl  # noqa: E402
from verl.checkpoint_engine import CheckpointEngineManager as VerlCheckpoints  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopManager as VerlManager  # noqa: E402
from verl.single_controller.ray import RayClassWithInitArgs  # noqa: E402
from verl.trainer.ppo.utils import Role  # noqa: E402
from verl.utils.ray_utils import auto_await  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerManager as VerlServers  # noqa: E402
from verl.trainer.ppo import ray_trainer  # noqa: E402
from verl.utils.skip import SkipManager  # noqa: E402

from trajstore.trainers import verl as switch  # noqa: E402


@pytest.fixture(autouse=True)
def _skip_manager_back(monkeypatch):
    """SkipManager keeps its state on the class: put it back, so later tests generate as usual."""
    for k in ("config", "step", "skip_instances"):
        monkeypatch.setattr(SkipManager, k, getattr(SkipManager, k))


SWITCH = [  # docs/frameworks/verl.md's keys
    "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=trajstore.trainers.verl.AgentLoopManager",
    "+actor_rollout_ref.rollout.checkpoint_manager_class=trajstore.trainers.verl.CheckpointEngineManager",
    "skip.rollout.enable=True"]
REPLAY = ["trainer.val_before_train=False", "trainer.test_freq=-1"]  # no validation: nothing generates


def config(dump_dir, action="cache", extra=(), switch_keys=SWITCH):
    """verl's own ppo_trainer.yaml with the switch's overrides, composed as ``main_ppo`` does."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()  # another test's framework (AReaL's config parser) may have left it initialized
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        return compose("ppo_trainer", overrides=[
            *switch_keys, "skip.rollout.steps=[1,2,3]", f"skip.rollout.dump_dir={dump_dir}",
            f"skip.rollout.action={action}",
            "trainer.experiment_name=e", "trainer.project_name=p", "trainer.total_training_steps=3",
            "data.train_batch_size=2", "data.max_prompt_length=8", "data.max_response_length=6",
            "actor_rollout_ref.rollout.n=2", *extra])


def run(monkeypatch, cfg, generate):
    """Steps 1..3 of a trainer made with ``cfg``: (generation outputs, fit() batches). ``generate``: the
    agent-loop workers may start and generate; else starting or calling one fails the test."""
    SkipManager.init(cfg)  # what RayPPOTrainer.fit() does
    assert type(SkipManager.skip_instances["rollout"]) is switch.RolloutSkip
    made, verl_manager = [], rv._manager

    def manager(P, R, vlm, workers=2):  # the trainer's manager: ours, its workers not started yet
        mgr = object.__new__(switch.AgentLoopManager)
        mgr.config, mgr.llm_client = cfg, None
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
    cfg = config(tmp_path, extra=["skip.rollout.steps=[2]"])
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


class _WorkerGroup:
    """The actor worker group (GPU workers): what init_workers asks of it."""

    world_size = 1

    def init_model(self):
        pass


class _Pools:
    """verl's ResourcePoolManager, without ray placement groups."""

    resource_pool_dict = {"global_pool": "pool"}

    def create_resource_pool(self):
        pass

    def get_resource_pool(self, role):
        return "pool"


def trainer(monkeypatch, cfg, events, servers):
    """``RayPPOTrainer.init_workers`` (verl's code) with the GPU worker groups, ray's reward workers and
    verl's LLM server start stubbed. ``servers``: verl's ``LLMServerManager.create`` and the weight update
    may run (recorded in ``events``); else calling either fails the test."""

    class Replica:
        async def sleep(self):
            events.append("sleep")

    @auto_await
    async def create(cls, *args, **kwargs):  # verl's LLMServerManager.create: starts vLLM/SGLang replicas
        assert servers, "replay started the LLM servers"
        events.append("servers")
        return types.SimpleNamespace(get_client=lambda: "client", get_replicas=lambda: [Replica()])

    @auto_await
    async def update_weights(self, global_steps=None):  # verl's weight sync, actor -> servers
        assert servers, "replay updated the weights of LLM servers"
        events.append(("update_weights", global_steps))
        return {}

    monkeypatch.setattr(VerlServers, "create", classmethod(create))
    monkeypatch.setattr(VerlCheckpoints, "update_weights", update_weights)
    monkeypatch.setattr(ray_trainer, "create_colocated_worker_cls", lambda class_dict: class_dict)
    monkeypatch.setattr("verl.experimental.reward_loop.RewardLoopManager",
                        lambda config, rm_resource_pool: types.SimpleNamespace(reward_loop_workers=None))
    t = object.__new__(ray_trainer.RayPPOTrainer)
    vars(t).update(config=cfg, resource_pool_manager=_Pools(), role_worker_mapping={Role.ActorRollout: object},
                   hybrid_engine=True, use_critic=False, use_reference_policy=False, ref_in_actor=False,
                   use_rm=False, use_teacher_policy=False, device_name="cpu",
                   ray_worker_group_cls=lambda resource_pool, ray_cls_with_init, **kw: types.SimpleNamespace(
                       spawn=lambda prefix_set: {k: _WorkerGroup() for k in prefix_set}))
    t.init_workers()
    assert isinstance(t.async_rollout_manager, switch.AgentLoopManager)
    return t


def fit_rollout(t, steps=(1, 2, 3)):
    """The lines of ``RayPPOTrainer.fit()`` that touch the LLM servers, in its order (ray_trainer.py 1430-1716)."""
    t.checkpoint_manager.update_weights(0)
    SkipManager.init(t.config)
    outs = []
    for step in steps:
        SkipManager.set_step(step)
        prompts = rv.DataProto.from_dict({"x": torch.zeros(4, 1)}, meta_info={"global_steps": step})
        outs.append(t.async_rollout_manager.generate_sequences(prompts))
        t.checkpoint_manager.sleep_replicas()
        t.checkpoint_manager.update_weights(step)
    return outs


def test_replay_of_every_step_starts_no_llm_server_and_syncs_no_weights(tmp_path, monkeypatch):
    gens, _ = run(monkeypatch, config(tmp_path), generate=True)  # the dump run: steps 1..3 recorded
    cfg = config(tmp_path, extra=REPLAY)
    assert switch.servers_needed(cfg) == ""
    events = []
    t = trainer(monkeypatch, cfg, events, servers=False)
    assert isinstance(t.checkpoint_manager, switch.CheckpointEngineManager)
    assert t.llm_server_manager.get_replicas() == [] and t.llm_server_manager.global_load_balancer is None
    for g, h in zip(gens, fit_rollout(t), strict=True):
        rv._same(g, h)
    assert events == []
    SkipManager.set_step(4)  # a batch the dump does not hold: no server to generate it, the error says so
    with pytest.raises(RuntimeError, match="step 4: this run started no LLM server"):
        t.async_rollout_manager.generate_sequences(rv.DataProto.from_dict({"x": torch.zeros(4, 1)}))


def test_a_run_that_generates_starts_the_llm_servers_and_syncs_weights(tmp_path, monkeypatch):
    events = []
    t = trainer(monkeypatch, config(tmp_path, extra=REPLAY), events, servers=True)  # empty dump: it generates
    assert events == ["servers", "sleep"]  # init_workers: the servers start, then sleep
    t.checkpoint_manager.update_weights(0)
    t.checkpoint_manager.sleep_replicas()
    assert events[2:] == [("update_weights", 0), "sleep"]


@pytest.mark.parametrize("extra, why", [
    ([], "validation generates"),
    (REPLAY + ["skip.rollout.enable=False"], "skip.rollout.enable is off"),
    (REPLAY + ["trainer.total_training_steps=4"], "steps [4] of 1..4 are not replayed"),
    (REPLAY + ["skip.rollout.steps=[1,2]"], "steps [3] of 1..3 are not replayed"),
    (REPLAY + ["~actor_rollout_ref.rollout.checkpoint_manager_class"], "checkpoint_manager_class=trajstore"),
])
def test_servers_start_unless_every_step_replays(tmp_path, monkeypatch, extra, why):
    run(monkeypatch, config(tmp_path), generate=True)
    assert why in switch.servers_needed(config(tmp_path, extra=extra))
    events = []
    trainer(monkeypatch, config(tmp_path, extra=extra), events, servers=True)
    assert events == ["servers", "sleep"]


def test_the_documented_keys_are_the_tested_ones_and_compose(tmp_path):
    """The example's keys and the page's command are the ones tested, and compose with verl's yaml."""
    root = Path(__file__).resolve().parent.parent
    script = (root / "examples" / "verl_rollout_skip.sh").read_text()
    page = (root / "docs" / "frameworks" / "verl.md").read_text()
    keys = [k.strip().strip("'") for k in script.split("SWITCH=(")[1].split(")\n")[0].split("\n") if k.strip()]
    command = page.split("main_ppo ... \\\n")[1].split("```")[0]
    names = {k.split("=")[0] for k in SWITCH} | {"skip.rollout.steps", "skip.rollout.dump_dir"}
    assert names <= {k.split("=")[0] for k in keys} and all(n in command for n in names)
    assert {k for k in SWITCH if "class=" in k} <= set(keys)
    assert " ".join(REPLAY) in script and all(k in page for k in REPLAY)
    own = [k for k in keys if not k.startswith(("skip.rollout.steps", "skip.rollout.dump", "trainer.total"))]
    cfg = config(tmp_path, extra=REPLAY, switch_keys=own)
    assert "steps [1, 2, 3] of 1..3 are not replayed" in switch.servers_needed(cfg)  # all else is set right


def test_the_step_count_verl_derives_from_the_data_loader_is_used(tmp_path, monkeypatch):
    run(monkeypatch, config(tmp_path), generate=True)
    derived = ["trainer.total_training_steps=null", "actor_rollout_ref.actor.optim.total_training_steps=3"]
    assert switch.servers_needed(config(tmp_path, extra=REPLAY + derived)) == ""
    derived[1] = "actor_rollout_ref.actor.optim.total_training_steps=4"  # what RayPPOTrainer writes there
    assert "steps [4]" in switch.servers_needed(config(tmp_path, extra=REPLAY + derived))
