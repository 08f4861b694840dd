"""Hypothesis strategies for every batch form trajstore stores, and an exact comparison.

Use them to test your own integration::

    from hypothesis import given
    from trajstore.testing import batches, assert_batch_equal

    @given(batches())
    def test_my_roundtrip(batch): ...

Needs ``hypothesis`` (``pip install trajstore[test]``). The public names are this package's ``__all__``;
its modules are internal:

* ``bits`` - tensors and numpy arrays of arbitrary bits of every dtype, masks and padded values;
* ``forms`` - the batch forms of tensor fields (padded, lists, groups, packed, multimodal, two-sided,
  prompt/completion, images);
* ``values`` - non-tensor values and the batches that hold them (verl's ``non_tensor_batch``, typed values);
* ``compare`` - ``assert_batch_equal``.

May import: ``trajstore.format`` (the batch containers, dtypes), ``trajstore.errors``; torch, numpy and
hypothesis. Nothing imports it but users' tests and the project's own.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from .bits import TORCH_DTYPES, tensors
from .compare import assert_batch_equal
from .forms import (
    group_lists,
    image_batches,
    multimodal_batches,
    packed_batches,
    padded_batches,
    prompt_completion_batches,
    trajectory_lists,
    two_sided_batches,
)
from .values import non_tensor_batches, non_tensor_values, typed_batches, typed_values

__all__ = [
    "TORCH_DTYPES",
    "tensors",
    "padded_batches",
    "trajectory_lists",
    "group_lists",
    "packed_batches",
    "multimodal_batches",
    "non_tensor_values",
    "non_tensor_batches",
    "typed_values",
    "typed_batches",
    "two_sided_batches",
    "prompt_completion_batches",
    "image_batches",
    "batches",
    "assert_batch_equal",
]


def batches() -> st.SearchStrategy[Any]:
    """Any batch form trajstore accepts."""
    return st.one_of(padded_batches(), trajectory_lists(), group_lists(), packed_batches(), multimodal_batches(),
                     non_tensor_batches(), typed_batches(), two_sided_batches(), prompt_completion_batches(),
                     image_batches())
