"""OpenRLHF 0.11.2's real ``Experience`` batches (tests/frameworks.txt), built along its own code:
rollout samples made by the REAL ``SamplesGenerator._process_response_into_experience`` from vLLM-shaped
responses (single- and multi-turn: several action ranges, so the action mask has holes), then
``RemoteExperienceMaker.make_experience_batch`` (``split_rollout_samples`` with
``Experience.concat_experiences``, ``make_experience`` with fake model groups standing in for the
actor / critic / reference Ray actors, ``compute_advantages_and_returns``). Each form (one
``Experience``, a list of them, the rollout samples) round-trips as ``Experience`` field by field,
replays in another process, and the replay buffer's own functions (``split_experience_batch``,
``remove_padding_in_sequences``, ``make_experience_batch``, ``balance_experiences``) accept the
replayed batches. vllm, deepspeed and flash_attn are needed only to import OpenRLHF's modules:
where they are not installed, import stubs stand in for them (never called)."""

import random
import types
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trajstore
from _dumps import run_python
from _stubs import import_with_stubs
from trajstore.errors import BatchError

ROOT = Path(__file__).resolve().parents[1]
STUBBED = ("vllm", "deepspeed", "flash_attn")  # imported by OpenRLHF's modules, never called here


def stubbed_import(*modules):
    """``modules`` imported with stubs for those of ``STUBBED`` that are not installed; the stubs are
    taken out of ``sys.modules`` afterwards (the imported modules keep their references)."""
    pytest.importorskip("openrlhf")
    return import_with_stubs(STUBBED, *modules)


def import_openrlhf():
    """OpenRLHF's experience modules (``stubbed_import``)."""
    ex, em, kl, sg = stubbed_import(*(f"openrlhf.trainer.ppo_utils.{m}" for m in
                                      ("experience", "experience_maker", "kl_controller", "samples_generator")))
    return ex, em, kl, sg.SamplesGenerator


ex, em, kl, SamplesGenerator = import_openrlhf()
Experience = ex.Experience


def ns(**kw):
    return types.SimpleNamespace(**{k: ns(**v) if isinstance(v, dict) else v for k, v in kw.items()})


def args(estimator="gae", n=2, micro=2):
    return ns(ds={"ring_attn_size": 1, "tensor_parallel_size": 1},
              train={"colocate_all": False, "colocate_actor_ref": False, "colocate_critic_reward": False,
                     "dynamic_batch_enable": False},
              rollout={"micro_batch_size": micro, "n_samples_per_prompt": n, "max_new_tokens": 64},
              algo={"kl": {"use_loss": False, "estimator": "k1"},
                    "advantage": {"estimator": estimator, "gamma": 1.0, "lambd": 0.95, "no_std_norm": False}},
              reward={"clip_range": (-10.0, 10.0)}, data={"max_len": 64},
              actor={"num_nodes": 1, "num_gpus_per_node": 2})


class Group:
    """A model's Ray actor group: ``forward`` on each micro batch, as the remote workers answer it."""

    def __init__(self, fn):
        self.fn = fn

    def async_run_method_batch(self, method_name, sequences, action_mask, attention_mask, **_):
        assert method_name == "forward"
        return [[self.fn(s, a, m)] for s, a, m in zip(sequences, action_mask, attention_mask)]

    def async_run_method(self, method_name):
        return None


def _logp(c):
    return lambda s, a, m: -((s[:, 1:] * c % 97).float() / 50 + 0.01) * a


class _LocalRay:
    @staticmethod
    def put(x):
        return x

    @staticmethod
    def get(x):
        return x


def maker(estimator="gae", critic=True):
    a = args(estimator)
    m = em.RemoteExperienceMaker.__new__(em.RemoteExperienceMaker)
    m.strategy, m.args, m.advantage_estimator = ns(args=a), a, estimator
    m.actor_model_group, m.initial_model_group = Group(_logp(31)), Group(_logp(17))
    m.critic_model_group = Group(lambda s, a, msk: (s[:, 1:] % 5).float() / 5 * a) if critic else None
    m.reward_model_group, m.tokenizer, m.kl_ctl = None, ns(pad_token_id=0), kl.FixedKLController(0.01)
    return m


def response(rng, i, multi_turn):
    """One vLLM rollout as OpenRLHF's agent executor returns it: the observation's tokens and the
    action (response) ranges in them; a multi-turn one has a tool turn between two actions."""
    P, R = rng.randint(2, 6), rng.randint(1, 6)
    toks = [rng.randint(3, 400) for _ in range(P + R)]
    ranges = [(P, P + R)]
    if multi_turn:
        tool, R2 = rng.randint(1, 4), rng.randint(1, 5)
        toks += [rng.randint(3, 400) for _ in range(tool + R2)]
        ranges.append((P + R + tool, P + R + tool + R2))
    return {"observation_tokens": toks, "action_ranges": ranges, "reward": rng.choice([0.0, 1.0]),
            "scores": rng.choice([0.0, 1.0]), "rollout_log_probs": [round(-rng.random(), 4) for _ in toks],
            "prompt": f"prompt {i // 2}", "label": str(i % 3), "truncated": rng.random() < 0.3,
            "extra_logs": {"turns": 1 + multi_turn}}


def rollout(seed=0, n=8, multi_turn=False):
    rng = random.Random(seed)
    return [SamplesGenerator._process_response_into_experience(None, response(rng, i, multi_turn), max_len=64)
            for i in range(n)]


def batches(seed=0, multi_turn=False, estimator="gae", critic=True):
    """(rollout samples, the experience maker's micro batches) of one step."""
    samples = rollout(seed, multi_turn=multi_turn)
    kept = rollout(seed, multi_turn=multi_turn)  # make_experience_batch fills in the samples it is given
    em_ray, em.ray = em.ray, _LocalRay
    try:
        exps = maker(estimator, critic).make_experience_batch(samples)
    finally:
        em.ray = em_ray
    return kept, exps


def same(a, b):
    """Field by field: tensors equal with dtype and shape, other values equal with their types."""
    if isinstance(a, Experience):
        assert type(b) is Experience
        for f in ex.fields(Experience):
            same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(b) is dict and list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    else:
        assert type(a) is type(b) and a == b


def test_batches_come_from_openrlhf_code():
    samples, exps = batches(multi_turn=True)
    assert all(type(s) is Experience and s.sequences.shape[0] == 1 for s in samples)
    e = exps[0]
    B, T = e.sequences.shape
    assert len(exps) == 4 and e.action_mask.shape == (B, T - 1) and e.advantages.shape == (B, T - 1)
    assert e.index == [0, 1] and e.kl is None and "return" in e.info and e.values is not None
    # multi-turn: the tool turn between two actions is a hole in the action mask
    assert any((r[1:] < r[:-1]).any() for r in e.action_mask.long() if r.sum())


@pytest.mark.parametrize("multi_turn", [False, True])
def test_every_form_round_trips_as_experience(tmp_path, multi_turn, int64_tokens):
    samples, exps = batches(seed=1, multi_turn=multi_turn)
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, exps[0])
        w.append(1, exps)
        w.append(2, tuple(exps))
        w.append(3, samples)
    r = trajstore.Reader(tmp_path / "d")
    same(exps[0], r[0])
    same(exps, r[1])
    same(tuple(exps), r[2])
    same(samples, r[3])
    assert r.info(0)["format_version"] == 4


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10**6), multi_turn=st.booleans(), estimator=st.sampled_from(["gae", "group_norm", "rloo"]))
def test_any_rollout_round_trips(tmp_path_factory, seed, multi_turn, estimator):
    _, exps = batches(seed, multi_turn, estimator, critic=estimator == "gae")
    d = tmp_path_factory.mktemp("any")
    with trajstore.Writer(d) as w:
        w.append(0, exps)
    same(exps, trajstore.Reader(d)[0])


def buffer_batches(exps):
    """What OpenRLHF's NaiveReplayBuffer does with the maker's experiences: ``append`` (split, remove
    the padding) then ``collate_fn`` of all items (``make_experience_batch``)."""
    items = []
    for e in exps:
        items += ex.remove_padding_in_sequences(ex.split_experience_batch(e))
    return ex.make_experience_batch(items)


def test_replay_buffer_accepts_the_replayed_batches(tmp_path):
    _, exps = batches(seed=2, multi_turn=True)
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, exps)
    got = trajstore.Reader(tmp_path / "d")[0]
    same(buffer_batches(batches(seed=2, multi_turn=True)[1]), buffer_batches(got))
    balanced = ex.balance_experiences(trajstore.Reader(tmp_path / "d")[0], args())
    same(ex.balance_experiences(batches(seed=2, multi_turn=True)[1], args()), balanced)


REPLAY = r"""
import sys
import torch
import trajstore
expected = torch.load(sys.argv[2], weights_only=True)  # each step: the fields of each Experience


def eq(x, v):
    if isinstance(v, torch.Tensor):
        return isinstance(x, torch.Tensor) and x.dtype == v.dtype and torch.equal(x, v)
    if isinstance(v, dict):
        return type(x) is dict and list(x) == list(v) and all(eq(x[k], v[k]) for k in v)
    if isinstance(v, list):
        return type(x) is list and len(x) == len(v) and all(eq(a, b) for a, b in zip(x, v))
    return type(x) is type(v) and x == v


with trajstore.Recorder(replay=True, path=sys.argv[1]) as rec:
    for step, want in enumerate(expected):
        got = rec.batch(step, lambda: (_ for _ in ()).throw(AssertionError("replay generated")))
        assert type(got) is list and len(got) == len(want)
        for e, fields in zip(got, want):
            assert f"{type(e).__module__}.{type(e).__qualname__}" == "openrlhf.trainer.ppo_utils.experience.Experience"
            assert list(vars(e)) == list(fields)
            for k, v in fields.items():
                assert eq(getattr(e, k), v), k
        from openrlhf.trainer.ppo_utils import experience as ex  # the replay buffer's functions accept it
        items = [i for e in got for i in ex.remove_padding_in_sequences(ex.split_experience_batch(e))]
        assert len(ex.make_experience_batch(items).sequences) == sum(len(e.sequences) for e in got)
print("ok")
"""


def _fields(e):
    return {f.name: getattr(e, f.name) for f in ex.fields(Experience)}


def test_recorder_dump_replays_in_another_process(tmp_path):
    want = []
    with trajstore.Recorder(dump=True, path=str(tmp_path / "d")) as rec:
        for step in (0, 1):
            exps = batches(seed=5 + step, multi_turn=bool(step))[1]
            want.append([_fields(e) for e in exps])  # the replay below changes nothing of them
            assert rec.batch(step, lambda: exps) is exps
        samples = rollout(9)
        rec.batch(2, lambda: samples)
        want.append([_fields(e) for e in samples])
    torch.save(want, tmp_path / "want.pt")
    run_python(REPLAY, tmp_path / "d", tmp_path / "want.pt")


class Tagged(list):
    pass


def test_what_would_be_lost_is_refused_and_the_recorder_skips_it(tmp_path):
    _, exps = batches(seed=3)
    e = exps[0]
    e.note = "kept by nobody"  # an attribute that is not a dataclass field
    with pytest.raises(BatchError, match=r"Experience carrying attribute 'note'"):
        with trajstore.Writer(tmp_path / "w") as w:
            w.append(0, e)
    del e.note
    tagged = Tagged(exps)
    tagged.epoch = 3
    with pytest.raises(BatchError, match=r"Tagged carrying attribute 'epoch'"):
        with trajstore.Writer(tmp_path / "w2") as w:
            w.append(0, tagged)
    with trajstore.Recorder(dump=True, path=str(tmp_path / "r")) as rec:
        assert rec.batch(0, lambda: tagged) is tagged  # training goes on
        rec.batch(1, lambda: exps)
    r = trajstore.Reader(tmp_path / "r")
    assert r.steps == [1] and "Tagged carrying attribute 'epoch'" in r.skipped[0]


def test_action_fields_are_stored_unpadded_after_the_first_token(tmp_path):
    _, exps = batches(seed=6, multi_turn=True)
    e = exps[0]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no BatchWarning: the action width is understood
        with trajstore.Writer(tmp_path / "d") as w:
            w.append(0, e)
    r = trajstore.Reader(tmp_path / "d")
    n = e.attention_mask.sum(-1).tolist()
    got = r.duckdb().sql("select len(sequences), len(action_mask), len(advantages), len(action_log_probs) "
                         "from train order by index").fetchall()
    assert got == [(k, k - 1, k - 1, k - 1) for k in n]
    df = r.to_pandas()
    assert list(df["index"]) == [0, 1] and list(df["index_field"]) == e.index  # the field does not replace it
    packed = r.read(0, layout="packed")
    assert type(packed) is dict and packed["action_log_probs"].shape == (sum(n) - len(n),)
    assert torch.equal(packed["action_log_probs"], e.action_log_probs[e.attention_mask[:, 1:].bool()])


def test_a_list_of_experiences_stores_its_action_fields_unpadded(tmp_path):
    """make_experience_batch's list: each element's [g, T-1] action cells hold the tokens after the
    first of each row (the rule of a single batch); CPU decode and the device path give the same bits."""
    from test_device_pad import device_read

    _, exps = batches(seed=7, multi_turn=True)
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, exps)
    r = trajstore.Reader(tmp_path / "d")
    n = [k for e in exps for k in e.attention_mask.sum(-1).tolist()]
    got = r.duckdb().sql("select len(sequences), len(action_mask), len(advantages), len(action_log_probs) "
                         "from train").fetchall()
    assert got == [(k, k - 1, k - 1, k - 1) for k in n]
    same(exps, r[0])
    dev, plan = device_read(r, 0)
    same(exps, dev)
    assert plan is not None and len(plan.pads) >= 6  # every element's token cells built from their runs


def test_show_places_prompt_actions_and_logprobs(tmp_path):
    _, exps = batches(seed=6, multi_turn=True)
    e = exps[0]
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, e)
    i = next(i for i in range(len(e.index)) if e.action_mask[i].sum() < e.action_mask[i].max() * len(e.action_mask[i]))
    tr = trajstore.traces(trajstore.Reader(tmp_path / "d"), 0, logprobs=True)[i]
    n = int(e.attention_mask[i].sum())
    act = e.action_mask[i, : n - 1].bool()  # column t: token t + 1
    model = [s for s in tr["messages"] if s["role"] == "model"]
    assert [t for s in model for t in s["ids"]] == e.sequences[i, 1:n][act].tolist()
    assert [x for s in model for x in s["logprobs"]] == e.rollout_log_probs[i, : n - 1][act].tolist()
    assert tr["messages"][0]["role"] == "prompt" and tr["multi_turn"]


def test_masks_are_not_ignored_for_list_batches(tmp_path):
    _, exps = batches(seed=6)
    with pytest.raises(BatchError, match="list batch"):
        with trajstore.Writer(tmp_path / "d", masks={"action_mask": ["action_log_probs"]}) as w:
            w.append(0, exps)


def test_view_places_each_action_value_under_its_token(tmp_path):
    from trajstore.view.pages import View

    _, exps = batches(seed=6, multi_turn=True)
    e = exps[0]
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, e)
    for i in range(len(e.index)):
        toks = View(tmp_path / "d").traj(None, 0, i)["tokens"]
        n = int(e.attention_mask[i].sum())
        assert [t["id"] for t in toks] == e.sequences[i, :n].tolist()
        assert [t["mask"] for t in toks] == [0] + e.action_mask[i, : n - 1].long().tolist()
        assert toks[0]["logprob"] == "" and torch.equal(  # shown at float32 precision
            torch.tensor([float(t["logprob"]) for t in toks[1:]]), e.rollout_log_probs[i, : n - 1])
