"""A mask group's selection found from its rows' lengths (and starts) is the one found from the mask:
the same padded positions, first padded position and token index (``format/batch/masks.py``), and
``row_counts`` counts as ``mask.sum(1)`` does, whatever the mask's width, alignment or memory."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajstore.format.batch.masks import Selection, classify, host_empty, row_counts, token_mask
from trajstore.testing.bits import run_mask


@st.composite
def masks(draw):
    side = draw(st.sampled_from(["right", "left", "span"]))
    B, W = draw(st.integers(0, 6)), draw(st.integers(1, 40))
    m = run_mask(draw, B, W, side)
    if draw(st.booleans()) and B:  # some rows full: no padding there
        m[draw(st.integers(0, B - 1))] = True
    return m


@settings(max_examples=200, deadline=None)
@given(masks())
def test_selection_from_lengths_is_the_selection_from_the_mask(m):
    side, lengths, starts = classify(m)
    assert side is not None
    fast, slow = Selection(m, side, lengths, starts), Selection(m)
    assert (fast.padded is None) == (slow.padded is None) == bool(m.all())
    if slow.padded is not None:
        assert torch.equal(fast.padded, slow.padded) and fast.first == slow.first
    assert torch.equal(fast.index, slow.index) and fast.index.dtype == slow.index.dtype == torch.int64
    x = torch.randint(-9, 9, m.shape + (2,))
    assert torch.equal(fast.take(x), x[m])


@settings(max_examples=100, deadline=None)
@given(masks(), st.integers(0, 200))
def test_any_padded_sees_one_differing_padded_position(m, k):
    if m.all():
        return
    sel = Selection(m, *classify(m))
    pads = (~m).reshape(-1).nonzero().squeeze(1)
    toks = m.reshape(-1).nonzero().squeeze(1)
    differ = torch.zeros(m.shape, dtype=torch.bool)
    differ.reshape(-1)[toks] = True  # differing tokens do not count
    assert not sel.any_padded(differ.clone())
    differ.reshape(-1)[pads[k % len(pads)]] = True
    assert sel.any_padded(differ.clone())
    assert sel.any_padded(differ.clone()[..., None].expand(*m.shape, 3).contiguous())  # trailing dims


@pytest.mark.parametrize("popcount", [True, False], ids=["numpy-popcount", "byte-sum"])
@pytest.mark.parametrize("B,W,offset", [(3, 8, 0), (4, 7, 0), (2, 64, 1), (5, 16, 8), (3, 4096, 0), (0, 8, 0), (3, 0, 0)])
def test_row_counts_match_sum(B, W, offset, popcount, monkeypatch):
    if not popcount:  # numpy < 2 (no popcount), and the path a CUDA mask takes: word bytes summed by one multiply
        monkeypatch.delattr(np, "bitwise_count", raising=False)
    g = torch.Generator().manual_seed(B * 100 + W)
    flat = torch.rand(B * W + offset, generator=g) < 0.4
    m = flat[offset:].view(B, W)
    assert torch.equal(row_counts(m), m.sum(1))
    assert torch.equal(row_counts(torch.ones(B, 2 * W, dtype=torch.bool)[:, ::2]), torch.full((B,), W))


def test_a_bool_mask_is_its_own_token_mask():
    m = torch.rand(3, 5) < 0.5
    assert token_mask(m) is m
    assert torch.equal(token_mask(m.to(torch.int64) * 7), m) and torch.equal(token_mask(m[..., None].float()), m)


def test_a_mask_on_another_device_stays_there():
    """``token_mask`` of a non-CPU tensor (the recorder and the GPU replay pass CUDA masks) is built on
    that device ("meta" stands in for CUDA here; tests/test_device_pad.py runs it on a GPU)."""
    m = torch.ones(2, 8, dtype=torch.int64, device="meta")
    assert token_mask(m).device.type == "meta" and token_mask(m).dtype == torch.bool
    assert host_empty((2, 3), torch.int32, m).device.type == "meta"
    assert host_empty((2, 3), torch.int32).device.type == "cpu"


def _classify_elementwise(m):
    """``classify`` as it was written before its CPU comparisons moved to numpy and 64-bit words: every
    position compared by torch, one by one (the reference the fast paths must agree with)."""
    W = m.shape[1]
    lengths = m.sum(1)
    if m.shape[0] == 0:
        return "right", lengths, None
    ar = torch.arange(W)
    if torch.equal(m, ar[None, :] < lengths[:, None]):
        return "right", lengths, None
    if torch.equal(m, ar[None, :] >= (W - lengths)[:, None]):
        return "left", lengths, None
    starts = torch.where(lengths > 0, m.to(torch.uint8).argmax(1), 0)
    if torch.equal(m, (ar[None, :] >= starts[:, None]) & (ar[None, :] < (starts + lengths)[:, None])):
        return "span", lengths, starts
    return None, lengths, None


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from(["right", "left", "span", "holes"]), st.integers(0, 5), st.integers(1, 40),
       st.sampled_from(["contiguous", "columns", "offset"]))
def test_classify_agrees_with_the_elementwise_comparison(data, side, B, W, memory):
    """Right, left, span or holes, in contiguous memory, as columns of a wider mask (not contiguous) or at an
    odd storage offset (not whole words): the side, lengths and starts ``classify`` finds are the
    elementwise reference's."""
    m = run_mask(data.draw, B, W, "span" if side == "holes" else side)
    if side == "holes" and B:
        r, c = data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, W - 1))
        m[r, c] = ~m[r, c]
    if memory == "columns":
        wide = torch.zeros(B, W + 3, dtype=torch.bool)
        wide[:, 1:W + 1] = m
        m = wide[:, 1:W + 1]
    elif memory == "offset":
        m = torch.cat([torch.zeros(3, dtype=torch.bool), m.reshape(-1)])[3:].view(B, W)
    got, want = classify(m), _classify_elementwise(m)
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    assert (got[2] is None) == (want[2] is None) and (got[2] is None or torch.equal(got[2], want[2]))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                        torch.bfloat16, torch.float32, torch.float64]), st.integers(0, 4), st.integers(1, 24),
       st.integers(0, 2**31 - 1), st.booleans())
def test_token_mask_of_a_numeric_mask_is_its_nonzero_positions(dtype, B, W, seed, strided):
    """A mask of numbers is valid where non-zero (NaN included), whatever its dtype or memory."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (B, 2 * W if strided else W), generator=g).to(dtype)
    if dtype.is_floating_point and x.numel():
        x.view(-1)[0] = float("nan")
    x = x[:, ::2] if strided else x
    got = token_mask(x)
    assert got.dtype == torch.bool and torch.equal(got, x != 0)


@settings(max_examples=200, deadline=None)
@given(masks(), st.sampled_from([torch.uint8, torch.int16, torch.int32, torch.int64]), st.integers(0, 2**31 - 1),
       st.integers(0, 3))
def test_differ_is_any_padded_position_holding_other_bits(m, dtype, seed, trail):
    """The pad check (``Selection.differ``): whether a padded position of the bits ``b`` holds other bits
    than ``p`` (a 0-d tensor, as the encoder passes it, or an int), tokens never counted."""
    if m.all():
        return
    sel = Selection(m, *classify(m))
    g = torch.Generator().manual_seed(seed)
    shape = m.shape + ((trail,) if trail else ())
    b = torch.randint(0, 3, shape, generator=g).to(dtype)
    pads = ~m if not trail else (~m)[..., None].expand(shape)
    p = b.reshape(-1)[sel.first * max(trail, 1)]
    want = bool((b != p)[pads].any())
    assert sel.differ(b, p) == want and sel.differ(b, int(p)) == want
    b[pads] = p  # every padded position the first one's bits: no difference
    assert not sel.differ(b, p)


def test_token_mask_of_a_float_mask_that_requires_grad():
    """A float mask still attached to autograd (numpy cannot view it) is compared by torch: the same positions."""
    x = torch.tensor([[1.0, 0.5, 0.0], [0.0, 0.0, 2.0]], requires_grad=True)
    assert torch.equal(token_mask(x), torch.tensor([[True, True, False], [False, False, True]]))
