"""The AReaL switch (``trajstore.trainers.areal``) with AReaL 1.0.4's own code (tests/frameworks.txt): the
``debug.*`` keys parsed as AReaL's ``load_expr_config`` parses them, then AReaL's real
``areal.trainer.PPOTrainer`` with ``Switch`` first in its bases: its ``__init__`` and ``train`` loop in
SPMD mode (a world of one gloo process). Only what needs a GPU, a server or the hub is replaced: the train
engine (``Actor``, whose ``prepare_batch`` asks AReaL's real ``DistRolloutCoordinator``), the inference
engine (``Engine``, whose ``prepare_batch`` runs AReaL's real ``GroupedRolloutWorkflow`` over the workflow
against tests/test_real_areal.py's fake model server) and the tokenizer. Dumped for 3 steps, then replayed
by a trainer that builds no engine: its PPO updates get the same batches. The logging back ends the
trainer's module imports are import stubs (tests/_stubs.py): its StatsLogger's calls to its disabled
wandb and swanlab (``init``, ``log``, ``finish``) do nothing."""

import asyncio
import logging
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import trajstore
import trajstore.record.recorder  # its loggers made under logging's own root, before AReaL's modules are imported
from trajstore.errors import ConfigError
from trajstore.testing import assert_batch_equal

# AReaL's getLogger (areal/utils/logging.py) puts a new root and manager in logging.Logger each time it is
# called, so loggers made afterwards (by any module) hang under a root pytest's log capture never sees:
# kept here and put back after AReaL's imports and after each test of this module
LOGGING_STATE = (logging.Logger.root, logging.Logger.manager)

ra = pytest.importorskip("test_real_areal")  # AReaL's workflows over a fake model server
from areal.api.cli_args import parse_cli_args, to_structured_cfg  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from areal.infra.dist_rollout import DistRolloutCoordinator  # noqa: E402

from trajstore.trainers import areal as switch  # noqa: E402
from _stubs import import_with_stubs  # noqa: E402

# imported by AReaL's trainer (its StatsLogger, its SGLang client); the StatsLogger calls wandb's and swanlab's
# init (mode "disabled", its default), log and finish, which the stubs take and drop as disabled back ends do
LOGGING = ("swanlab", "trackio", "wandb", "tensorboardX", "pybase64")


@pytest.fixture(scope="module")
def world():
    """A process group of one (gloo on 127.0.0.1), as a single-GPU AReaL trainer has."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


(rl_trainer,) = import_with_stubs(LOGGING, "areal.trainer.rl_trainer")
logging.Logger.root, logging.Logger.manager = LOGGING_STATE


@pytest.fixture(autouse=True)
def logging_kept():
    yield
    logging.Logger.root, logging.Logger.manager = LOGGING_STATE


class Engine:
    """The inference engine's ``prepare_batch`` (``RemoteInfEngine``): AReaL's real workflows, a group of
    ``group_size`` episodes per prompt of the trainer's real dataloader."""

    built, kind = 0, "rlvr"  # kind: the data's (test_real_areal._data)

    def __init__(self, config):
        type(self).built += 1
        self.version, self.prompts = 0, None

    def set_version(self, v):
        self.version = v

    def get_version(self):
        return self.version

    def export_stats(self):
        return {}

    def __getattr__(self, name):  # the trainer's pause / resume / destroy ...
        return lambda *a, **k: None

    def prepare_batch(self, dataloader, workflow, workflow_kwargs=None, should_accept_fn=None, group_size=1,
                      dynamic_bs=False):
        if self.prompts is None:
            self.prompts = iter(p for batch in iter_forever(dataloader) for p in batch)
        seed = next(self.prompts)["seed"]
        wf = ra.GroupedRolloutWorkflow(workflow, group_size=group_size, logger=logging.getLogger("t"))
        return [asyncio.run(wf.arun_episode(ra.Engine([8, 20, 5, 13], seed), ra._data(self.kind, seed + i)))
                for i in range(2)]


def iter_forever(loader):
    while True:
        yield from loader


class Actor:
    """The train engine (``FSDPEngine``), whose model needs a GPU: ``connect_engine`` makes AReaL's real
    ``DistRolloutCoordinator`` of the rollout engine, ``prepare_batch`` asks it; ``update_weights`` would
    send the weights to the inference servers; the model's calls (``compute_logp``, ``ppo_update`` ...)
    record the batch they get."""

    data_parallel_rank, data_parallel_world_size = 0, 1

    def __init__(self, world):
        self.world, self.cpu_group, self.weight_updates, self.trained = world, world, 0, []

    def connect_engine(self, engine, meta):
        w = self.world
        me = SimpleNamespace(is_data_parallel_head=lambda: True, current_data_parallel_head=lambda: 0,
                             data_parallel_group=w, cpu_group=w, context_and_model_parallel_group=w, config=None)
        self.coordinator = DistRolloutCoordinator(rollout_engine=engine, train_engine=me)

    def prepare_batch(self, *args, **kwargs):
        return self.coordinator.prepare_batch(*args, **kwargs)

    def rollout_batch(self, *args, **kwargs):
        return self.coordinator.rollout_batch(*args, **kwargs)

    def update_weights(self, meta):
        self.weight_updates += 1

    def compute_logp(self, batch):
        return [torch.zeros(1) for _ in batch]  # the trainer puts it in each trajectory: prox_logp

    def compute_advantages(self, batch):
        return batch

    def ppo_update(self, batch):
        self.trained.append(batch)

    def export_stats(self):
        return {}

    def get_device_stats(self):
        return SimpleNamespace(log=lambda *a: None)

    def __getattr__(self, name):  # initialize, set_version, step_lr_scheduler, destroy ...
        return lambda *a, **k: None


class CPU:
    """AReaL's ``PPOTrainer`` on a CPU: its train engine is ``Actor``, its inference engine ``Engine``
    (the real ones need a GPU and an SGLang / vLLM server) and its tokenizer none (it would be downloaded)."""

    def __init__(self, config, world):
        self.world = world
        super().__init__(config, train_dataset=[{"seed": 10 * i} for i in range(8)])

    def _create_train_engine(self, actor_config, alloc=None):
        return Actor(self.world)

    def _init_rollout(self, rollout_config, is_eval=False, lora_path=None):
        return Engine(rollout_config)


class Trainer(switch.Switch, CPU, rl_trainer.PPOTrainer):
    pass


_RUN = "  experiment_name: e\n  trial_name: t\n"
HEAD = ("experiment_name: e\ntrial_name: t\ntotal_train_steps: 3\ntokenizer_path: none\n"
        "cluster:\n  fileroot: {root}\ntrain_dataset:\n  path: data/train.jsonl\n  type: rl\n  batch_size: 2\n"
        "gconfig:\n  n_samples: 2\nrollout:\n  backend: sglang:d1\n"
        "actor:\n  backend: fsdp:d1\n  recompute_logprob: true\n" + _RUN
        + "".join(f"{k}:\n{_RUN}  fileroot: {{root}}\n" for k in ("saver", "evaluator", "stats_logger", "recover")))
YAML = HEAD + """debug:
  dump_rollout_data: false
  replay_rollout_data: false
  path: null
"""


@pytest.fixture(autouse=True)
def spmd(monkeypatch):
    """SPMD mode (one trainer process per rank, as AReaL's launcher sets it); the trainer's tokenizer
    would come from the Hugging Face hub, and the fake model server needs none."""
    monkeypatch.setenv("AREAL_SPMD_MODE", "1")
    monkeypatch.setattr(rl_trainer, "load_hf_processor_and_tokenizer", lambda path: (None, None))


def config(tmp_path, *keys, yaml=YAML):
    (tmp_path / "c.yaml").write_text(yaml.replace("{root}", str(tmp_path / "areal")))
    # load_expr_config's parse (it then saves the config through StatsLogger, which needs swanlab and wandb)
    cfg, _ = parse_cli_args(["--config", str(tmp_path / "c.yaml"), *keys])
    return OmegaConf.to_object(to_structured_cfg(cfg, switch.PPOConfig))


@pytest.mark.parametrize("kind", ["multi_turn"])
def test_dump_then_replay_without_an_inference_engine(tmp_path, world, kind):
    """AReaL's own ``PPOTrainer.__init__`` and ``train`` loop, 3 steps dumped then replayed."""
    d = str(tmp_path / "d")
    Engine.built, Engine.kind = 0, kind
    t = Trainer(config(tmp_path, "debug.dump_rollout_data=true", f"debug.path={d}"), world)
    t.train(ra._workflow(kind))
    dumped = t.actor.trained
    assert Engine.built == 2 and t.actor.weight_updates == 3 and trajstore.Reader(d).steps == [0, 1, 2]
    assert len(dumped) == 3 and len(dumped[0]) == 2  # the trainer's updates got each step's batch
    stored = trajstore.Reader(d)[0]  # what the rollout returned, not what the trainer then added to it
    assert "prox_logp" in dumped[0][0] and not any("prox_logp" in traj for traj in stored)

    t = Trainer(config(tmp_path, "debug.replay_rollout_data=true", f"debug.path={d}"), world)
    assert Engine.built == 2 and type(t.rollout) is type(t.eval_rollout) is switch.NoEngine  # no engine built
    assert "coordinator" not in vars(t.actor)  # nor the actor connected to one
    t.train(ra._workflow(kind))
    assert t.actor.weight_updates == 0  # nor sent it weights
    for a, b in zip(dumped, t.actor.trained, strict=True):
        assert_batch_equal(b, a)
    assert t.rollout.get_version() == 3 and t.rollout.update_weights_from_disk(None).result() is None
    with pytest.raises(AttributeError, match="rollout_batch: replay .* builds no inference engine"):
        t.rollout.rollout_batch  # an evaluation, say


def test_config_keys(tmp_path, world):
    cfg = config(tmp_path, yaml=HEAD)  # no debug section: off
    assert cfg.debug == switch.DebugConfig() and not Trainer(cfg, world).trajstore.dumping
    with pytest.raises(ConfigError, match="mutually exclusive"):
        Trainer(config(tmp_path, "debug.dump_rollout_data=true", "debug.replay_rollout_data=true"), world)
    with pytest.raises(ConfigError, match="path"):
        Trainer(config(tmp_path, "debug.replay_rollout_data=true"), world)
