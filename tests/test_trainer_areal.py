"""The AReaL switch (``trajstore.trainers.areal``) with AReaL 1.0.4's own code (tests/frameworks.txt): the
``debug.*`` keys parsed as AReaL's ``load_expr_config`` parses them; each step's batch asked the way
``FSDPEngine.prepare_batch`` asks it, through AReaL's real ``DistRolloutCoordinator`` (a world of one
gloo process) of the trainer's rollout engine, whose ``prepare_batch`` runs AReaL's real
``GroupedRolloutWorkflow`` over ``RLVRWorkflow`` (tests/test_real_areal.py's fake model server). Dumped for
3 steps, then replayed by a trainer whose ``_init_rollout`` never builds an engine: the same batches."""

import asyncio
import logging
import socket
from types import SimpleNamespace

import pytest
import torch.distributed as dist

import trajstore
from trajstore.errors import ConfigError
from trajstore.testing import assert_batch_equal

ra = pytest.importorskip("test_real_areal")  # AReaL's workflows over a fake model server
from areal.api.cli_args import parse_cli_args, to_structured_cfg  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from areal.infra.dist_rollout import DistRolloutCoordinator  # noqa: E402

from trajstore.trainers import areal as switch  # noqa: E402


@pytest.fixture(scope="module")
def world():
    """A process group of one (gloo on 127.0.0.1), as a single-GPU AReaL trainer has."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


class Engine:
    """The inference engine's ``prepare_batch`` (``RemoteInfEngine``): AReaL's real workflows, a group of
    ``group_size`` episodes per prompt the dataloader gives."""

    built = 0

    def __init__(self, config):
        type(self).built += 1
        self.version = 0

    def set_version(self, v):
        self.version = v

    def get_version(self):
        return self.version

    def prepare_batch(self, dataloader, workflow, workflow_kwargs=None, should_accept_fn=None, group_size=1,
                      dynamic_bs=False):
        seed = next(dataloader)
        wf = ra.GroupedRolloutWorkflow(ra._workflow(workflow), group_size=group_size, logger=logging.getLogger("t"))
        return [asyncio.run(wf.arun_episode(ra.Engine([8, 20, 5, 13], seed), ra._data(workflow, seed + i)))
                for i in range(2)]


class Actor:
    """The train engine's side (``FSDPEngine``): ``connect_engine`` makes AReaL's real
    ``DistRolloutCoordinator`` of the rollout engine, ``prepare_batch`` asks it, ``update_weights`` would
    send the weights to the inference servers."""

    def __init__(self, world):
        self.world, self.weight_updates = world, 0

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


class AReaLTrainer:
    """Stands in for ``areal.trainer.PPOTrainer`` (whose module needs swanlab, wandb, tensorboardX), as
    its ``__init__`` and ``train`` use the methods the switch overrides or wraps: ``_create_train_engine``,
    ``_init_rollout``, ``actor.connect_engine``, ``actor.prepare_batch``, ``actor.update_weights`` and the
    rollout's ``set_version``."""

    def __init__(self, config, world):
        self.config, self.recover_info, self.world = config, None, world
        self.actor = self._create_train_engine(config.actor)
        self.rollout = self._init_rollout(config.rollout)
        self.actor.connect_engine(self.rollout, None)

    def _create_train_engine(self, actor_config):
        return Actor(self.world)

    def _init_rollout(self, rollout_config, is_eval=False, lora_path=None):
        return Engine(rollout_config)

    def train(self, workflow):
        batches = []
        loader = iter(range(100))
        for _ in range(3):
            batches.append(self.actor.prepare_batch(loader, workflow=workflow, group_size=2))
            self.actor.update_weights(None)
            self.rollout.set_version(self.rollout.get_version() + 1)
        return batches


class Trainer(switch.Switch, AReaLTrainer):
    pass


_RUN = "  experiment_name: e\n  trial_name: t\n"
HEAD = ("experiment_name: e\ntrial_name: t\ntrain_dataset:\n  path: data/train.jsonl\n  type: rl\n"
        "rollout:\n  backend: sglang:d1\nactor:\n  backend: fsdp:d1\n" + _RUN
        + "".join(f"{k}:\n{_RUN}  fileroot: /tmp/areal\n" for k in ("saver", "evaluator", "stats_logger", "recover")))
YAML = HEAD + """debug:
  dump_rollout_data: false
  replay_rollout_data: false
  path: null
"""


def config(tmp_path, *keys, yaml=YAML):
    (tmp_path / "c.yaml").write_text(yaml)
    # load_expr_config's parse (it then saves the config through StatsLogger, which needs swanlab and wandb)
    cfg, _ = parse_cli_args(["--config", str(tmp_path / "c.yaml"), *keys])
    return OmegaConf.to_object(to_structured_cfg(cfg, switch.PPOConfig))


@pytest.mark.parametrize("kind", ["multi_turn"])
def test_dump_then_replay_without_an_inference_engine(tmp_path, world, kind):
    d = str(tmp_path / "d")
    Engine.built = 0
    t = Trainer(config(tmp_path, "debug.dump_rollout_data=true", f"debug.path={d}"), world)
    dumped = t.train(kind)
    assert Engine.built == 1 and t.actor.weight_updates == 3 and trajstore.Reader(d).steps == [0, 1, 2]

    t = Trainer(config(tmp_path, "debug.replay_rollout_data=true", f"debug.path={d}"), world)
    assert Engine.built == 1 and type(t.rollout) is switch.NoEngine  # replay built no engine
    assert not hasattr(t.actor, "coordinator")  # nor connected the actor to one
    replayed = t.train(kind)
    assert t.actor.weight_updates == 0  # nor sent it weights
    for a, b in zip(dumped, replayed, strict=True):
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
