"""Every batch form round-trips bit for bit (property-based)."""

import numpy as np
import pytest
import torch
from _dumps import roundtrip
from hypothesis import given
from hypothesis import strategies as st

from trajstore.testing import (
    TORCH_DTYPES,
    assert_batch_equal,
    batches,
    multimodal_batches,
    non_tensor_batches,
    packed_batches,
    padded_batches,
    tensors,
    trajectory_lists,
)

# one strategy per batch form trajstore stores
FORMS = {
    "padded": padded_batches,
    "trajectory_list": trajectory_lists,
    "packed": packed_batches,
    "multimodal": multimodal_batches,
    "non_tensor": non_tensor_batches,
}


@pytest.mark.parametrize("form", list(FORMS))
@given(data=st.data())
def test_every_form_roundtrips(form, data):
    batch = data.draw(FORMS[form](), label=form)
    assert_batch_equal(batch, roundtrip(batch)[0])


@given(st.integers(0, 5), st.integers(0, 3), st.data())
def test_every_dtype_any_shape(B, k, data):
    dtype = data.draw(st.sampled_from(TORCH_DTYPES))
    batch = {
        "sample": data.draw(tensors((B,), [dtype])),
        "sample_k": data.draw(tensors((B, k, 2), [dtype])),
        "np": data.draw(tensors((B, k), numpy=True)),
        "scalar": data.draw(tensors((), [dtype])),
    }
    assert_batch_equal(batch, roundtrip(batch)[0])


@given(batches(), st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5) | st.none()))
def test_any_batch_with_meta(batch, meta):
    out, m = roundtrip(batch, meta)
    assert_batch_equal(batch, out)
    assert m == meta


def test_empty_batches_and_zero_length():
    for batch in ({}, [], {"input_ids": torch.zeros(0, 4, dtype=torch.int64),
                           "attention_mask": torch.zeros(0, 4, dtype=torch.bool)},
                  {"input_ids": torch.zeros(2, 0, dtype=torch.int32),
                   "attention_mask": torch.zeros(2, 0, dtype=torch.bool)},
                  [None, None], [{"input_ids": torch.zeros(0, dtype=torch.int64)}]):
        assert_batch_equal(batch, roundtrip(batch)[0])


def test_padding_side_and_width_restored():
    T = 16  # padded to a multiple of 8, wider than the longest sequence (5)
    for side in ("left", "right"):
        m = torch.zeros(2, T, dtype=torch.bool)
        if side == "right":
            m[0, :3], m[1, :5] = True, True
        else:
            m[0, -3:], m[1, -5:] = True, True
        ids = torch.arange(2 * T).reshape(2, T).masked_fill(~m, 151643)
        out = roundtrip({"input_ids": ids, "attention_mask": m})[0]
        assert out["input_ids"].shape == (2, T)
        assert torch.equal(out["input_ids"], ids) and torch.equal(out["attention_mask"], m)


def test_numpy_arrays_come_back_as_numpy():
    batch = {"a": np.arange(6, dtype=np.uint32).reshape(3, 2), "s": np.array(["x", "yy", "z"])}
    out = roundtrip(batch)[0]
    assert isinstance(out["a"], np.ndarray) and out["a"].dtype == np.uint32
    assert out["s"].dtype == np.dtype("<U2")
    assert_batch_equal(batch, out)
