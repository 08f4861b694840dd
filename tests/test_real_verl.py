"""verl 0.9.1's real DataProto batches (tests/frameworks.txt), built along RayPPOTrainer.fit()'s own code
path: the dataset batch (collate_fn -> DataProto.from_single_dict, uid), the generation output of the
agent loop workers (concat of per-worker DataProtos, meta_info["timing"] of numpy scalars as
AgentLoopManager._performance_metrics makes it), ``batch.repeat(...).union(gen_output)``, response_mask,
old_log_probs through DataProto.from_tensordict; text and Qwen2-VL (position_ids [B,4,L],
multi_modal_inputs dicts of tensors).  Each round-trips exactly through Writer/Reader and through a
Recorder dump replayed in another process, comes back as verl's DataProto, is stored unpadded, and every
inspection tool reads it."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from _dumps import check_inspection
from trajstore.testing import assert_batch_equal

verl_protocol = pytest.importorskip("verl.protocol")
tensordict = pytest.importorskip("tensordict")
DataProto = verl_protocol.DataProto
ROOT = Path(__file__).resolve().parents[1]


def _collate(rows):
    """verl.utils.dataset.rl_dataset.collate_fn: tensors stacked, everything else an object array."""
    out = {}
    for k in rows[0]:
        v = [r[k] for r in rows]
        out[k] = torch.stack(v) if isinstance(v[0], torch.Tensor) else np.fromiter(v, dtype=object, count=len(v))
    return out


def _worker(n, first, P, R, lengths, vlm, g):
    """AgentLoopWorker._postprocess for one chunk of ``n`` samples: left-padded prompts, right-padded
    responses, two-sided attention_mask, position ids from the mask (mrope rows for Qwen2-VL)."""
    outs = []
    for j in range(first, first + n):
        pl, rl = lengths(j)
        p = torch.zeros(1, P, dtype=torch.long)
        p[0, P - pl:] = torch.randint(1, 1000, (pl,), generator=g)
        pm = torch.zeros(1, P, dtype=torch.long)
        pm[0, P - pl:] = 1
        r = torch.zeros(1, R, dtype=torch.long)
        r[0, :rl] = torch.randint(1, 1000, (rl,), generator=g)
        rm = torch.zeros(1, R, dtype=torch.long)
        rm[0, :rl] = 1
        am = torch.cat([pm, rm], 1)
        pos = torch.clip(torch.cumsum(am, -1) - 1, min=0)  # verl.utils.model.compute_position_id_with_mask
        if vlm:  # Qwen2-VL mrope: (1, 4, L)
            pos = torch.cat([pos.unsqueeze(0), pos.unsqueeze(0).expand(1, 3, -1)], 1)
        mmi = {"pixel_values": torch.randn(4 * (1 + j % 2), 1176, generator=g),
               "image_grid_thw": torch.tensor([[1, 2, 2]] * (1 + j % 2)),
               "images_seqlens": torch.tensor([4] * (1 + j % 2))} if vlm else {}
        outs.append(dict(prompts=p, responses=r, response_mask=rm, input_ids=torch.cat([p, r], 1), attention_mask=am,
                         position_ids=pos, rollout_log_probs=torch.randn(1, R, generator=g) * rm, mmi=mmi,
                         score=float(j % 2), t=0.1 * (j + 1)))
    keys = ["prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids", "rollout_log_probs"]
    td = tensordict.TensorDict({k: torch.cat([o[k] for o in outs]) for k in keys}, batch_size=n)
    rm_scores = torch.zeros_like(td["response_mask"], dtype=torch.float32)
    last = td["attention_mask"][:, P:].sum(1) - 1
    rm_scores[torch.arange(n), last] = torch.tensor([o["score"] for o in outs])
    td["rm_scores"] = rm_scores
    ntb = {"__num_turns__": np.array([2] * n, dtype=np.int32),
           "multi_modal_inputs": np.array([o["mmi"] for o in outs], dtype=object),
           "acc": np.array([o["score"] for o in outs], dtype=np.float32)}
    for k in ["turn_scores", "tool_rewards", "min_global_steps", "max_global_steps", "extras"]:
        a = np.empty(n, dtype=object)
        a[:] = [None] * n
        ntb[k] = a
    metrics = [{"generate_sequences": o["t"], "tool_calls": 0.0, "compute_score": 0.01, "num_preempted": 0}
               for o in outs]
    return DataProto(batch=td, non_tensor_batch=ntb, meta_info={"metrics": metrics, "reward_extra_keys": ["acc"]})


def _timing(metrics, output):
    """AgentLoopManager._performance_metrics: numpy scalars (np.float64, np.int64) and python ints."""
    t = {}
    for name in ("generate_sequences", "tool_calls", "compute_score", "num_preempted"):
        a = np.array([m[name] for chunk in metrics for m in chunk])
        for stat in ("min", "max", "mean"):
            t[f"agent_loop/{name}/{stat}"] = getattr(a, stat)()
    t["agent_loop/slowest/generate_sequences"] = np.array([m["generate_sequences"] for c in metrics for m in c]).max()
    P = output.batch["prompts"].shape[1]
    am = output.batch["attention_mask"][0]
    t["agent_loop/slowest/prompt_length"] = am[:P].sum().item()
    t["agent_loop/slowest/response_length"] = am[P:].sum().item()
    return t


def batches(vlm=False, B=2, N=2, P=8, R=6, seed=0, lengths=None):
    """(generation output with meta_info["timing"], the fit() batch after old_log_probs and advantages)."""
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or (lambda j: (3 + j % (P - 2), 1 + j % R))
    rows = [dict(dummy_tensor=torch.tensor([0], dtype=torch.uint8), raw_prompt=[{"role": "user", "content": f"q{i}"}],
                 data_source="gsm8k", reward_model={"style": "rule", "ground_truth": str(i)}, extra_info={"index": i},
                 index=i, tools_kwargs={}, interaction_kwargs={}) for i in range(B)]
    batch = DataProto.from_single_dict(_collate(rows))  # ray_trainer.fit
    batch.meta_info["temperature"] = 1.0
    batch.non_tensor_batch["uid"] = np.array([str(uuid.UUID(int=seed * 1000 + i)) for i in range(B)], dtype=object)
    reward_keys = {"data_source", "reward_model", "extra_info", "uid"} & batch.non_tensor_batch.keys()
    gen_batch = batch.pop(batch_keys=[], non_tensor_batch_keys=sorted(set(batch.non_tensor_batch) - reward_keys))
    gen_batch.non_tensor_batch.update(batch.non_tensor_batch)
    gen_batch.meta_info["global_steps"] = 1
    chunks = gen_batch.repeat(repeat_times=N, interleave=True).chunk(2)
    outs, first = [], 0
    for c in chunks:
        outs.append(_worker(len(c), first, P, R, lengths, vlm, g))
        first += len(c)
    gen_output = DataProto.concat(outs)
    metrics = [o.meta_info.pop("metrics") for o in outs]
    gen_output.meta_info = {"timing": _timing(metrics, gen_output), **outs[0].meta_info}
    out = DataProto(batch=gen_output.batch, non_tensor_batch=dict(gen_output.non_tensor_batch),
                    meta_info={k: v for k, v in gen_output.meta_info.items() if k != "timing"})
    b = batch.repeat(repeat_times=N, interleave=True).union(out)
    if "response_mask" not in b.batch.keys():
        b.batch["response_mask"] = b.batch["attention_mask"][:, -R:]
    b.meta_info["global_token_num"] = torch.sum(b.batch["attention_mask"], dim=-1).tolist()
    olp = DataProto.from_dict({"old_log_probs": torch.randn(B * N, R, generator=g)})
    b = b.union(olp)
    b.batch["token_level_scores"] = b.batch["rm_scores"]
    b.batch["token_level_rewards"] = b.batch["token_level_scores"].clone()
    b.batch["advantages"] = torch.randn(B * N, R, generator=g) * b.batch["response_mask"]
    b.batch["returns"] = b.batch["advantages"].clone()
    return gen_output, b


def spread(B=4, N=2, P=64, R=256, seed=0):
    """A fit() batch whose trajectory lengths spread 4x (80 to 320 tokens)."""
    def lengths(j):
        k = j % 4
        return 16 * (k + 1), 64 * (k + 1)
    return batches(B=B, N=N, P=P, R=R, seed=seed, lengths=lengths)[1]


def _same(a, b):
    assert type(a) is type(b) is DataProto
    assert_batch_equal(a.batch, b.batch, "batch")
    assert_batch_equal(a.non_tensor_batch, b.non_tensor_batch, "non_tensor_batch")
    assert_batch_equal(a.meta_info, b.meta_info, "meta_info")


# ----------------------------------------------------------------------------- Writer / Reader
@pytest.mark.parametrize("vlm", [False, True], ids=["text", "vlm"])
def test_fit_and_generation_batches_round_trip_exactly(tmp_path, vlm):
    gen, fit = batches(vlm=vlm)
    assert isinstance(gen.meta_info["timing"]["agent_loop/generate_sequences/mean"], np.float64)
    if vlm:
        assert fit.batch["position_ids"].shape == (4, 4, 14)
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, gen)
        w.append(1, fit)
    r = trajstore.Reader(tmp_path / "d")
    _same(gen, r.read(0))
    _same(fit, r.read(1))
    got = r.read(1)  # still verl's class: chunk/concat work on it
    assert torch.equal(DataProto.concat(got.chunk(2)).batch["input_ids"], fit.batch["input_ids"])


@settings(max_examples=15)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(1, 6)), min_size=4, max_size=4), st.booleans())
def test_any_lengths_round_trip_exactly(tmp_path_factory, lengths, vlm):
    gen, fit = batches(vlm=vlm, P=8, R=6, lengths=lambda j: lengths[j])
    d = tmp_path_factory.mktemp("v") / "d"
    with trajstore.Writer(d) as w:
        w.append(0, gen)
        w.append(1, fit)
    r = trajstore.Reader(d)
    _same(gen, r.read(0))
    _same(fit, r.read(1))


def test_per_token_fields_are_stored_unpadded(tmp_path):
    b = spread()
    lens = b.batch["attention_mask"].sum(-1)
    assert lens.max() == 4 * lens.min()
    padded = sum(v.numel() * v.element_size() for v in b.batch.values())
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, b)
    files = list((tmp_path / "d").rglob("*.parquet"))
    on_disk = sum(f.stat().st_size for f in files)
    assert files and on_disk <= 0.5 * padded, (on_disk, padded)
    spec = trajstore.Reader(tmp_path / "d").info(0)["batch"]
    assert spec["form"] == "masked"  # two-sided attention_mask: each row's valid span, prompt left, response right
    kinds = {k: n.get("kind") for k, n in spec["keys"] if n["t"] == "tensor"}
    assert all(kinds[k] == "token" for k, v in b.batch.items() if v.dim() == 2 and v.shape[1] > 1), kinds
    _same(b, trajstore.Reader(tmp_path / "d").read(0))


# ----------------------------------------------------------------------------- Recorder, another process
REPLAY = """
import sys
from trajstore import Recorder
rec = Recorder(replay=True, path=sys.argv[1])
got = [rec.batch(s, lambda: 1 / 0) for s in (0, 1)]
assert type(got[0]).__module__ == "verl.protocol" and type(got[0]).__name__ == "DataProto", type(got[0])
sys.path.insert(0, sys.argv[2])
import test_real_verl as t
gen, fit = t.batches(vlm=sys.argv[3] == "vlm", seed=3)
t._same(gen, got[0])
t._same(fit, got[1])
assert len(got[1].chunk(2)) == 2
print("ok")
"""


@pytest.mark.parametrize("vlm", ["text", "vlm"])
def test_recorder_dump_replays_in_another_process_as_verl_dataproto(tmp_path, vlm):
    gen, fit = batches(vlm=vlm == "vlm", seed=3)
    with trajstore.Recorder(dump=True, path=str(tmp_path / "d")) as rec:
        assert rec.batch(0, lambda: gen) is gen
        assert rec.batch(1, lambda: fit) is fit
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", REPLAY, str(tmp_path / "d"), str(ROOT / "tests"), vlm],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


# ----------------------------------------------------------------------------- inspection
@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    d = tmp_path_factory.mktemp("verl") / "run"
    with trajstore.Writer(d) as w:
        w.append(0, batches(seed=1)[1])
        w.append(1, batches(vlm=True, seed=2)[1])
    return d


def test_inspection_tools_count_trajectories(dump, capsys):
    df = trajstore.Reader(dump).to_pandas()
    assert len(df) == 8 and list(df["step"]) == [0] * 4 + [1] * 4
    fit = batches(seed=1)[1]
    assert [len(x) for x in df["input_ids"][:4]] == fit.batch["attention_mask"].sum(-1).tolist()
    check_inspection(dump, [4, 4], capsys)
