"""TRL 1.16.0's real GRPO batch (tests/frameworks.txt): the output of the REAL
``GRPOTrainer._generate_and_score_completions`` run on a shell trainer (no ``__init__``, no model; only
generation, rewards and logprobs are faked), text and Qwen2-VL.  prompt_ids/prompt_mask are left-padded,
completion_ids/completion_mask right-padded and there is no attention_mask: each per-token field follows
its own mask; a VLM batch's ``pixel_values`` are stored one run of patch rows per completion, cut by
``image_grid_thw`` and ``num_images``.  Each round-trips exactly through Writer/Reader and through a Recorder dump replayed in
another process (TRL's batch is a dict), is stored unpadded, and every inspection tool reads it."""

from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from _dumps import check_inspection, run_python
from trajstore.errors import BatchError
from trajstore.testing import assert_batch_equal

grpo = pytest.importorskip("trl.trainer.grpo_trainer")
BatchFeature = pytest.importorskip("transformers.feature_extraction_utils").BatchFeature
ROOT = Path(__file__).resolve().parents[1]


class Shell(grpo.GRPOTrainer):
    """GRPOTrainer without __init__; generation, rewards and logprobs replaced by seeded fakes."""

    def __init__(self, lengths, g):
        self.lengths, self.g = lengths, g

    def _generate(self, prompts):  # returns like grpo_trainer.py:2322
        P, C = [], []
        for i in range(len(prompts)):
            pl, cl = self.lengths(i)
            P.append(torch.randint(3, 1000, (pl,), generator=self.g).tolist())
            C.append(torch.randint(3, 1000, (cl - 1,), generator=self.g).tolist() + [2])
        return P, C, None, [[{"role": "assistant", "content": "x" * len(c)}] for c in C], None, {}, None, None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        return torch.tensor([[float(len(c) % 2)] for c in completion_ids_list])

    def _get_per_token_logps_and_entropies(self, model, ids, mask, logits_to_keep, **kw):
        return torch.randn(ids.size(0), logits_to_keep, generator=self.g), None, None


class _Processor:
    """A Qwen2-VL processor: each image (here its grid ``(t, h, w)``, one of (1, 2, 2) by default)
    gives ``t*h*w`` patch rows of 1176 and one ``image_grid_thw`` row, every sample's in turn."""

    image_processor = SimpleNamespace(merge_size=2)

    def __init__(self, g, dtype=torch.float32):
        self.g, self.dtype = g, dtype

    def apply_chat_template(self, msgs, **kw):
        return "<prompt>"

    def __call__(self, images, text, **kw):
        n = len(text)
        grids = [(1, 2, 2) if im == "IMG" else im for ims in images for im in (ims or [])]
        rows = sum(t * h * w for t, h, w in grids)
        return BatchFeature({"input_ids": torch.ones(n, 3, dtype=torch.long),
                             "attention_mask": torch.ones(n, 3, dtype=torch.long),
                             "pixel_values": torch.randn(rows, 1176, generator=self.g).to(self.dtype),
                             "image_grid_thw": torch.tensor(grids).reshape(-1, 3),
                             "mm_token_type_ids": torch.zeros(n, 3, dtype=torch.long)})


def _trainer(vlm, G, B, lengths, g, dtype=torch.float32):
    t = Shell(lengths, g)
    t.accelerator = SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, process_index=0,
                                    unwrap_model=lambda m: m, is_main_process=True)
    t.model = SimpleNamespace(training=True, is_gradient_checkpointing=False)
    t.args = SimpleNamespace(steps_per_generation=2, per_device_train_batch_size=B // 2,
                             per_device_eval_batch_size=B // 2, gradient_checkpointing_kwargs=None,
                             gradient_accumulation_steps=1, device=torch.device("cpu"))
    t.is_deepspeed_enabled = False
    t._tokenizer = SimpleNamespace(pad_token_id=0)
    t.eos_token_ids = [2]
    t.pad_to_multiple_of = None
    t.mask_truncated_completions = False
    t.environment_factories = t.environments = t.tools = None
    t._is_vlm = vlm
    t.num_iterations = 1
    t.use_vllm = t.vllm_importance_sampling_correction = False
    t.beta, t.ref_model = 0.0, None
    t.num_generations = t.num_generations_eval = G
    t.scale_rewards = "group"
    t.multi_objective_aggregation = "sum_then_normalize"
    t.reward_weights, t.reward_func_names = torch.ones(1), ["r"]
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t._logs = {"images": [], "prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
               "extra": defaultdict(list)}
    t._pending_extra_logs, t._pending_metrics = defaultdict(list), defaultdict(list)
    t.log_multimodal = False
    t.chat_template_kwargs = {}
    t._step, t._buffered_inputs = 0, None
    if vlm:
        t.processing_class = _Processor(g, dtype)
    return t


def batch(vlm=False, G=2, B=4, seed=0, lengths=None, images=None, dtype=torch.float32):
    """The dict ``_generate_and_score_completions`` returns for B samples (B // G prompts, G each);
    ``images``: each sample's list of image grids (TRL's ``images`` column), else one image each."""
    g = torch.Generator().manual_seed(seed)
    t = _trainer(vlm, G, B, lengths or (lambda i: (2 + i % 3, 2 + i)), g, dtype)
    pics = [{"images": images[i]} if images else {"image": "IMG"} if vlm else {} for i in range(B)]
    inputs = [{"prompt": [{"role": "user", "content": f"q{i // G}"}], **pics[i]} for i in range(B)]
    return t._generate_and_score_completions(inputs)


def spread(B=8, seed=0):
    """Prompt and completion lengths spreading 4x (32..128 and 64..256 tokens)."""
    return batch(B=B, G=2, seed=seed, lengths=lambda i: (32 * (1 + i % 4), 64 * (1 + (i + 1) % 4)))


# ----------------------------------------------------------------------------- Writer / Reader
def test_text_batch_round_trips_exactly(tmp_path):
    b = batch()
    assert "attention_mask" not in b and b["prompt_mask"][0, 0] == 0 and b["completion_mask"][0, -1] == 0
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, b)
    assert_batch_equal(b, trajstore.Reader(tmp_path / "d").read(0))


@settings(max_examples=15)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=4, max_size=4))
def test_any_lengths_round_trip_exactly(tmp_path_factory, lengths):
    b = batch(lengths=lambda i: lengths[i])
    d = tmp_path_factory.mktemp("t") / "d"
    with trajstore.Writer(d) as w:
        w.append(0, b)
    assert_batch_equal(b, trajstore.Reader(d).read(0))


@pytest.mark.parametrize("vlm", [False, True], ids=["text", "vlm"])
def test_prepare_inputs_micro_batches_round_trip_exactly(tmp_path, vlm):
    """GRPOTrainer._prepare_inputs (real): shuffle_sequence_dict, split_tensor_dict, one micro-batch per
    step; a VLM batch also goes through split_pixel_values_by_grid and back (unsplit_pixel_values_by_grid),
    so each micro-batch's pixel_values are its own samples' rows."""
    g = torch.Generator().manual_seed(5)
    t = _trainer(vlm, 2, 4, lambda i: (2 + i % 3, 2 + i), g)
    inputs = [{"prompt": [{"role": "user", "content": f"q{i // 2}"}], **({"images": IMAGES[i]} if vlm else {})}
              for i in range(4)]
    steps = [t._prepare_inputs(inputs) for _ in range(2)]
    assert steps[0]["prompt_ids"].shape[0] == 2 and (not vlm or sum(len(s["num_images"]) for s in steps) == 4)
    with trajstore.Writer(tmp_path / "d") as w:
        for s, b in enumerate(steps):
            w.append(s, b)
    r = trajstore.Reader(tmp_path / "d")
    for s, b in enumerate(steps):
        assert_batch_equal(b, r.read(s))


def test_per_token_fields_are_stored_unpadded(tmp_path):
    b = spread()
    lens = b["prompt_mask"].sum(-1) + b["completion_mask"].sum(-1)
    assert lens.max() >= 2 * lens.min() and b["completion_mask"].sum(-1).max() == 4 * b["completion_mask"].sum(-1).min()
    padded = sum(v.numel() * v.element_size() for v in b.values() if torch.is_tensor(v))
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, b)
    on_disk = sum(f.stat().st_size for f in (tmp_path / "d").rglob("*.parquet"))
    assert 0 < on_disk <= 0.5 * padded, (on_disk, padded)
    spec = trajstore.Reader(tmp_path / "d").info(0)["batch"]
    kinds = {k: n.get("kind") for k, n in spec["keys"] if n["t"] == "tensor"}
    assert {k for k, v in kinds.items() if v == "token"} >= {"prompt_ids", "prompt_mask", "completion_ids",
                                                            "completion_mask", "old_per_token_logps"}, kinds
    assert_batch_equal(b, trajstore.Reader(tmp_path / "d").read(0))
    packed = trajstore.Reader(tmp_path / "d").read(0, layout="packed")  # each part packed by its own mask
    for part in ("prompt", "completion"):
        lens = b[f"{part}_mask"].sum(-1)
        assert torch.equal(packed[f"{part}_cu_seqlens"].diff(), lens.to(packed[f"{part}_cu_seqlens"].dtype))
        assert torch.equal(packed[f"{part}_ids"], b[f"{part}_ids"][b[f"{part}_mask"].bool()])
    assert torch.equal(packed["old_per_token_logps"], b["old_per_token_logps"][b["completion_mask"].bool()])


IMAGES = [[(1, 2, 2), (1, 2, 4)], [], [(2, 2, 2)], [(1, 2, 2)] * 3]  # num_images [2, 0, 1, 3]: 12, 0, 8, 12 rows


@pytest.mark.parametrize("kw", [{}, {"images": IMAGES, "dtype": torch.bfloat16}], ids=["one_image", "several_bf16"])
def test_vlm_batch_round_trips_exactly(tmp_path, kw, int64_tokens):
    """Qwen-VL pixel_values [sum_patches, 1176] are stored one run of patch rows per completion."""
    b = batch(vlm=True, **kw)
    rows = [12, 0, 8, 12] if kw else [4, 4, 4, 4]
    assert b["pixel_values"].shape == (sum(rows), 1176) and b["num_images"] == ([2, 0, 1, 3] if kw else [1] * 4)
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, b)
    r = trajstore.Reader(tmp_path / "d")
    assert_batch_equal(b, r.read(0))
    assert_batch_equal(b["pixel_values"], r.read(0, layout="packed")["pixel_values"])
    assert r.info(0)["format_version"] == 3
    df = r.to_pandas()
    assert [len(x) for x in df["pixel_values"]] == rows
    at = [0, *torch.tensor(rows).cumsum(0).tolist()]
    for i, x in enumerate(df["pixel_values"]):  # each completion's own images' patch rows
        assert torch.equal(torch.from_numpy(x), b["pixel_values"][at[i]:at[i + 1]].float())


def test_vlm_sizes_that_do_not_add_up_are_refused_at_append(tmp_path):
    b = batch(vlm=True, images=IMAGES)
    b["pixel_values"] = b["pixel_values"][:-4]  # one image's rows lost
    with trajstore.Writer(tmp_path / "d") as w, pytest.raises(
            BatchError, match=r"'pixel_values' and 'image_grid_thw'.*gives 32 patch rows.*pixel_values has 28 rows"):
        w.append(0, b)


# ----------------------------------------------------------------------------- Recorder, another process
REPLAY = """
import sys
from trajstore import Recorder
got = Recorder(replay=True, path=sys.argv[1]).batch(5, lambda: 1 / 0)
assert type(got) is dict, type(got)
sys.path.insert(0, sys.argv[2])
import test_real_trl as t
from trajstore.testing import assert_batch_equal
vlm = sys.argv[3] == "vlm"
assert_batch_equal(t.batch(seed=4, vlm=vlm, images=t.IMAGES if vlm else None), got)
print("ok")
"""


@pytest.mark.parametrize("kind", ["text", "vlm"])
def test_recorder_dump_replays_in_another_process(tmp_path, kind):
    b = batch(seed=4, vlm=kind == "vlm", images=IMAGES if kind == "vlm" else None)
    with trajstore.Recorder(dump=True, path=str(tmp_path / "d"), strict=True) as rec:
        assert rec.batch(5, lambda: b) is b
    run_python(REPLAY, tmp_path / "d", ROOT / "tests", kind)


# ----------------------------------------------------------------------------- inspection
@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    d = tmp_path_factory.mktemp("trl") / "run"
    with trajstore.Writer(d) as w:
        w.append(0, batch(seed=1))
        w.append(1, batch(seed=2, B=6))
    return d


def test_inspection_tools_count_vlm_completions(tmp_path, capsys):
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, batch(seed=1, vlm=True, images=IMAGES))
        w.append(1, batch(seed=2, B=6, vlm=True))
    check_inspection(tmp_path / "d", [4, 6], capsys)


def test_inspection_tools_count_trajectories(dump, capsys):
    df = trajstore.Reader(dump).to_pandas()
    assert len(df) == 10 and list(df["step"]) == [0] * 4 + [1] * 6
    b = batch(seed=1)
    assert [len(x) for x in df["completion_ids"][:4]] == b["completion_mask"].sum(-1).tolist()
    check_inspection(dump, [4, 6], capsys)
