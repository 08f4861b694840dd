"""Per-token fields whose token axis is the LAST dimension (verl's Qwen2-VL mrope ``position_ids``
``[B, 4, T]``, docs/FORMAT.md 3.4): stored unpadded, each row's ``[4, n]`` block, restored exactly at
the padded width and sides, packed as ``[4, N]``; dim 1 wins where both dims match the mask width;
a file that lies about it is refused."""


import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajstore import FormatError, schema
from trajstore.format.file import validate
from trajstore.format.codec.rows import rows
from trajstore.testing import assert_batch_equal, padded_batches, two_sided_batches
from _dumps import encoded as roundtrip


def mrope(B=3, P=5, R=6, C=4, seed=0):
    """A verl-style two-sided batch with Qwen2-VL position_ids: 0 left of the prompt, the last
    position repeated right of the response (verl's padding: not one pad value)."""
    g = torch.Generator().manual_seed(seed)
    pl, rl = torch.randint(0, P + 1, (B,), generator=g), torch.randint(0, R + 1, (B,), generator=g)
    ar = torch.arange(P + R)
    am = ((ar >= P - pl[:, None]) & (ar < P + rl[:, None])).long()
    pos = torch.clamp(am.cumsum(1) - 1, min=0)
    return {"input_ids": torch.randint(0, 1000, (B, P + R), generator=g) * am, "attention_mask": am,
            "position_ids": torch.stack([pos] + [pos * (k + 2) for k in range(C - 1)], 1),
            "responses": torch.zeros(B, R, dtype=torch.long)}


def test_mrope_position_ids_are_stored_unpadded(int64_tokens):
    b = mrope(B=4, P=6, R=9)
    out, doc, t = roundtrip(b)
    assert_batch_equal(out, b)
    node = dict(doc["batch"]["keys"])["position_ids"]
    assert node["kind"] == "token" and node["axis"] == "last" and node["trail"] == [4] and node["mask"] == 0
    assert doc["format_version"] == 3
    am = b["attention_mask"].bool()
    col = t.column("position_ids").to_pylist()
    for i in range(4):  # row i: its [4, n] valid block, channel by channel
        assert col[i] == b["position_ids"][i][:, am[i]].reshape(-1).tolist()
    pad = t.column("__pad__position_ids").to_pylist()  # the padded positions' values, channel by channel
    assert [len(p) for p in pad] == (4 * (~am).sum(1)).tolist()
    assert pad[0] == b["position_ids"][0][:, ~am[0]].reshape(-1).tolist()
    packed, _, _ = roundtrip(b, "packed")
    assert torch.equal(packed["position_ids"], b["position_ids"].movedim(1, 0)[:, am])  # [4, N]
    assert packed["position_ids"].is_contiguous() and out["position_ids"].is_contiguous()
    r = rows(out, doc["batch"])
    assert [x["position_ids"].shape for x in r] == [(4, int(n)) for n in am.sum(1)]


def test_dim_one_wins_and_numpy_and_holes():
    T = 5
    am = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    sq = torch.arange(2 * T * T, dtype=torch.float32).reshape(2, T, T)  # [B, T, T]: dim 1 is the token axis
    npl = np.arange(2 * 3 * T, dtype=np.int16).reshape(2, 3, T)
    out, doc, _ = roundtrip({"attention_mask": am, "sq": sq, "npl": npl})
    assert_batch_equal(out, {"attention_mask": am, "sq": sq, "npl": npl})
    keys = dict(doc["batch"]["keys"])
    assert "axis" not in keys["sq"] and keys["sq"]["trail"] == [T]
    assert keys["npl"]["axis"] == "last" and keys["npl"]["lib"] == "numpy"
    holes = torch.tensor([[1, 0, 1, 0, 0], [1, 1, 1, 1, 1]])  # not one run: stored whole, no token axis
    b = {"attention_mask": holes, "npl": npl}
    out, doc, _ = roundtrip(b)
    assert_batch_equal(out, b)
    assert dict(doc["batch"]["keys"])["npl"] == {**dict(doc["batch"]["keys"])["npl"], "kind": "sample", "trail": [3, T]}
    assert "axis" not in dict(doc["batch"]["keys"])["npl"]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 5), st.integers(1, 6), st.integers(0, 6), st.lists(st.integers(1, 3), min_size=1, max_size=2),
       st.integers(0, 99))
def test_last_axis_any_shape_round_trips(B, P, R, channels, seed):
    b = mrope(B=B, P=P, R=R, seed=seed)
    g = torch.Generator().manual_seed(seed)
    b["position_ids"] = torch.randint(-9, 9, (B, *channels, P + R), generator=g)
    out, doc, _ = roundtrip(b)
    assert_batch_equal(out, b)
    am = b["attention_mask"].bool()
    packed, _, _ = roundtrip(b, "packed")
    if dict(doc["batch"]["keys"])["position_ids"].get("axis") == "last":
        assert torch.equal(packed["position_ids"], b["position_ids"].movedim(0, -2)[..., am])
    else:  # channels[0] == P + R: dim 1 is the token axis
        assert channels[0] == P + R and torch.equal(packed["position_ids"], b["position_ids"][am])


@settings(max_examples=40, deadline=None)
@given(st.one_of(padded_batches(), two_sided_batches()))
def test_strategies_with_last_axis_fields_round_trip(batch):
    out, _, _ = roundtrip(batch)
    assert_batch_equal(out, batch)


@pytest.mark.parametrize("lie", ["axis", "sample", "trail", "version"])
def test_a_lying_file_is_refused(lie):
    _, doc, t = roundtrip(mrope())
    node = dict(doc["batch"]["keys"])["position_ids"]
    if lie == "axis":
        node["axis"] = "first"
    elif lie == "sample":
        node["kind"] = "sample"
    elif lie == "trail":
        node["trail"] = []
    else:
        doc["format_version"] = 2
    with pytest.raises(FormatError):
        validate.check(doc, t.schema, t.num_rows, "x")
        schema.decode(t, doc["batch"], where="x")


def test_rows_that_do_not_hold_their_block_are_refused():
    _, doc, t = roundtrip(mrope())
    node = dict(doc["batch"]["keys"])["position_ids"]
    node["trail"] = [3]  # 4 channels stored, 3 claimed
    with pytest.raises(FormatError):
        validate.check(doc, t.schema, t.num_rows, "x")
        schema.decode(t, doc["batch"], where="x")


def test_rows_of_partial_tokens_are_refused_when_packed():
    am = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])  # 5 and 4 tokens of 4 channels: 20 + 16 values
    b = {"attention_mask": am, "pos": torch.arange(2 * 4 * 6).reshape(2, 4, 6)}
    _, doc, t = roundtrip(b)
    dict(doc["batch"]["keys"])["pos"]["trail"] = [3]  # 36 values are 12 tokens of 3, but row 0's 20 are not
    validate.check(doc, t.schema, t.num_rows, "x")
    with pytest.raises(FormatError, match="not whole tokens"):
        schema.decode(t, doc["batch"], where="x", layout="packed")
