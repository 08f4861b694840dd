"""SkyRL (skyrl-train 0.3.1)'s real batches (tests/frameworks.txt), built along its trainer's own code:
per-prompt generator outputs joined by the REAL ``concatenate_generator_outputs`` (which validates
them), turned into per-token rewards by ``RayPPOTrainer.postprocess_generator_output`` and into a
``TrainingInputBatch`` (with its ``.metadata``) by ``RayPPOTrainer.convert_to_training_input``
(``convert_prompts_responses_to_batch_tensors``, ``pad_batch``), single-turn and step-wise
(``TrajectoryID`` values, ``is_last_step``), multi-turn loss masks with holes. Each form round-trips
as its own class, field by field and with its metadata, replays in another process, and the
trainer's next function (``compute_advantages_and_returns``) gives the same result on the replayed
batch. skyrl-train declares Python 3.12 only; its modules import on 3.11 (installed with
``--ignore-requires-python``, tests/frameworks-py312.txt). It pins ray 2.51, whose
``ray.util.placement_group`` still re-exported ``PlacementGroupSchedulingStrategy``; with the ray of
tests/frameworks.txt that name is put back before its modules are imported."""

import copy
import importlib
import random
import sys
import types
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trajstore
from _dumps import run_python
from trajstore.errors import BatchError


def _ray_compat() -> None:
    """``ray.util.placement_group.PlacementGroupSchedulingStrategy`` (ray < 2.52) for skyrl's imports."""
    pytest.importorskip("ray")
    pg = importlib.import_module("ray.util.placement_group")
    if not hasattr(pg, "PlacementGroupSchedulingStrategy"):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg.PlacementGroupSchedulingStrategy = PlacementGroupSchedulingStrategy


pytest.importorskip("skyrl_train")
_ray_compat()
from omegaconf import OmegaConf  # noqa: E402
from skyrl_train.dataset.replay_buffer import Experience  # noqa: E402
from skyrl_train.generators.base import TrajectoryID  # noqa: E402
from skyrl_train.generators.utils import concatenate_generator_outputs  # noqa: E402
from skyrl_train.trainer import RayPPOTrainer  # noqa: E402
from skyrl_train.training_batch import TrainingInputBatch, TrainingOutputBatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def ns(**kw):
    return types.SimpleNamespace(**kw)


def trainer(step_wise=False, n=2, dp=2, estimator="grpo"):
    """A ``RayPPOTrainer`` with what its batch functions read (config, tokenizer, the models' dp sizes)."""
    cfg = OmegaConf.create({
        "trainer": {"algorithm": {"use_tis": False, "zero_variance_filter": False, "advantage_estimator": estimator,
                                  "gamma": 1.0, "lambd": 1.0, "grpo_norm_by_std": True}},
        "generator": {"step_wise_trajectories": step_wise, "n_samples_per_prompt": n}})
    t = RayPPOTrainer.__new__(RayPPOTrainer)
    t.cfg, t.tokenizer, t.all_metrics = cfg, ns(pad_token_id=0), {}
    t.policy_model = ns(actor_infos=[ns(rank=ns(dp_size=dp))])
    t.critic_model = t.ref_model = None
    return t


def generator_output(rng, prompt, n, step_wise):
    """One prompt's ``n`` samples as the generator returns them (``GeneratorOutput``); a multi-turn
    sample's loss mask has a hole (the observation between two turns)."""
    out = {"prompt_token_ids": [], "response_ids": [], "rewards": [], "loss_masks": [], "stop_reasons": [],
           "rollout_metrics": None, "rollout_logprobs": []}
    if step_wise:
        out["trajectory_ids"], out["is_last_step"] = [], []
    P = rng.randint(1, 5)
    prompt_ids = [rng.randint(3, 300) for _ in range(P)]
    for rep in range(n):
        for turn in range(rng.randint(1, 2) if step_wise else 1):
            R = rng.randint(1, 6)
            mask = [1] * R
            if R > 3 and rng.random() < 0.6:
                mask[1:3] = [0, 0]  # a tool observation inside the response
            out["prompt_token_ids"].append(list(prompt_ids))
            out["response_ids"].append([rng.randint(3, 300) for _ in range(R)])
            out["rewards"].append(float(rng.choice([0.0, 1.0])))
            out["loss_masks"].append(mask)
            out["stop_reasons"].append(rng.choice(["stop", "length"]))
            out["rollout_logprobs"].append([round(-rng.random(), 4) for _ in range(R)])
            if step_wise:
                out["trajectory_ids"].append(TrajectoryID(instance_id=f"q{prompt}", repetition_id=rep))
                out["is_last_step"].append(False)
        if step_wise:
            out["is_last_step"][-1] = True
    return out


def batches(seed=0, step_wise=False, prompts=3, n=2):
    """(the generator output, the training input batch) of one step, by SkyRL's own functions."""
    rng = random.Random(seed)
    go = concatenate_generator_outputs([generator_output(rng, p, n, step_wise) for p in range(prompts)])
    raw = copy.deepcopy(go)  # postprocess_generator_output changes it in place
    return raw, training_input(go, step_wise, n)


def training_input(go, step_wise, n=2):
    uids = [t.instance_id for t in go["trajectory_ids"]] if step_wise else [f"q{i // n}" for i in range(len(go["response_ids"]))]
    t = trainer(step_wise, n)
    ti = t.convert_to_training_input(t.postprocess_generator_output(go, uids), uids)
    ti["values"] = None  # no critic: fwd_logprobs_values_reward sets None
    return ti


def same(a, b):
    """Field by field, with types; a TensorBatch's metadata too."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(dict.__getitem__(a, k), dict.__getitem__(b, k))
        if isinstance(a, TrainingInputBatch | TrainingOutputBatch):
            same(a.metadata, b.metadata)
            assert a.batch_size == b.batch_size and a.device == b.device
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif hasattr(a, "__dataclass_fields__"):
        for f in a.__dataclass_fields__:
            same(getattr(a, f), getattr(b, f))
    else:
        assert a == b or (a != a and b != b)


def test_batches_come_from_skyrl_code():
    go, ti = batches(step_wise=True)
    assert type(ti) is TrainingInputBatch and ti.metadata["uids"][:2] == ["q0", "q0"]
    assert ti["response_mask"].shape[1] == ti.metadata["response_length"] < ti["sequences"].shape[1]
    assert all(type(t) is TrajectoryID for t in go["trajectory_ids"]) and go["rollout_metrics"]
    assert any(0 in m[: m.index(0) + 1] and 1 in m[m.index(0):] for m in go["loss_masks"] if 0 in m)


@pytest.mark.parametrize("step_wise", [False, True])
def test_every_form_round_trips_as_its_class(tmp_path, step_wise):
    go, ti = batches(seed=1, step_wise=step_wise)
    out = TrainingOutputBatch({"output": torch.randn(len(ti), 3)})
    out.metadata = {"train_status": {"policy_loss": 0.25, "grad_norm": float("nan")}}
    exp = Experience(sequences=ti["sequences"], action_log_probs=ti["rollout_logprobs"], base_action_log_probs=None,
                     values=None, returns=None, advantages=None, attention_mask=ti["attention_mask"],
                     loss_mask=ti["loss_mask"], action_mask=ti["response_mask"], rollout_logprobs=ti["rollout_logprobs"],
                     num_actions=ti.metadata["response_length"], info={"uids": ti.metadata["uids"]},
                     metadata={"global_step": 3})
    with trajstore.Writer(tmp_path / "d") as w:
        for step, b in enumerate((go, ti, out, exp)):
            w.append(step, b)
    r = trajstore.Reader(tmp_path / "d")
    for step, b in enumerate((go, ti, out, exp)):
        same(b, r[step])


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10**6), step_wise=st.booleans(), prompts=st.integers(1, 4), n=st.integers(1, 3))
def test_any_batch_round_trips(tmp_path_factory, seed, step_wise, prompts, n):
    go, ti = batches(seed, step_wise, prompts, n)
    d = tmp_path_factory.mktemp("any")
    with trajstore.Writer(d) as w:
        w.append(0, go)
        w.append(1, ti)
    r = trajstore.Reader(d)
    same(go, r[0])
    same(ti, r[1])


def advantages(ti, step_wise):
    out = trainer(step_wise).compute_advantages_and_returns(ti)
    return out["advantages"], out["returns"], out.metadata["metrics"]


@pytest.mark.parametrize("step_wise", [False, True])
def test_trainer_accepts_the_replayed_batch(tmp_path, step_wise):
    go, ti = batches(seed=2, step_wise=step_wise)
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, go)
        w.append(1, ti)
    r = trajstore.Reader(tmp_path / "d")
    same(advantages(batches(seed=2, step_wise=step_wise)[1], step_wise), advantages(r[1], step_wise))
    same(ti, training_input(r[0], step_wise))  # the replayed generator output goes through the trainer


REPLAY = r"""
import sys
sys.path.insert(0, sys.argv[2])
import logging
logging.disable(logging.INFO)
import trajstore
from loguru import logger
logger.remove()
import test_real_skyrl as t
with trajstore.Recorder(replay=True, path=sys.argv[1]) as rec:
    for step, step_wise in enumerate((False, True)):
        go, ti = t.batches(seed=7, step_wise=step_wise)
        t.same(go, rec.batch(2 * step, lambda: (_ for _ in ()).throw(AssertionError("replay generated"))))
        got = rec.batch(2 * step + 1, lambda: None)
        t.same(ti, got)
        t.same(t.advantages(ti, step_wise), t.advantages(got, step_wise))
print("ok")
"""


def test_recorder_dump_replays_in_another_process(tmp_path):
    with trajstore.Recorder(dump=True, path=str(tmp_path / "d")) as rec:
        for step, step_wise in enumerate((False, True)):
            go, ti = batches(seed=7, step_wise=step_wise)
            assert rec.batch(2 * step, lambda: go) is go
            assert rec.batch(2 * step + 1, lambda: ti) is ti
    run_python(REPLAY, tmp_path / "d", ROOT / "tests")


class Batch(dict):
    pass


def test_attributes_that_would_be_lost_are_refused(tmp_path):
    _, ti = batches(seed=4)
    b = Batch(dict(ti))
    b.metadata = dict(ti.metadata)
    with pytest.raises(BatchError, match=r"Batch carrying attribute 'metadata'"):
        with trajstore.Writer(tmp_path / "w") as w:
            w.append(0, b)
    with pytest.raises(BatchError, match=r"field 'train' is a skyrl_train.training_batch.TrainingInputBatch carrying "
                                         r"attribute.*'metadata'"):  # restored only as the batch itself
        with trajstore.Writer(tmp_path / "w1") as w:
            w.append(0, {"train": ti, "uids": ti.metadata["uids"]})
    ti.extra = 1  # TrainingInputBatch keeps only metadata
    with pytest.raises(BatchError, match=r"TrainingInputBatch carrying attribute 'extra'"):
        with trajstore.Writer(tmp_path / "w2") as w:
            w.append(0, ti)
    with trajstore.Recorder(dump=True, path=str(tmp_path / "r")) as rec:
        assert rec.batch(0, lambda: b) is b  # recorded as skipped, training goes on
    assert "Batch carrying attribute 'metadata'" in trajstore.Reader(tmp_path / "r").skipped[0]


def test_response_fields_and_token_lists_are_stored_per_token(tmp_path):
    import warnings

    go, ti = batches(seed=8, step_wise=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no BatchWarning: the [B, R] width is understood
        with trajstore.Writer(tmp_path / "d") as w:
            w.append(0, ti)
        with trajstore.Writer(tmp_path / "d", split="generated") as w:  # its own column types
            w.append(1, go)
    con = trajstore.Reader(tmp_path / "d").duckdb()
    resp = ti["response_mask"].sum(-1).tolist()
    got = con.sql("select len(loss_mask), len(rollout_logprobs), len(rewards), len(sequences) from train "
                  "where step = 0").fetchall()
    assert got == [(r, r, r, n) for r, n in zip(resp, ti["attention_mask"].sum(-1).tolist())]
    packed = trajstore.Reader(tmp_path / "d").read(0, layout="packed")  # multi-turn loss masks: no refusal
    assert type(packed) is dict and torch.equal(packed["loss_mask"], ti["loss_mask"][ti["response_mask"].bool()])
    assert any(0 in m and 1 in m[m.index(0):] for m in go["loss_masks"])  # holes inside a response
    got = con.sql("select len(response_ids), len(loss_masks), len(rollout_logprobs), typeof(response_ids), "
                  "typeof(rollout_logprobs) from generated").fetchall()
    assert got == [(len(x), len(x), len(x), "BIGINT[]", "DOUBLE[]") for x in go["response_ids"]]


@pytest.mark.parametrize("step", [0, 1])
def test_show_places_prompt_response_and_logprobs(tmp_path, step):
    go, ti = batches(seed=8)
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, ti)
        w.append(1, go)
    for i, tr in enumerate(trajstore.traces(trajstore.Reader(tmp_path / "d"), step, logprobs=True)):
        msgs = tr["messages"]
        assert msgs[0]["role"] == "prompt" and msgs[0]["ids"] == go["prompt_token_ids"][i]
        model = [m for m in msgs if m["role"] == "model"]
        on = [k for k, m in enumerate(go["loss_masks"][i]) if m]
        assert [t for m in model for t in m["ids"]] == [go["response_ids"][i][k] for k in on]
        assert [x for m in model for x in m["logprobs"]] == pytest.approx([go["rollout_logprobs"][i][k] for k in on])


def test_view_places_response_fields_under_their_tokens(tmp_path):
    from trajstore.view.pages import View

    _, ti = batches(seed=8, step_wise=True)
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, ti)
    am, rm = ti["attention_mask"].bool(), ti["response_mask"].bool()
    for i in range(len(ti)):
        toks = View(tmp_path / "d").traj(None, 0, i)["tokens"]
        n, r = int(am[i].sum()), int(rm[i].sum())
        assert [t["id"] for t in toks] == ti["sequences"][i][am[i]].tolist()
        assert [t["mask"] for t in toks] == [0] * (n - r) + ti["loss_mask"][i][rm[i]].long().tolist()
        assert [t["logprob"] for t in toks[: n - r]] == [""] * (n - r)
        want = ti["rollout_logprobs"][i][rm[i]]  # shown at float32 precision
        assert torch.equal(torch.tensor([float(t["logprob"]) for t in toks[n - r:]], dtype=want.dtype), want)


@pytest.mark.parametrize("step_wise", [False, True])
def test_view_shows_a_generator_outputs_token_lists(tmp_path, step_wise):
    """A GeneratorOutput's per-trajectory lists (large_list columns): the prompt's tokens, then the
    response's with its loss mask (holes included) and rollout logprobs."""
    from trajstore.view.pages import View

    go, _ = batches(seed=8, step_wise=step_wise)
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, go)
    for i in range(len(go["response_ids"])):
        t = View(tmp_path / "d").traj(None, 0, i)
        toks, P = t["tokens"], len(go["prompt_token_ids"][i])
        assert t["fields"]["ids"] == "response_ids" and t["fields"]["mask"] == "loss_masks"
        assert [x["id"] for x in toks] == go["prompt_token_ids"][i] + go["response_ids"][i]
        assert [x["mask"] for x in toks] == [0] * P + go["loss_masks"][i]
        assert [x["logprob"] for x in toks[:P]] == [""] * P
        assert [float(x["logprob"]) for x in toks[P:]] == go["rollout_logprobs"][i]
