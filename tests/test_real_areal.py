"""AReaL 1.0.4's real rollout batches (tests/frameworks.txt), built along its own code: the REAL
``RLVRWorkflow`` / ``MultiTurnWorkflow`` / ``VisionRLVRWorkflow.arun_episode`` run against a fake
inference engine that returns AReaL's own ``ModelResponse`` (a real ``PreTrainedTokenizerFast``
trained here, a fake Qwen2-VL processor), with AReaL's own reward wrapper; groups made by the real
``GroupedRolloutWorkflow`` (``concat_padded_tensors``), as ``RemoteInfEngine.prepare_batch`` does
for ``group_size > 1``; then the trainer's ``values`` / ``ref_logp`` / ``prox_logp`` added per
trajectory through AReaL's ``batched_call`` (concat_batch -> fn -> split_batch), as
``PPOTrainer.train`` does (areal/trainer/rl_trainer.py). Each round-trips exactly through
Writer/Reader and a Recorder dump replayed in another process, is stored unpadded across
trajectories, and every inspection tool counts trajectories (a ``[g, T]`` group is g). A batch of
single-controller ``RTensor`` values (AReaL's ``RTensor.remotize`` with an in-process backend) is
stored localized, without a fetch at ``append`` and without localizing the trainer's RTensors."""

import asyncio
import logging
import threading
import uuid
import zlib
from collections import Counter
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trajstore
from _dumps import CORPUS, check_inspection, run_python
from trajstore.errors import UnsupportedTypeError
from trajstore.testing import assert_batch_equal

# areal.utils.logging.getLogger (called when areal's modules load, and later) replaces the logging
# module's Logger.root and Logger.manager: trajstore's loggers would no longer be the ones
# logging.getLogger (and so caplog) finds in the rest of the suite. Put them back after it.
_LOGGING = (logging.Logger.root, logging.Logger.manager)


def _restore_logging() -> None:
    logging.Logger.root, logging.Logger.manager = _LOGGING


areal_data = pytest.importorskip("areal.utils.data")
from areal.api import ModelResponse  # noqa: E402
from areal.api.cli_args import GenerationHyperparameters  # noqa: E402
from areal.infra.remote_inf_engine import GroupedRolloutWorkflow  # noqa: E402
from areal.infra.rpc import rtensor  # noqa: E402
from areal.workflow.multi_turn import MultiTurnWorkflow  # noqa: E402
from areal.workflow.rlvr import RLVRWorkflow  # noqa: E402
from areal.workflow.vision_rlvr import VisionRLVRWorkflow  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

_restore_logging()
RTensor = rtensor.RTensor
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
KINDS = ("rlvr", "multi_turn", "vlm")


@pytest.fixture(autouse=True)
def _logging_back():
    yield
    _restore_logging()


@lru_cache(maxsize=1)
def tokenizer() -> PreTrainedTokenizerFast:
    """A real fast tokenizer (byte-level BPE trained on a few lines here, nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<pad>", "<eos>", "<|image_pad|>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", chat_template=TEMPLATE)


def reward_fn(prompt, completions, prompt_ids, completion_ids, **data):
    """Run by AReaL's AsyncRewardWrapper in its process pool: 1 for a length divisible by 3."""
    return float(len(completion_ids) % 3 == 0)


class Engine:
    """``InferenceEngine.agenerate`` as RemoteInfEngine returns it: a ModelResponse whose output
    depends only on the request's input ids and how often they were asked for (so asyncio's
    interleaving of a group's episodes cannot change the batch); lengths from ``lengths``."""

    def __init__(self, lengths: list[int], seed: int = 0, version: int = 3):
        self.lengths, self.seed, self.version, self.seen = lengths, seed, version, Counter()

    async def agenerate(self, req):
        key = np.asarray(req.input_ids, dtype=np.int64).tobytes()
        k = self.seen[key]
        self.seen[key] += 1
        h = zlib.crc32(key) ^ self.seed
        n = self.lengths[(h + k) % len(self.lengths)]
        g = torch.Generator().manual_seed(h * 31 + k)
        out = torch.randint(5, 400, (n,), generator=g).tolist()
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=out,
                             output_logprobs=(-torch.rand(n, generator=g)).tolist(),
                             output_versions=[self.version] * n, stop_reason="length", tokenizer=req.tokenizer)


class Processor:
    """A Qwen2-VL processor's output for VisionRLVRWorkflow: per image of W x H pixels a
    (1, H/14, W/14) grid of 1176-wide patch rows and one <|image_pad|> token per 2x2 patches."""

    def __init__(self, tok: PreTrainedTokenizerFast):
        self.tok = tok

    def __call__(self, images, text, padding=False, return_tensors="pt"):
        grids = [(1, im.size[1] // 14, im.size[0] // 14) for im in images]
        pad = self.tok.convert_tokens_to_ids("<|image_pad|>")
        n_img = sum(t * h * w // 4 for t, h, w in grids)
        ids = [pad] * n_img + self.tok(self.tok.apply_chat_template(text, tokenize=False,
                                                                    add_generation_prompt=True))["input_ids"]
        g = torch.Generator().manual_seed(zlib.crc32(b"".join(im.tobytes() for im in images)))
        return {"input_ids": torch.tensor([ids]), "mm_token_type_ids": torch.tensor([[1] * n_img + [0] * (len(ids) - n_img)]),
                "pixel_values": torch.randn(sum(t * h * w for t, h, w in grids), 1176, generator=g),
                "image_grid_thw": torch.tensor(grids)}


def _workflow(kind: str):
    gconfig = GenerationHyperparameters(max_new_tokens=512)
    tok = tokenizer()
    if kind == "rlvr":
        return RLVRWorkflow(reward_fn, gconfig, tok)
    if kind == "multi_turn":
        return MultiTurnWorkflow(reward_fn, gconfig, tok, max_turns=3, turn_discount=0.9)
    return VisionRLVRWorkflow(reward_fn, gconfig, tok, Processor(tok), enable_thinking=False)


def _data(kind: str, i: int) -> dict:
    messages = [{"role": "user", "content": CORPUS[i % len(CORPUS)]}]
    if kind != "vlm":
        return {"messages": messages}
    side = 28 * (1 + i % 2)
    return {"messages": messages, "images": [Image.new("RGB", (side, 28), (40 * i % 256, 90, 160))]}


def _model_output(key: str):
    """What a model forward gives the trainer for ``batched_call``: per token, also at padding."""
    scale = {"values": 0.5, "ref_logp": -1.0, "prox_logp": -0.9}[key]

    def fn(batched: dict) -> torch.Tensor:
        ids = batched["input_ids"].to(torch.int64)
        return ((ids * 7919) % 1000).to(torch.float32) / 1000 * scale - 0.01

    return fn


def rollout(kind: str, n: int = 2, group_size: int = 2, lengths=(8, 20, 5, 13), seed: int = 0) -> list[dict]:
    """``actor.prepare_batch``'s list (one dict per accepted prompt: ``[1, T]`` episode or, with
    ``group_size > 1``, a ``[g, T]`` group), then the trainer's per-trajectory fields."""
    wf, engine = _workflow(kind), Engine(list(lengths), seed)
    if group_size > 1:
        wf = GroupedRolloutWorkflow(wf, group_size=group_size, logger=logging.getLogger("areal-test"))
    batch = [asyncio.run(wf.arun_episode(engine, _data(kind, seed + i))) for i in range(n)]
    for key in ("values", "ref_logp", "prox_logp"):  # PPOTrainer.train: traj[key] = ... per trajectory
        for traj, v in zip(batch, areal_data.batched_call(_model_output(key), batch)):
            traj[key] = v
    return batch


def _trajectories(batch: list[dict]) -> int:
    return sum(t["attention_mask"].shape[0] for t in batch)


def _write(path: Path, steps: dict) -> trajstore.Reader:
    with trajstore.Writer(path) as w:
        for s, b in steps.items():
            w.append(s, b)
    return trajstore.Reader(path)


# ----------------------------------------------------------------------------- the batches are AReaL's
def test_batches_are_built_by_areal():
    rl, mt, vl = rollout("rlvr", group_size=3), rollout("multi_turn", group_size=1), rollout("vlm", group_size=2)
    t = rl[0]
    assert list(t) == ["input_ids", "loss_mask", "logprobs", "versions", "attention_mask", "rewards",
                       "values", "ref_logp", "prox_logp"]
    assert t["input_ids"].dtype == torch.int32 and t["attention_mask"].dtype == torch.bool
    assert t["input_ids"].shape[0] == 3 and t["rewards"].shape == (3,)
    lens = t["attention_mask"].sum(1)
    assert lens.min() < lens.max() == t["attention_mask"].shape[1]  # right-padded by concat_padded_tensors
    assert mt[0]["input_ids"].shape[0] == 1 and any((m["loss_mask"][0].diff() == 1).sum() > 1 for m in mt)  # turns
    v = vl[0]
    assert v["input_ids"].dtype == torch.int64 and type(v["multi_modal_input"]) is list
    assert len(v["multi_modal_input"]) == 2 and v["multi_modal_input"][0]["pixel_values"].shape[1] == 1176


# ----------------------------------------------------------------------------- Writer / Reader
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("group_size", [1, 3])
def test_round_trip_exactly(tmp_path, kind, group_size):
    batch = rollout(kind, n=3, group_size=group_size)
    got = _write(tmp_path / "d", {0: batch}).read(0)
    assert_batch_equal(batch, got)
    if kind == "vlm":
        assert type(got[0]["multi_modal_input"]) is list and type(got[0]["multi_modal_input"][0]) is dict


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(KINDS), st.integers(1, 3), st.lists(st.integers(1, 40), min_size=1, max_size=5),
       st.integers(0, 50))
def test_any_lengths_round_trip_exactly(tmp_path_factory, kind, group_size, lengths, seed):
    batch = rollout(kind, n=2, group_size=group_size, lengths=lengths, seed=seed)
    got = _write(tmp_path_factory.mktemp("a") / "d", {0: batch}).read(0)
    assert_batch_equal(batch, got)


def _column_bytes(path: Path, fields: set[str]) -> int:
    """Compressed bytes on disk of the columns of ``fields`` (values and shapes)."""
    def ours(p: str) -> bool:
        return any(p == k or p.startswith((k + ".", "__shape__" + k)) for k in fields)

    n = 0
    for f in path.rglob("*.parquet"):
        md = pq.ParquetFile(f).metadata
        for rg in range(md.num_row_groups):
            cols = [md.row_group(rg).column(c) for c in range(md.num_columns)]
            n += sum(c.total_compressed_size for c in cols if ours(c.path_in_schema))
    return n


@pytest.mark.parametrize("kind", KINDS)
def test_per_token_fields_stored_unpadded(tmp_path, kind):
    """A batch whose trajectories spread 4x in length: its per-token fields take at most half the
    bytes of the trainer's padded batch (concat_batch); a group's trajectories are stored unpadded
    (docs/FORMAT.md 3.10), restored at the group's width."""
    batch = rollout(kind, n=8, group_size=1 if kind == "multi_turn" else 2, lengths=(84, 660))  # rewarded: one turn
    padded, _ = areal_data.concat_batch(batch)
    lens = padded["attention_mask"].sum(-1)
    assert lens.max() >= 4 * lens.min()
    T = padded["attention_mask"].shape[1]
    tokens = {k for k, v in padded.items() if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == T}
    assert {"input_ids", "logprobs", "values", "prox_logp"} <= tokens
    padded_bytes = sum(padded[k].numel() * padded[k].element_size() for k in tokens)
    _write(tmp_path / "d", {0: batch})
    on_disk = _column_bytes(tmp_path / "d", tokens)
    assert 0 < on_disk <= 0.5 * padded_bytes, (on_disk, padded_bytes)
    # each element restored at its own width (its longest trajectory's), not the batch's ...
    f = next((tmp_path / "d").rglob("*.parquet"))
    shapes = pq.read_table(f, columns=["__shape__input_ids"])
    assert [s[-1] for s in shapes.column(0).to_pylist()] == [int(t["attention_mask"].sum(-1).max()) for t in batch]
    # ... but a group's padding is not stored: each row holds its trajectories' tokens only
    lens = [t["attention_mask"].sum(-1) for t in batch]
    stored = pq.read_table(f, columns=sorted(tokens))
    for k in tokens:
        assert [len(x) for x in stored.column(k).to_pylist()] == [int(n.sum()) for n in lens], k
    if kind == "multi_turn":  # [1, T] episodes: no padding, nothing to cut
        assert "__runs__attention_mask" not in pq.read_schema(f).names
    else:
        runs = pq.read_table(f, columns=["__runs__attention_mask"]).column(0).to_pylist()
        assert runs == [[0] * len(n) + n.tolist() for n in lens]  # right-padded by concat_padded_tensors
    got = trajstore.Reader(tmp_path / "d").read(0)
    assert_batch_equal(batch, got)
    df = trajstore.Reader(tmp_path / "d").duckdb().execute("SELECT input_ids, logprobs FROM train").fetchdf()
    want = [t["input_ids"][j][t["attention_mask"][j].bool()].tolist() for t in batch for j in range(len(t["input_ids"]))]
    assert [list(x) for x in df["input_ids"]] == want


# ----------------------------------------------------------------------------- RTensor
class LocalBackend:
    """AReaL's RTensorBackend protocol on its own in-process shard storage (``rtensor.store`` /
    ``fetch`` / ``remove``, what the HTTP backend serves); counts fetches, may hold them."""

    def __init__(self):
        self.fetches, self.gate = 0, threading.Event()
        self.gate.set()

    def store(self, tensor):
        sid = uuid.uuid4().hex
        rtensor.store(sid, tensor)
        return sid

    def fetch(self, shards):
        assert self.gate.wait(60)
        self.fetches += 1
        return [rtensor.fetch(s.shard_id) for s in shards]

    async def delete(self, node_addr, shard_ids):
        for s in shard_ids:
            rtensor.remove(s)


@pytest.fixture
def backend():
    b = LocalBackend()
    rtensor.set_backend(b)
    yield b
    rtensor.set_backend(None)
    rtensor.clear_fetch_buffer()


def _leaves(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


def _remote(batch):
    """The controller's view in single-controller mode: AReaL's own remotize (trims each
    trajectory dict's padding), tensors become RTensors with meta data."""
    remote = RTensor.remotize(batch, node_addr="local")
    assert all(isinstance(x, RTensor) and x.data.is_meta for x in _leaves(remote))
    return remote


@pytest.mark.parametrize("kind", KINDS)
def test_rtensor_batch_is_stored_localized(tmp_path, backend, kind):
    remote = _remote(rollout(kind, n=2, group_size=2))
    expect = RTensor.localize(_copy(remote))
    rtensor.clear_fetch_buffer()  # what the trainer's process fetched before: nothing
    backend.fetches = 0
    backend.gate.clear()  # the network is slow: append must not wait for it
    w = trajstore.Writer(tmp_path / "d")
    w.append(0, remote)
    assert backend.fetches == 0
    backend.gate.set()
    w.close()
    assert backend.fetches == 1  # one batched fetch
    assert all(x.data.is_meta for x in _leaves(remote) if isinstance(x, RTensor))  # the trainer's stay remote
    got = trajstore.Reader(tmp_path / "d").read(0)
    assert_batch_equal(expect, got)
    assert not any(isinstance(x, RTensor) for x in _leaves(got))


def test_rtensor_batch_that_cannot_be_stored_fails_at_append(tmp_path, backend):
    remote = _remote(rollout("rlvr", n=2, group_size=1))
    remote[1]["phase"] = RTensor.remotize(torch.zeros(1, 3, dtype=torch.complex64), node_addr="local")
    with trajstore.Writer(tmp_path / "d") as w:
        with pytest.raises(UnsupportedTypeError, match="phase.*complex64"):
            w.append(0, remote)
    assert backend.fetches == 0 and trajstore.Reader(tmp_path / "d").steps == []


def _copy(remote):
    """Copies of the RTensors (localize fills its arguments' data in place)."""
    if isinstance(remote, dict):
        return {k: _copy(v) for k, v in remote.items()}
    if isinstance(remote, list):
        return [_copy(v) for v in remote]
    return RTensor(shard=remote.shard, data=remote.data) if isinstance(remote, RTensor) else remote


def test_rtensor_already_local_and_freed_shards(tmp_path, backend):
    batch = rollout("rlvr", n=2, group_size=2)
    remote = _remote(batch)
    local = RTensor.localize(_copy(remote))
    backend.fetches = 0
    with trajstore.Writer(tmp_path / "a") as w:  # RTensors holding local data: no fetch at all
        w.append(0, [{k: RTensor(shard=v.shard, data=local[i][k]) for k, v in t.items()} for i, t in enumerate(remote)])
    assert backend.fetches == 0
    assert_batch_equal(local, trajstore.Reader(tmp_path / "a").read(0))
    rtensor.clear_fetch_buffer()
    for sids in RTensor.collect_shards(remote).values():  # the trainer freed them (clear_batches)
        for s in sids:
            rtensor.remove(s)
    with trajstore.Recorder(dump=True, path=str(tmp_path / "b")) as rec:
        assert rec.batch(0, lambda: remote) is remote  # training goes on
    r = trajstore.Reader(tmp_path / "b")
    assert r.steps == [] and "AReaL RTensor" in r.skipped[0]


# ----------------------------------------------------------------------------- Recorder, another process
REPLAY = """
import sys
import torch
from trajstore import Recorder
from trajstore.errors import UnsupportedTypeError
from trajstore.testing import assert_batch_equal
expect = torch.load(sys.argv[2], weights_only=True)
assert "areal" not in sys.modules
rec = Recorder(replay=True, path=sys.argv[1])
for s, b in enumerate(expect):
    assert_batch_equal(b, rec.batch(s, lambda: 1 / 0), f"step {s}")
print("ok")
"""


def test_recorder_dump_replays_in_another_process(tmp_path, backend):
    steps = [rollout("rlvr", group_size=3, seed=1), rollout("multi_turn", group_size=1, seed=2),
             rollout("vlm", group_size=2, seed=3)]
    remote = _remote(rollout("rlvr", group_size=2, seed=4))
    with trajstore.Recorder(dump=True, path=str(tmp_path / "d")) as rec:
        for s, b in enumerate(steps + [remote]):
            assert rec.batch(s, lambda: b) is b
    torch.save(steps + [RTensor.localize(_copy(remote))], tmp_path / "expect.pt")
    run_python(REPLAY, tmp_path / "d", tmp_path / "expect.pt")


# ----------------------------------------------------------------------------- inspection
@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    d = tmp_path_factory.mktemp("areal") / "run"
    steps = {0: rollout("rlvr", n=2, group_size=3, seed=5), 1: rollout("multi_turn", n=3, group_size=1, seed=6),
             2: rollout("vlm", n=2, group_size=2, seed=7)}
    _write(d, steps)
    return d, steps


def test_inspection_tools_count_trajectories(dump, capsys):
    d, steps = dump
    per_step = [_trajectories(b) for b in steps.values()]
    assert per_step == [6, 3, 4]
    df = trajstore.Reader(d).to_pandas()
    assert len(df) == sum(per_step) and list(df["step"]) == [0] * 6 + [1] * 3 + [2] * 4
    assert list(df["group"][:6]) == [0, 0, 0, 1, 1, 1]
    lens = [int(n) for b in steps.values() for t in b for n in t["attention_mask"].sum(-1)]
    assert [len(x) for x in df["input_ids"]] == lens
    assert list(df["rewards"][:6]) == [float(r) for t in steps[0] for r in t["rewards"]]
    check_inspection(d, per_step, capsys)
