"""verl 0.9.1's real DataProto batches (tests/frameworks.txt), built by verl's own code along
RayPPOTrainer.fit(): the dataset batch (``rl_dataset.collate_fn`` -> ``DataProto.from_single_dict``,
uid), ``RayPPOTrainer._get_gen_batch``, the generation output of ``AgentLoopManager.generate_sequences``
running real ``AgentLoopWorker``s in this process (``_agent_loop_postprocess`` pads and computes
position ids, ``_postprocess`` batches, ``_performance_metrics`` makes ``meta_info["timing"]`` of
numpy scalars), then ``union``, ``compute_response_mask``, ``extract_reward``, old_log_probs through
``DataProto.from_tensordict`` and the GRPO advantage of ``compute_advantage``. Only the rollout (the
LLM's answer: ``ScriptedAgentLoop``) and, for Qwen2-VL, the transformers processor (``Qwen2VLStandIn``)
are scripted. Each batch round-trips exactly through Writer/Reader and through a Recorder dump
replayed in another process, comes back as verl's DataProto, is stored unpadded, and every inspection
tool reads it."""

import copy
import json
import uuid
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from _dumps import check_inspection, run_python
from trajstore.testing import assert_batch_equal

verl_protocol = pytest.importorskip("verl.protocol")
tensordict = pytest.importorskip("tensordict")
agent_loop = pytest.importorskip("verl.experimental.agent_loop.agent_loop")  # hydra-core, pydantic, pillow
ray_trainer = pytest.importorskip("verl.trainer.ppo.ray_trainer")  # torchdata, peft, fastapi, codetiming...
from omegaconf import OmegaConf  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402
from transformers import BatchFeature, PreTrainedTokenizerFast  # noqa: E402
from verl.trainer.ppo.core_algos import AdvantageEstimator  # noqa: E402
from verl.trainer.ppo.reward import extract_reward  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.dataset.rl_dataset import collate_fn  # noqa: E402

DataProto = verl_protocol.DataProto
ROOT = Path(__file__).resolve().parents[1]
_PLAN: dict[int, tuple] = {}  # the rollout of each sample (by its "priority", the manager's sample index)


@agent_loop.register("trajstore_scripted")
class ScriptedAgentLoop:
    """The agent loop hydra instantiates for each sample: what an LLM server would answer. A prompt,
    a two-turn response (model tokens, a tool's tokens masked out, model tokens), log-probs, a score,
    and for Qwen2-VL the sample's images."""

    def __init__(self, **_: object):
        pass

    async def run(self, sampling_params: dict, **kwargs) -> "agent_loop.AgentLoopOutput":
        j = int(kwargs["priority"])
        pl, rl, seed, vlm = _PLAN[j]
        g = torch.Generator().manual_seed(seed * 1000 + j)
        tool = rl // 3
        return agent_loop.AgentLoopOutput(
            prompt_ids=torch.randint(3, 1000, (pl,), generator=g).tolist(),
            response_ids=torch.randint(3, 1000, (rl,), generator=g).tolist(),
            response_mask=[1] * (rl - 2 * tool) + [0] * tool + [1] * tool,
            response_logprobs=(-torch.rand(rl, generator=g)).tolist(), reward_score=float(j % 2), num_turns=2,
            multi_modal_data={"images": [f"img{j}-{i}" for i in range(1 + j % 2)]} if vlm else None,
            metrics=agent_loop.AgentLoopMetrics(generate_sequences=0.1 * (j + 1), tool_calls=0.01 * j,
                                                num_preempted=j % 2),
            extra_fields={"reward_extra_info": {"acc": float(j % 2)}})


class Qwen2VLStandIn:
    """Stands in for the Qwen2-VL processor (transformers, not verl; a real one needs the model's files):
    4 patches of 1176 values per image, ``image_grid_thw`` [1, 2, 2], and (as verl binds the model's
    ``get_rope_index`` to it) 3 rows of rope positions."""

    image_token_id, video_token_id = 2, None

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text, images=None, videos=None, return_tensors="pt", **_):
        g = torch.Generator().manual_seed(len(text[0]) * 7 + len(images))
        return BatchFeature({"input_ids": [[0]], "attention_mask": [[1]],
                             "pixel_values": torch.randn(4 * len(images), 1176, generator=g),
                             "image_grid_thw": torch.tensor([[1, 2, 2]] * len(images))})

    def get_rope_index(self, input_ids, attention_mask, **_):
        pos = torch.clip(torch.cumsum(attention_mask, -1) - 1, min=0)
        return pos.unsqueeze(0).expand(3, -1, -1).clone(), None


_VOCAB = {"<pad>": 0, "<unk>": 1, "<image>": 2, **{f"w{i}": i for i in range(3, 1000)}}
TOKENIZER = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(_VOCAB, unk_token="<unk>")),
                                    pad_token="<pad>")


class _Handle:
    """A ray actor handle of a worker that runs in this process: ``handle.generate_sequences.remote(x)``."""

    def __init__(self, worker):
        self.generate_sequences = type("Method", (), {"remote": staticmethod(worker.generate_sequences)})


def _manager(P, R, vlm, workers=2):
    """AgentLoopManager with ``workers`` real AgentLoopWorkers (set up as their __init__ does from the
    config, without a model server or ray)."""
    rollout = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "calculate_log_probs": True, "prompt_length": P,
               "response_length": R, "agent": {"default_agent_loop": "trajstore_scripted"}}
    cfg = OmegaConf.create({"data": {}, "actor_rollout_ref": {"rollout": rollout}})
    mgr = object.__new__(agent_loop.AgentLoopManager)
    mgr.agent_loop_workers = []
    for _ in range(workers):
        w = object.__new__(agent_loop.AgentLoopWorker)
        vars(w).update(config=cfg, rollout_config=cfg.actor_rollout_ref.rollout, tokenizer=TOKENIZER,
                       processor=Qwen2VLStandIn(TOKENIZER) if vlm else None, llm_client=None, hf_model_type=None,
                       dataset_cls=None, tools=[], reward_loop_worker_handles=None, distillation_enabled=False,
                       mm_processor_kwargs=None)
        mgr.agent_loop_workers.append(_Handle(w))
    return mgr


def batches(vlm=False, B=2, N=2, P=8, R=6, seed=0, lengths=None):
    """(generation output with meta_info["timing"], the fit() batch after old_log_probs and advantages)."""
    lengths = lengths or (lambda j: (3 + j % (P - 2), 1 + j % R))
    rows = [dict(dummy_tensor=torch.tensor([0], dtype=torch.uint8), raw_prompt=[{"role": "user", "content": f"q{i}"}],
                 data_source="gsm8k", reward_model={"style": "rule", "ground_truth": str(i)}, extra_info={"index": i},
                 index=i, tools_kwargs={}, interaction_kwargs={}) for i in range(B)]
    # RayPPOTrainer.fit (verl/trainer/ppo/ray_trainer.py:1478-1610), its own functions called in its order
    batch = DataProto.from_single_dict(collate_fn(rows))
    batch.meta_info["temperature"] = 1.0
    batch.non_tensor_batch["uid"] = np.array([str(uuid.UUID(int=seed * 1000 + i)) for i in range(B)], dtype=object)
    gen_batch = ray_trainer.RayPPOTrainer._get_gen_batch(object.__new__(ray_trainer.RayPPOTrainer), batch)
    gen_batch.meta_info["global_steps"] = 1
    gen_batch_output = gen_batch.repeat(repeat_times=N, interleave=True)
    _PLAN.clear()
    _PLAN.update({j: (*lengths(j), seed, vlm) for j in range(B * N)})
    gen_output = _manager(P, R, vlm).generate_sequences(gen_batch_output)
    generated = copy.deepcopy(gen_output)  # as the trainer holds it: what a dump of this step records
    gen_output.meta_info.pop("timing", None)  # after timing_raw.update(...): Recorder meta in the tests below
    gen_batch_output = gen_output.slice(0, len(gen_output))
    batch = batch.repeat(repeat_times=N, interleave=True).union(gen_batch_output)
    if "response_mask" not in batch.batch.keys():
        batch.batch["response_mask"] = ray_trainer.compute_response_mask(batch)
    batch.meta_info["global_token_num"] = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()
    images_seqlens_all = []  # ray_trainer.py:1555-1560
    for multi_modal_input in batch.non_tensor_batch["multi_modal_inputs"]:
        if "image_grid_thw" in multi_modal_input.keys():
            images_seqlens_all.extend(multi_modal_input["images_seqlens"].tolist())
    batch.meta_info["images_seqlens"] = images_seqlens_all
    reward_tensor, reward_extra_infos_dict = extract_reward(batch)
    # _compute_old_log_prob's result (the actor's log-probs of the response tokens)
    g = torch.Generator().manual_seed(seed)
    old_log_prob = DataProto.from_tensordict(tu.get_tensordict(
        {"old_log_probs": torch.randn(B * N, R, generator=g), "entropys": torch.rand(B * N, R, generator=g)}))
    old_log_prob.batch.pop("entropys")
    batch = batch.union(old_log_prob)
    batch.batch["token_level_scores"] = reward_tensor
    batch.non_tensor_batch.update({k: np.array(v) for k, v in reward_extra_infos_dict.items()})
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    batch = ray_trainer.compute_advantage(batch, adv_estimator=AdvantageEstimator.GRPO, num_repeat=N,
                                          norm_adv_by_std_in_grpo=True)
    return generated, batch


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


def test_batches_come_from_verl_code():
    gen, fit = batches(vlm=True)
    assert isinstance(gen.meta_info["timing"]["agent_loop/generate_sequences/mean"], np.float64)
    assert gen.meta_info["reward_extra_keys"] == ["acc"] and "priority" in gen.non_tensor_batch
    assert fit.batch["position_ids"].shape == (4, 4, 14)
    am = fit.batch["attention_mask"]
    assert (am[:, 0] == 0).any() and (am[:, -1] == 0).any()  # left-padded prompts, right-padded responses
    assert [int(x) for x in fit.meta_info["images_seqlens"]] == [4, 4, 4, 4, 4, 4]
    assert fit.non_tensor_batch["multi_modal_inputs"][1]["pixel_values"].shape == (8, 1176)
    assert (fit.batch["response_mask"] < fit.batch["attention_mask"][:, -6:]).any()  # the tool's tokens
    assert not torch.equal(fit.batch["advantages"], torch.zeros_like(fit.batch["advantages"]))


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


@settings(max_examples=15, deadline=None)
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


def test_vlm_position_ids_are_stored_unpadded(tmp_path):
    """Qwen2-VL's mrope position_ids [B, 4, L] follow attention_mask on their last axis: row i holds
    its [4, n_i] valid block; verl's padded positions (0 left, the last position repeated right)
    are kept in the pad column; read packed, [4, N] as verl's remove-padding path wants it."""
    b = batches(vlm=True, B=4, N=2, P=64, R=256, lengths=lambda j: (16 * (j % 4 + 1), 64 * (j % 4 + 1)))[1]
    pos, am = b.batch["position_ids"], b.batch["attention_mask"].bool()
    assert pos.shape == (8, 4, 320) and am.sum(-1).max() == 4 * am.sum(-1).min()
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, b)
    r = trajstore.Reader(tmp_path / "d")
    node = dict(r.info(0)["batch"]["keys"])["position_ids"]
    assert node["kind"] == "token" and node["axis"] == "last" and node["trail"] == [4]
    f = next((tmp_path / "d").rglob("*.parquet"))
    t = pq.read_table(f, columns=["position_ids"])
    assert [len(x) for x in t.column(0).to_pylist()] == (4 * am.sum(-1)).tolist()  # valid positions only
    assert t.column(0).to_pylist()[0] == pos[0][:, am[0]].reshape(-1).tolist()
    md = pq.ParquetFile(f).metadata
    on_disk = sum(md.row_group(g).column(c).total_compressed_size for g in range(md.num_row_groups)
                  for c in range(md.num_columns) if "position_ids" in md.row_group(g).column(c).path_in_schema)
    assert 0 < on_disk <= 0.5 * pos.numel() * pos.element_size(), on_disk
    _same(b, r.read(0))
    packed = r.read(0, layout="packed")
    assert torch.equal(packed.batch["position_ids"], pos.movedim(1, 0)[:, am])
    assert list(packed.batch["cu_seqlens"].diff()) == am.sum(-1).tolist()


# ----------------------------------------------------------------------------- Recorder, another process
REPLAY = """
import json
import sys
import numpy as np
from trajstore import Recorder
rec = Recorder(replay=True, path=sys.argv[1])
got = [rec.batch(s, lambda: 1 / 0) for s in range(4)]
assert type(got[0]).__module__ == "verl.protocol" and type(got[0]).__name__ == "DataProto", type(got[0])
sys.path.insert(0, sys.argv[2])
import test_real_verl as t
from trajstore.testing import assert_batch_equal
want = json.loads(sys.argv[3])  # the dumped batches' key orders: verl builds some from sets (hash order)
assert [t.key_order(b) for b in got] == want
for k, vlm in enumerate((False, True)):
    gen, fit = t.batches(vlm=vlm, seed=3)
    t._same(t.reorder(gen, want[2 * k]), got[2 * k])
    t._same(t.reorder(fit, want[2 * k + 1]), got[2 * k + 1])
    assert len(got[2 * k + 1].chunk(2)) == 2
    meta = rec.meta(2 * k)
    assert_batch_equal(meta, {"timing": gen.meta_info["timing"], "global_steps": 1}, "meta")
    assert type(meta["timing"]["agent_loop/generate_sequences/mean"]) is np.float64
print("ok")
"""


def key_order(b):
    return [list(b.batch.keys()), list(b.non_tensor_batch), list(b.meta_info)]


def reorder(b, order):
    """``b`` with its keys in ``order`` (``key_order`` of the same batch built by another process)."""
    ks, ns, ms = order
    assert [sorted(x) for x in key_order(b)] == [sorted(ks), sorted(ns), sorted(ms)]
    return DataProto(batch=b.batch.select(*ks), non_tensor_batch={k: b.non_tensor_batch[k] for k in ns},
                     meta_info={k: b.meta_info[k] for k in ms})


def test_recorder_dump_replays_in_another_process_as_verl_dataproto(tmp_path):
    order = []
    with trajstore.Recorder(dump=True, path=str(tmp_path / "d")) as rec:
        for k, vlm in enumerate((False, True)):  # text, then Qwen2-VL
            gen, fit = batches(vlm=vlm, seed=3)
            timing_raw = dict(gen.meta_info["timing"])  # what fit() logs for the step: numpy scalars
            assert rec.batch(2 * k, lambda: gen, meta={"timing": timing_raw, "global_steps": 1}) is gen
            assert rec.batch(2 * k + 1, lambda: fit) is fit
            order += [key_order(gen), key_order(fit)]
    run_python(REPLAY, tmp_path / "d", ROOT / "tests", json.dumps(order))


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
