"""A mask with holes declared through ``Writer(masks=...)`` (a multi-turn loss mask): its fields stay
per-token columns, one run per trajectory from its first to its last masked token, the holes kept in
the mask's own column (docs/FORMAT.md 3.4, format version 5); ``read(layout="packed")`` packs them,
and the device path builds the same bits as the CPU decode."""

import json
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_device_pad import device_read

import trajstore
from trajstore import FormatError, schema
from trajstore.format.file import validate
from trajstore.testing import assert_batch_equal, tensors
from _dumps import encoded

MASKS = {"loss_mask": ["advantages", "old_logprobs"]}


@st.composite
def multi_turn_batches(draw):
    """A right-padded batch whose declared ``loss_mask`` marks several turns (holes between them) within
    each row's tokens; its fields hold arbitrary values at the unmasked positions (or zeros)."""
    B, T = draw(st.integers(0, 5)), draw(st.integers(1, 12))
    n = torch.tensor(draw(st.lists(st.integers(0, T), min_size=B, max_size=B)), dtype=torch.long)
    am = torch.arange(T)[None, :] < n[:, None]
    lm = draw(tensors((B, T), [torch.bool])) & am
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    adv = draw(tensors((B, T), [dtype]))
    if draw(st.booleans()):
        adv = adv * lm
    return {"input_ids": draw(tensors((B, T), [torch.int64])) * am, "attention_mask": am.long(),
            "loss_mask": lm.to(draw(st.sampled_from([torch.bool, torch.int64, torch.float32]))),
            "advantages": adv, "old_logprobs": draw(tensors((B, T, 2), [torch.float32]))}


def _extent(lm):
    """Each row's first and one-past-last masked position."""
    m = lm != 0
    T = m.shape[1]
    first = m.to(torch.uint8).argmax(1)
    end = T - m.flip(1).to(torch.uint8).argmax(1)
    return [(int(a), int(b)) if r.any() else (0, 0) for a, b, r in zip(first, end, m)]


def _roundtrip(batch, layout=None):
    return encoded(batch, layout, masks=MASKS)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(multi_turn_batches())
def test_declared_masks_with_holes_round_trip_unpadded(int64_tokens, batch):
    out, doc, t = _roundtrip(batch)
    assert_batch_equal(batch, out)
    spec = doc["batch"]
    g = next(g for g in spec["masks"] if g["src"] == "loss_mask")
    keys = dict(spec["keys"])
    assert all(keys[k]["kind"] == "token" for k in ["loss_mask"] + MASKS["loss_mask"])
    runs = _extent(batch["loss_mask"])
    assert [len(x) for x in t.column("advantages").to_pylist()] == [b - a for a, b in runs]
    holes = any(bool((batch["loss_mask"][i, a:b] == 0).any()) for i, (a, b) in enumerate(runs))
    assert g.get("holes", False) is holes and (doc["format_version"] == 5) is holes
    p, _, _ = _roundtrip(batch, "packed")
    want = [batch["loss_mask"][i, a:b] for i, (a, b) in enumerate(runs)]
    if holes:  # kept where it says which tokens count; a mask without holes is left out as before
        assert torch.equal(p["loss_mask"], torch.cat(want))
    else:
        assert "loss_mask" not in p
    assert p["loss_cu_seqlens"].tolist() == [0] + torch.tensor([b - a for a, b in runs]).cumsum(0).tolist()
    adv = [batch["advantages"][i, a:b] for i, (a, b) in enumerate(runs)]
    assert torch.equal(p["advantages"].view(torch.int16 if batch["advantages"].dtype == torch.bfloat16
                                            else torch.int32),
                       (torch.cat(adv) if adv else batch["advantages"].reshape(-1)).view(
                           torch.int16 if batch["advantages"].dtype == torch.bfloat16 else torch.int32))
    with tempfile.TemporaryDirectory() as d:
        with trajstore.Writer(d, masks=MASKS) as w:
            w.append(0, batch)
        r = trajstore.Reader(d)
        got, _ = device_read(r, 0)
        assert_batch_equal(r[0], got)
        assert_batch_equal(batch, got)


def test_multi_turn_loss_mask_in_sql_and_packed(tmp_path, int64_tokens):
    B, T = 3, 10
    am = torch.zeros(B, T, dtype=torch.long)
    am[0, :8], am[1, :10], am[2, :5] = 1, 1, 1
    lm = torch.zeros(B, T, dtype=torch.long)
    lm[0, 2:4], lm[0, 6:8], lm[1, 3:10], lm[2, 4] = 1, 1, 1, 1
    lm[1, 5] = 0
    b = {"input_ids": torch.arange(B * T).reshape(B, T) * am, "attention_mask": am, "loss_mask": lm,
         "advantages": torch.randn(B, T) * lm, "old_logprobs": torch.randn(B, T, 2)}
    with trajstore.Writer(tmp_path, masks=MASKS) as w:
        w.append(0, b)
    r = trajstore.Reader(tmp_path)
    assert_batch_equal(b, r[0])
    assert r.info(0)["format_version"] == 5
    got = r.duckdb().sql("select len(advantages), len(loss_mask), list_sum(loss_mask) from train").fetchall()
    assert got == [(6, 6, 4), (7, 7, 6), (1, 1, 1)]  # a run per trajectory, its holes in loss_mask
    p = r.read(0, layout="packed")
    assert p["loss_mask"].tolist() == [1, 1, 0, 0, 1, 1] + [1, 1, 0, 1, 1, 1, 1] + [1]
    assert torch.equal(p["advantages"][p["loss_mask"].bool()], b["advantages"][lm.bool()])
    df = r.to_pandas()  # each row's run, as SQL
    assert [list(x) for x in df["loss_mask"]] == [[1, 1, 0, 0, 1, 1], [1, 1, 0, 1, 1, 1, 1], [1]]
    roles = [(m["role"], m["ids"]) for m in trajstore.traces(r, 0)[0]["messages"]]
    assert roles == [("prompt", [0, 1]), ("model", [2, 3]), ("env", [4, 5]), ("model", [6, 7])]


def test_an_older_version_with_holes_is_refused(int64_tokens):
    b = {"attention_mask": torch.ones(1, 4, dtype=torch.long), "loss_mask": torch.tensor([[1, 0, 1, 0]]),
         "advantages": torch.randn(1, 4)}
    t = schema.encode_plain(b, None, step=0, split="train", masks={"loss_mask": ["advantages"]})
    doc = json.loads(t.schema.metadata[b"trajstore"])
    assert doc["format_version"] == 5
    validate.check(doc, t.schema, t.num_rows, "x")
    with pytest.raises(FormatError, match="needs 5"):
        validate.check({**doc, "format_version": 4}, t.schema, t.num_rows, "x")


@settings(max_examples=20, deadline=None)
@given(multi_turn_batches(), multi_turn_batches())
def test_shards_with_and_without_holes_join(a, b):
    """Two ranks' shards of one step (one may have no holes, or another width): joined, every row exact."""
    import numpy as np
    import pyarrow as pa

    from trajstore.format.shard.shards import RANK_COLUMN, join

    b = {k: (v.to(a[k].dtype) if k != "loss_mask" else v.to(a["loss_mask"].dtype)) for k, v in b.items()}
    parts = []
    for r, x in enumerate((a, b)):
        t = schema.encode_plain(x, None, step=0, split="train", masks=MASKS)
        doc = json.loads(t.schema.metadata[b"trajstore"]) | {"shard": {"rank": r, "world_size": 2}}
        parts.append((doc, t.append_column(pa.field(RANK_COLUMN, pa.int32()), pa.array(np.full(t.num_rows, r, np.int32)))))
    doc, t = join(parts)
    validate.check(doc, t.schema, t.num_rows, "joined")
    out = schema.decode(t, doc["batch"], where="joined")
    B = len(a["loss_mask"])
    for k in a:
        for i in range(len(out[k])):
            x, src = (a, i) if i < B else (b, i - B)
            w, W = x[k].shape[1], out[k].shape[1]
            want = x[k][src].view(torch.uint8) if x[k].dtype.is_floating_point else x[k][src]
            row = (out[k][i].view(torch.uint8) if out[k].dtype.is_floating_point else out[k][i]).reshape(-1)
            step = row.numel() // W if W else 0
            assert torch.equal(row[:w * step], want.reshape(-1)) or torch.equal(row[(W - w) * step:], want.reshape(-1))
