"""A mask group's selection found from its rows' lengths (and starts) is the one found from the mask:
the same padded positions, first padded position and token index (``format/batch/masks.py``), and
``row_counts`` counts as ``mask.sum(1)`` does, whatever the mask's width, alignment or memory."""

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


@pytest.mark.parametrize("B,W,offset", [(3, 8, 0), (4, 7, 0), (2, 64, 1), (5, 16, 8), (0, 8, 0), (3, 0, 0)])
def test_row_counts_match_sum(B, W, offset):
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
