"""The SkyRL switch (``trajstore.trainers.skyrl``) on skyrl-train 0.3.1's own trainer code
(tests/frameworks-py312.txt): ``RayPPOTrainer.__init__`` and ``train`` (``prepare_generator_input``,
``generate`` with ``validate_generator_output``, ``postprocess_generator_output``,
``convert_to_training_input``, ``fwd_logprobs_values_reward`` with ``concatenate_outputs_after_mesh_dispatch``,
``compute_advantages_and_returns``, ``train_critic_and_policy``). Stubbed: the generator (its
``generate`` answers tests/test_real_skyrl.py's scripted outputs, multi-turn loss masks with holes), the
policy model's Ray actor group, ``ray.get`` on its answers, the tokenizer, the tracker and the dataloader
(through the trainer's own hook). Dumped for 3 steps, then replayed by a fresh trainer whose generator
raises: the generator outputs and the batches trained on are the dump run's."""

import asyncio
import copy
import random
import sys
import types

import pytest
import torch

import trajstore
from trajstore.errors import ConfigError

rs = pytest.importorskip("test_real_skyrl")  # SkyRL's modules (ray compat), its batches' helpers
from omegaconf import OmegaConf  # noqa: E402
from skyrl_train import trainer as skyrl_trainer  # noqa: E402
from skyrl_train.generators.utils import concatenate_generator_outputs  # noqa: E402
from skyrl_train.training_batch import TrainingOutputBatch  # noqa: E402

from trajstore.trainers import skyrl as switch  # noqa: E402

N = 2  # samples per prompt


class LocalRay:
    @staticmethod
    def get(x):
        return x


class Generator:
    """SkyRL's generator: ``n`` samples per prompt, drawn from the prompt's text."""

    def __init__(self):
        self.outputs = []

    async def generate(self, input_batch):
        prompts = input_batch["prompts"][::N]
        out = concatenate_generator_outputs([rs.generator_output(random.Random(str(p)), i, N, False)
                                             for i, p in enumerate(prompts)])
        out["rollout_metrics"] = {"generate/avg_num_tokens": float(sum(map(len, out["response_ids"])))}
        self.outputs.append(copy.deepcopy(out))
        return out


class Models:
    """The policy model's Ray actor group (one data-parallel rank): ``forward`` gives log-probs of the
    response tokens, ``ppo_train`` keeps the batch it is given."""

    def __init__(self):
        self.actor_infos = [rs.ns(rank=rs.ns(dp_size=1, dp=0, is_collection_dp_rank=lambda: True))]
        self.trained, self.calls = [], []

    def async_run_ray_method(self, kind, method, *args, data=None, **_):
        self.calls.append(method)
        if method == "forward":
            R = data.metadata["response_length"]
            return [TrainingOutputBatch({"output": -(data["sequences"][:, -R:] % 7).float() / 10})]
        if method == "ppo_train":
            self.trained.append(args[0])
            return [rs.ns(metadata={"train_status": {"loss": 0.5}})]
        return [] if method == "empty_cache" else [None]


def cfg(**trajstore_section):
    c = {"trainer": {"placement": {"colocate_all": False, "colocate_policy_ref": False}, "resume_mode": "none",
                     "eval_interval": -1, "eval_before_train": False, "epochs": 1, "dump_data_batch": False,
                     "ckpt_interval": 0, "hf_save_interval": 0, "update_ref_every_epoch": False,
                     "algorithm": {"use_kl_in_reward": False, "dynamic_sampling": {"type": None},
                                   "advantage_estimator": "grpo", "use_tis": False, "zero_variance_filter": False,
                                   "gamma": 1.0, "lambd": 1.0, "grpo_norm_by_std": True,
                                   "advantage_batch_normalize": False}},
         "generator": {"n_samples_per_prompt": N, "backend": "vllm", "step_wise_trajectories": False,
                       "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                           "max_generate_length": 16, "logprobs": None}},
         "environment": {"env_class": "gsm8k"}}
    if trajstore_section:
        c["trajstore"] = trajstore_section
    return OmegaConf.create(c)


class Trainer(switch.RayPPOTrainer):
    def _build_train_dataloader_and_compute_training_steps(self):  # SkyRL's hook: 3 steps of 2 prompts
        prompts = [{"prompt": [{"role": "user", "content": f"q{i}"}], "env_class": None, "env_extras": {},
                    "uid": f"u{i}"} for i in range(6)]
        self.train_dataloader = [prompts[i:i + 2] for i in range(0, 6, 2)]
        self.total_training_steps = 3

    def build_models(self, *workers):  # the Ray actor groups
        self.policy_model, self.critic_model, self.ref_model = Models(), None, None


@pytest.fixture(autouse=True)
def skyrl(monkeypatch):
    monkeypatch.setattr(skyrl_trainer, "ray", LocalRay)
    monkeypatch.setattr(skyrl_trainer, "configure_ray_worker_logging", lambda: None)  # stdlib logging left alone


def run(c, generator):
    tok = rs.ns(pad_token_id=0, decode=lambda ids: " ".join(map(str, ids)))
    t = Trainer(c, rs.ns(log=lambda *a, **k: None), tok, None, "client", generator)
    t.build_models()
    t.train()
    return t


def test_dump_then_replay_without_generation(tmp_path):
    d = str(tmp_path / "d")
    gen = Generator()
    a = run(cfg(dump=True, path=d), gen)
    r = trajstore.Reader(d)
    assert r.steps == [1, 2, 3] and len(a.policy_model.trained) == 3
    assert a.policy_model.calls.count("broadcast_to_inference_engines") == 4
    for step, out in zip(r.steps, gen.outputs, strict=True):  # what the generator returned, as it returned it
        rs.same(out, r[step])

    class NoGeneration:
        async def generate(self, input_batch):
            raise AssertionError("replay called the generator")
    b = run(cfg(replay=True, path=d), NoGeneration())
    assert type(b.inference_engine_client) is switch.NoEngine
    assert "init_weight_sync_state" not in b.policy_model.calls and "broadcast_to_inference_engines" not in b.policy_model.calls
    assert len(b.policy_model.trained) == 3
    for x, y in zip(a.policy_model.trained, b.policy_model.trained, strict=True):  # SkyRL's own batches from them
        rs.same(x, y)
    assert asyncio.run(b.inference_engine_client.wake_up()) is None
    with pytest.raises(AttributeError, match="generate: replay .* builds no inference engine"):
        b.inference_engine_client.generate
    c = cfg(replay=True, path=d)
    c.trainer.eval_interval = 2
    with pytest.raises(ConfigError, match="eval_interval=2 at replay.*eval_interval=-1"):
        run(c, NoGeneration())


def test_config_section_env_and_refusals(tmp_path, monkeypatch):
    for k in ("TRAJSTORE_DUMP", "TRAJSTORE_REPLAY"):
        monkeypatch.delenv(k, raising=False)
    t = run(cfg(), Generator())  # off: SkyRL's trainer
    assert t.trajstore.mode == "off" and len(t.policy_model.trained) == 3 and t.inference_engine_client == "client"
    monkeypatch.setenv("TRAJSTORE_DUMP", "1")
    monkeypatch.setenv("TRAJSTORE_PATH", str(tmp_path / "e"))
    assert switch.config(cfg()).dump and not switch.config(cfg(replay=True, path="x")).dump  # the section first
    c = cfg(dump=True, path=str(tmp_path / "f"))
    c.trainer.algorithm.dynamic_sampling.type = "filter"
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        Trainer(c, None, None, None, None, None)
    with pytest.raises(ConfigError, match="path"):
        Trainer(cfg(replay=True), None, None, None, None, None)


def test_experiment_replay_builds_no_inference_engine(tmp_path, monkeypatch):
    """``Exp`` on SkyRL's ``BasePPOExp._setup_trainer``: replay creates no engine, the generator and the
    trainer get a ``NoEngine``, the trainer is the switched one."""
    workers = types.ModuleType("fsdp_worker")  # the Ray actor classes _setup_trainer imports for fsdp2 (need GPUs)
    workers.PolicyWorker = workers.CriticWorker = workers.RefWorker = None
    monkeypatch.setitem(sys.modules, "skyrl_train.workers.fsdp.fsdp_worker", workers)
    made, seen = [], {}
    monkeypatch.setattr(switch.main_base, "create_remote_inference_engines_from_config", lambda *a: made.append(a))
    monkeypatch.setattr(switch, "RayPPOTrainer", Trainer)  # the test's dataloader hook

    class Exp(switch.Exp, switch.main_base.BasePPOExp):
        def __init__(self, c):  # BasePPOExp's: tokenizer, datasets and placement group
            self.cfg, self.tokenizer, self.train_dataset, self.eval_dataset, self.colocate_pg = c, None, None, None, None

        def get_tracker(self):
            return None

        def get_generator(self, cfg, tokenizer, client):
            seen["client"] = client
            return Generator()

    with trajstore.Writer(tmp_path / "d") as w:
        w.append(1, asyncio.run(Generator().generate({"prompts": ["q"] * N})))
    c = cfg(replay=True, path=str(tmp_path / "d"))
    c.trainer.update({"strategy": "fsdp2", "export_path": str(tmp_path / "x"), "ckpt_path": str(tmp_path / "c")})
    c.generator.run_engines_locally = False
    t = Exp(c)._setup_trainer()
    assert made == [] and type(seen["client"]) is switch.NoEngine and type(t) is Trainer
    assert type(t.inference_engine_client) is switch.NoEngine and t.policy_model is not None
    assert switch.main_base.InferenceEngineClient.__name__ == "InferenceEngineClient"  # put back
