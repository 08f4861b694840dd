"""The OpenRLHF switch (``trajstore.trainers.openrlhf``) on OpenRLHF 0.11.2's own trainer code
(tests/frameworks.txt): ``PPOTrainer.__init__``, ``fit`` and ``train_step``, its real ``SamplesGenerator``
(``generate_samples``, ``_generate_vllm``, ``_process_response_into_experience``) and
``RemoteExperienceMaker.make_experience_batch``. Stubbed: the vLLM engines (a dispatch that answers
scripted rollouts), the actor / critic / reference Ray actor groups (tests/test_real_openrlhf.py's
``Group``), ``ray.get`` / ``ray.wait`` on their answers, the tokenizer and dataset loading. Dumped for 3
steps, then replayed by a fresh trainer with generation and the model forwards made to raise: the
experiences handed to the actor and critic are the dump run's, and OpenRLHF's replay buffer accepts them."""

import random

import pytest

import trajstore

ro = pytest.importorskip("test_real_openrlhf")  # OpenRLHF's modules behind import stubs, its batches' helpers
ppo_trainer, switch, sg = ro.stubbed_import("openrlhf.trainer.ppo_trainer", "trajstore.trainers.openrlhf",
                                            "openrlhf.trainer.ppo_utils.samples_generator")
em, ex = ro.em, ro.ex


class LocalRay(ro._LocalRay):
    @staticmethod
    def wait(refs, num_returns=1, timeout=None):
        return refs[:num_returns], refs[num_returns:]


class TrainGroup(ro.Group):
    """A model's Ray actor group as the trainer drives it: ``forward`` (``Group``), ``append`` of the
    step's experiences and ``fit``."""

    def __init__(self, fn):
        super().__init__(fn)
        self.appended, self.fits, self.broadcasts = [], 0, 0

    def async_run_method_batch(self, method_name, **kw):
        if method_name == "append":
            self.appended.append(kw["experience"])
            return []
        return super().async_run_method_batch(method_name, **kw)

    def async_run_method(self, method_name, **kw):
        if method_name == "broadcast_to_vllm":  # the actor sends its weights to the vLLM engines
            self.broadcasts += 1
            return []
        assert method_name == "fit"
        self.fits += 1
        return [{"policy_loss": 0.5}]


class Loader(list):
    """The prompts dataloader: ``(_, prompts, labels, images)`` batches of 2 prompts."""

    def state_dict(self):
        return {}


def dispatch(self, prompts, labels, images=None, **kw):
    """The vLLM engines: one ref per prompt, ``n_samples_per_prompt`` responses each."""
    n = self.args.rollout.n_samples_per_prompt
    refs = []
    for p in prompts:
        rng = random.Random(p)
        refs.append([{**ro.response(rng, i, multi_turn=i % 2 == 1), "prompt": p} for i in range(n)])
    return refs


def args(tmp_path):
    a = ro.args("gae")
    extra = {"eval": {"steps": -1, "temperature": 1.0, "n_samples_per_prompt": 1},
             "ckpt": {"save_steps": -1, "best_metric_key": "", "path": str(tmp_path / "ckpt"), "load_enable": False},
             "logger": {"wandb": {"key": None}, "tensorboard_dir": None, "logging_steps": 1},
             "critic": {"freezing_steps": -1}, "vllm": {"enable_sleep": False}}
    for k, v in extra.items():
        setattr(a, k, ro.ns(**v))
    a.algo.kl.target, a.algo.kl.init_coef, a.algo.dynamic_filtering_enable = None, 0.01, False
    a.data.disable_fast_tokenizer, a.train.num_episodes, a.ds.enable_sleep = False, 1, False
    a.rollout.batch_size, a.rollout.vllm_generate_batch_size = 4, None
    return a


@pytest.fixture
def openrlhf(monkeypatch):
    loader = Loader((None, [f"q{i}", f"q{i + 1}"], ["a", "b"], [None, None]) for i in range(0, 12, 2))
    tok = ro.ns(pad_token_id=0, decode=lambda seqs, skip_special_tokens=True: [" ".join(map(str, s.tolist())) for s in seqs])
    monkeypatch.setattr(ppo_trainer, "get_tokenizer", lambda *a, **k: tok)
    monkeypatch.setattr(ppo_trainer, "prepare_datasets", lambda strategy, tokenizer: (loader, None, 3))
    for m in (ppo_trainer, em, sg):
        monkeypatch.setattr(m, "ray", LocalRay)
    monkeypatch.setattr(sg.SamplesGenerator, "_dispatch_prompts_to_vllm", dispatch)


def trainer(tmp_path, mode):
    actor, critic, ref = TrainGroup(ro._logp(31)), TrainGroup(lambda s, a, m: (s[:, 1:] % 5).float() / 5 * a), \
        TrainGroup(ro._logp(17))
    cfg = {} if mode is None else {"trajstore": {mode: True, "path": str(tmp_path / "dump")}}
    t = switch.RecordedPPOTrainer("model", ro.ns(args=args(tmp_path)), actor, critic, None, ref, ["engine"],
                                  max_len=64, **cfg)
    assert t.trajstore.mode == (mode or "off")
    t.fit()
    return t


def test_dump_then_replay_without_generation(tmp_path, openrlhf, monkeypatch):
    a = trainer(tmp_path, "dump")
    dumped = a.actor_model_group.appended
    assert len(dumped) == 3 and a.critic_model_group.appended == dumped and a.actor_model_group.fits == 3
    assert a.actor_model_group.broadcasts == 3
    r = trajstore.Reader(tmp_path / "dump")
    assert r.steps == [0, 1, 2]
    assert r.meta(0)[switch.META_KEY] == {"filter_pass_rate": None, "prompts_consumed": 4, "exhausted": False}
    for step, exps in zip(r.steps, dumped, strict=True):
        assert len(exps) == 4 and all(type(e) is ro.Experience for e in exps)
        ro.same(exps, r[step])

    def no_generation(*_, **__):
        raise AssertionError("replay called generation or a model forward")
    for cls, name in ((sg.SamplesGenerator, "generate_samples"), (sg.SamplesGenerator, "_generate_vllm"),
                      (sg.SamplesGenerator, "_dispatch_prompts_to_vllm"), (em.RemoteExperienceMaker, "make_experience")):
        monkeypatch.setattr(cls, name, no_generation)
    b = trainer(tmp_path, "replay")
    assert b.actor_model_group.fits == 3 and b.actor_model_group.broadcasts == 0  # trained 3 steps, no vLLM
    replayed = b.actor_model_group.appended
    ro.same(dumped, replayed)
    assert b.critic_model_group.appended == replayed
    for x, y in zip(dumped, replayed, strict=True):  # OpenRLHF's replay buffer takes them as it took the dump's
        ro.same(ro.buffer_batches(x), ro.buffer_batches(y))
    b.fit(global_step=2)  # resumed at step 2 (as from a checkpoint): only the dump's steps from there
    assert b.actor_model_group.fits == 4 and b.actor_model_group.broadcasts == 0
    ro.same(b.actor_model_group.appended[-1], r[2])
    b.eval_dataloader, b.args.eval.steps = ["prompts"], 2  # an evaluation every 2 steps: refused at the start
    with pytest.raises(ValueError, match="evaluation at replay .* --eval.steps -1"):
        b.fit()
    assert b.actor_model_group.fits == 4


def test_off_is_openrlhf_unchanged_and_the_ray_actor_class(tmp_path, openrlhf, monkeypatch):
    for k in ("TRAJSTORE_DUMP", "TRAJSTORE_REPLAY"):
        monkeypatch.delenv(k, raising=False)
    t = trainer(tmp_path, None)
    assert type(t.samples_generator) is sg.SamplesGenerator
    assert t.actor_model_group.fits == t.actor_model_group.broadcasts == 3 and not (tmp_path / "dump").exists()
    assert switch.PPOTrainer.__ray_metadata__.modified_class.__ray_actor_class__ is switch.RecordedPPOTrainer
