"""Unpadded storage of the real layouts (issue 12): verl's attention_mask padded on both sides, TRL's
prompt and completion masks; each per-token field follows its own mask, is stored unpadded and comes
back at its exact padded width and sides; ``layout="packed"`` packs each mask group."""

import json
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import trajstore
from trajstore import FormatError, Reader, Writer, schema
from trajstore.format.file import validate
from trajstore.format.spec import check_version
from trajstore.format.codec.rows import rows
from trajstore.inspection.describe import describe
from trajstore.testing import assert_batch_equal, prompt_completion_batches, two_sided_batches
from _dumps import encoded as roundtrip
from _dumps import run


def verl_batch(B=64, P=256, R=1024, seed=0):
    """verl generation output with a 4x spread of prompt and response lengths."""
    g = torch.Generator().manual_seed(seed)
    pl = torch.randint(P // 4, P + 1, (B,), generator=g)
    rl = torch.randint(R // 4, R + 1, (B,), generator=g)
    pl[0], rl[0], pl[1], rl[1] = P, R, P // 4, R // 4
    ar = torch.arange(P + R)
    am = ((ar >= P - pl[:, None]) & (ar < P + rl[:, None])).long()
    ids = torch.randint(0, 150_000, (B, P + R), generator=g) * am
    rm = am[:, P:]
    lp = (-torch.rand(B, R, generator=g) * 5) * rm
    return {"prompts": ids[:, :P], "responses": ids[:, P:], "response_mask": rm, "input_ids": ids,
            "attention_mask": am, "position_ids": torch.clamp(am.cumsum(1) - 1, min=0),
            "old_log_probs": lp, "ref_log_prob": lp.to(torch.bfloat16), "advantages": lp * 0.5,
            "token_level_rewards": torch.zeros(B, R), "rewards": torch.rand(B, generator=g)}


def trl_batch(B=64, P=256, C=1024, seed=1):
    g = torch.Generator().manual_seed(seed)
    pl = torch.randint(P // 4, P + 1, (B,), generator=g)
    cl = torch.randint(C // 4, C + 1, (B,), generator=g)
    pl[0], cl[0], pl[1], cl[1] = P, C, P // 4, C // 4
    pm = (torch.arange(P) >= P - pl[:, None]).long()
    cm = (torch.arange(C) < cl[:, None]).long()
    pad = 151643
    return {"prompt_ids": torch.randint(0, 150_000, (B, P), generator=g).masked_fill(pm == 0, pad),
            "prompt_mask": pm,
            "completion_ids": torch.randint(0, 150_000, (B, C), generator=g).masked_fill(cm == 0, pad),
            "completion_mask": cm, "old_per_token_logps": -torch.rand(B, C, generator=g) * cm,
            "ref_per_token_logps": (-torch.rand(B, C, generator=g)).to(torch.bfloat16),  # pad: garbage
            "advantages": torch.randn(B, generator=g), "num_items_in_batch": torch.tensor(int(cm.sum()))}


def version(batch, base):
    """The format version a step of ``batch`` records: ``base``, or 3 where it holds a
    half-precision tensor (stored widened, docs/FORMAT.md 3.2)."""
    half = any(isinstance(v, torch.Tensor) and v.dtype in (torch.bfloat16, torch.float16) for v in batch.values())
    return 3 if half else base


def padded_bytes(batch):
    return sum(v.numel() * v.element_size() for v in batch.values() if v.ndim >= 2)


@pytest.mark.parametrize("make", [verl_batch, trl_batch])
def test_bytes_on_disk_half_the_padded_tensors(tmp_path, make, int64_tokens):
    batch = make()
    with Writer(tmp_path) as w:
        w.append(0, batch)
    f = tmp_path / "train" / "step_00000000.parquet"
    assert f.stat().st_size <= 0.5 * padded_bytes(batch), (f.stat().st_size, padded_bytes(batch))
    r = Reader(tmp_path)
    spec = r.info(0)["batch"]
    assert spec["form"] == "masked" and r.info(0)["format_version"] == version(batch, 2)
    for k, node in spec["keys"]:
        if batch[k].ndim >= 2:
            assert node["kind"] == "token", k  # every per-token field stored unpadded
    assert_batch_equal(r.read(0), batch)


def test_verl_packed_and_rows(tmp_path):
    batch = verl_batch(B=6, P=8, R=16)
    with Writer(tmp_path) as w:
        w.append(0, batch)
    r = Reader(tmp_path)
    spec = r.info(0)["batch"]
    assert [(g["key"], g["side"]) for g in spec["masks"]] == [("", "span"), ("prompt", "left"), ("response", "right")]
    am = batch["attention_mask"].bool()
    p = r.read(0, layout="packed")
    assert "attention_mask" not in p and "response_mask" in p  # the layout masks go, the others stay
    assert torch.equal(p["input_ids"], batch["input_ids"][am])
    assert torch.equal(p["cu_seqlens"][1:].long(), am.sum(1).cumsum(0))
    assert torch.equal(p["responses"], batch["responses"][am[:, 8:]])
    assert torch.equal(p["response_cu_seqlens"][1:].long(), am[:, 8:].sum(1).cumsum(0))
    assert torch.equal(p["prompts"], batch["prompts"][am[:, :8]])
    assert p["prompt_max_seqlen"] == int(am[:, :8].sum(1).max())
    assert torch.equal(p["rewards"], batch["rewards"])
    rs = rows(r.read(0), spec)
    for i, row in enumerate(rs):
        assert np.array_equal(row["input_ids"], batch["input_ids"][i][am[i]].numpy())
        assert np.array_equal(row["responses"], batch["responses"][i][am[i, 8:]].numpy())
        assert np.array_equal(row["prompts"], batch["prompts"][i][am[i, :8]].numpy())
        assert len(row["old_log_probs"]) == int(am[i, 8:].sum())
    assert describe(tmp_path)["splits"]["train"]["tokens"] == int(am.sum())
    assert len(r.to_pandas(0)) == 6
    assert trajstore.diff(tmp_path, tmp_path).identical
    # one field alone: its starts column comes with it
    assert torch.equal(r.read(0, columns=["input_ids"])["input_ids"], batch["input_ids"])


def test_trl_packed_rows_and_cli(tmp_path):
    batch = trl_batch(B=5, P=6, C=9)
    with Writer(tmp_path) as w:
        w.append(0, batch)
    r = Reader(tmp_path)
    pm, cm = batch["prompt_mask"].bool(), batch["completion_mask"].bool()
    p = r.read(0, layout="packed")
    assert "prompt_mask" not in p and "completion_mask" not in p and "cu_seqlens" not in p
    assert torch.equal(p["completion_ids"], batch["completion_ids"][cm])
    assert torch.equal(p["old_per_token_logps"], batch["old_per_token_logps"][cm])
    assert torch.equal(p["prompt_ids"], batch["prompt_ids"][pm])
    assert torch.equal(p["completion_cu_seqlens"][1:].long(), cm.sum(1).cumsum(0))
    assert torch.equal(p["prompt_cu_seqlens"][1:].long(), pm.sum(1).cumsum(0))
    rs = rows(r.read(0), r.info(0)["batch"])
    for i, row in enumerate(rs):
        assert np.array_equal(row["completion_ids"], batch["completion_ids"][i][cm[i]].numpy())
        assert np.array_equal(row["prompt_ids"], batch["prompt_ids"][i][pm[i]].numpy())
        assert row["ref_per_token_logps"].shape == (int(cm[i].sum()),)
    assert describe(tmp_path)["splits"]["train"]["tokens"] == int(pm.sum() + cm.sum())
    df = r.to_pandas(0)
    assert len(df) == 5 and [len(x) for x in df["completion_ids"]] == cm.sum(1).tolist()
    assert "trajectory 4 of 5" in run("show", tmp_path, "--step", 0, "--sample", 4).stdout
    assert run("diff", tmp_path, tmp_path).stdout.splitlines()[-1] == "identical"
    recs = [json.loads(x) for x in run("export", tmp_path, "--format", "jsonl").stdout.splitlines()]
    assert len(recs) == 5


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(two_sided_batches())
def test_two_sided_roundtrip(int64_tokens, batch):
    out, doc, _ = roundtrip(batch)
    assert_batch_equal(out, batch)
    spec = doc["batch"]
    am = batch["attention_mask"] != 0
    last = any(n.get("axis") == "last" for _, n in spec["keys"])  # mrope position_ids [B, 4, T]: version 3
    assert doc["format_version"] == (3 if last else version(batch, 2 if spec["form"] == "masked" else 1))
    if spec["masks"][0]["side"] is not None:
        p, _, _ = roundtrip(batch, "packed")
        assert torch.equal(p["input_ids"], batch["input_ids"][am])
        assert p["max_seqlen"] == (int(am.sum(1).max()) if len(am) else 0)
    else:  # holes: stored whole, bit-exact, and not packed
        assert dict(spec["keys"])["input_ids"]["kind"] == "sample"
        with pytest.raises(trajstore.ConfigError, match="holes"):
            roundtrip(batch, "packed")


@settings(max_examples=60, deadline=None)
@given(prompt_completion_batches())
def test_prompt_completion_roundtrip(batch):
    out, doc, _ = roundtrip(batch)
    assert_batch_equal(out, batch)
    spec = doc["batch"]
    assert spec["form"] == "masked" and [g["src"] for g in spec["masks"]] == ["prompt_mask", "completion_mask"]
    keys = dict(spec["keys"])
    cm = batch["completion_mask"] != 0
    if spec["masks"][1]["side"] is not None:
        assert keys["completion_ids"]["kind"] == "token" and keys["completion_ids"]["mask"] == 1
        p, _, _ = roundtrip(batch, "packed")
        assert torch.equal(p["completion_ids"], batch["completion_ids"][cm])
        assert "tool_mask" not in batch or torch.equal(p["tool_mask"], batch["tool_mask"][cm])


def test_mrope_position_ids_are_not_a_response_field():
    """verl's Qwen2-VL position_ids [B, 4, T] with R == 4: only 2-D fields follow verl's parts; it
    follows the whole attention_mask on its last axis (tests/test_layouts_last_axis.py)."""
    batch = verl_batch(B=3, P=5, R=4)
    batch["position_ids"] = batch["position_ids"][:, None].expand(3, 4, 9).contiguous()
    out, doc, _ = roundtrip(batch)
    assert_batch_equal(out, batch)
    keys = dict(doc["batch"]["keys"])
    assert keys["position_ids"]["kind"] == "token" and keys["position_ids"]["mask"] == 0
    assert keys["position_ids"]["axis"] == "last" and keys["position_ids"]["trail"] == [4]
    assert keys["old_log_probs"]["mask"] == 2


def test_right_left_single_mask_unchanged(int64_tokens):
    """A batch with one right- or left-aligned attention_mask keeps form padded, format version 1."""
    am = torch.tensor([[1, 1, 0], [1, 0, 0]])
    for m in (am, am.flip(1)):
        _, doc, t = roundtrip({"input_ids": m * 7, "attention_mask": m})
        assert doc["format_version"] == 1 and doc["batch"]["form"] == "padded"
        assert "masks" not in doc["batch"] and not any(f.name.startswith("__start__") for f in t.schema)


def test_declared_masks_when_names_do_not_tell(tmp_path):
    """P == C: old_per_token_logps could follow either mask; stored whole unless declared."""
    batch = trl_batch(B=4, P=8, C=8)
    _, doc, _ = roundtrip(batch)
    assert dict(doc["batch"]["keys"])["old_per_token_logps"]["kind"] == "sample"
    assert dict(doc["batch"]["keys"])["completion_ids"]["kind"] == "token"  # X_ids follows X_mask
    masks = {"completion_mask": ["old_per_token_logps", "ref_per_token_logps"]}
    with Writer(tmp_path, masks=masks) as w:
        w.append(0, batch)
    node = dict(Reader(tmp_path).info(0)["batch"]["keys"])["old_per_token_logps"]
    assert node["kind"] == "token" and node["mask"] == 1
    assert_batch_equal(Reader(tmp_path).read(0), batch)
    with pytest.raises(trajstore.BatchError, match="declared"):
        roundtrip({**batch, "advantages": torch.zeros(4, 3)}, masks={"completion_mask": ["advantages"]})
    with pytest.raises(trajstore.BatchError, match="not a"):
        roundtrip(batch, masks={"nope": []})
    with pytest.raises(trajstore.ConfigError):
        Writer(tmp_path, masks={"completion_mask": "old_per_token_logps"})


def test_inferred_mask_of_other_values_is_stored_whole():
    """An X_mask next to X_ids that is not 0/1 is no mask: its fields are stored whole, exactly."""
    batch = {"x_ids": torch.ones(2, 3, dtype=torch.int64), "x_mask": torch.tensor([[2, 1, 0], [1, 1, 1]])}
    out, doc, _ = roundtrip(batch)
    assert_batch_equal(out, batch)
    assert doc["batch"]["masks"][0]["side"] is None


def _lie(doc, t, f):
    d = json.loads(json.dumps(doc))
    f(d["batch"])
    return d


@pytest.mark.parametrize("lie", [
    lambda b: b["masks"][0].update(W=10**6),
    lambda b: b["masks"][0].update(lo=5),
    lambda b: b["masks"][0].update(side="middle"),
    lambda b: b["masks"][0].pop("start_col"),
    lambda b: b["masks"][1].update(start_col="__start__attention_mask"),
    lambda b: b["masks"][0].update(src="responses_typo"),
    lambda b: b["masks"].append(dict(b["masks"][1])),
    lambda b: b["keys"][0][1].update(mask=7),
    lambda b: b["keys"][0][1].update(mask="0"),
    lambda b: b["keys"][0][1].pop("mask"),
    lambda b: b.update(masks=[]),
])
def test_lying_masks_raise(lie):
    batch = verl_batch(B=3, P=4, R=6)
    t = schema.encode(batch, step=0, split="train")
    doc = json.loads(t.schema.metadata[b"trajstore"])
    with pytest.raises(FormatError):
        d = _lie(doc, t, lie)
        validate.check(d, t.schema, t.num_rows, "x")
        schema.decode(t, d["batch"], where="x")


def test_lying_starts_raise(tmp_path):
    batch = verl_batch(B=3, P=4, R=6)
    t = schema.encode(batch, step=0, split="train")
    doc = json.loads(t.schema.metadata[b"trajstore"])
    i = t.schema.get_field_index("__start__attention_mask")
    for bad in ([0, 0, 9], [-1, 0, 0]):
        t2 = t.set_column(i, t.schema.field(i), [np.array(bad, dtype=np.int64)])
        with pytest.raises(FormatError, match="outside its width"):
            schema.decode(t2, doc["batch"], where="x")


def test_old_reader_refuses(tmp_path, int64_tokens):
    """The step records format version 2, which a version-1 reader refuses (section 5); a file that
    claims version 1 for a masked batch is refused as damaged."""
    with Writer(tmp_path) as w:
        w.append(0, trl_batch(B=2, P=3, C=5))
    f = tmp_path / "train" / "step_00000000.parquet"
    schema_ = pq.read_schema(f)
    doc = json.loads(schema_.metadata[b"trajstore"])
    assert doc["format_version"] == version(trl_batch(B=2, P=3, C=5), 2) and doc["batch"]["form"] == "masked"
    with pytest.raises(trajstore.FormatVersionError, match="upgrade"):
        check_version(doc["format_version"], str(f), "step file", newest=1)
    with pytest.raises(FormatError, match="format version 1"):
        validate.check({**doc, "format_version": 1}, schema_, 2, str(f))
