"""One batch checker: ``Writer.append``'s structure check (``format.check.check``) and the encoder
(``schema.encode``) walk a batch the same way, so a batch that cannot be stored gives the same
error, class and message, on both paths; the append-time check never reads a tensor's values."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_malformed import BATCHES, ok

from trajstore import schema
from trajstore.errors import TrajstoreError
from trajstore.format.batch import check, containers
from trajstore.testing import assert_batch_equal, batches

# only values show these (an attention mask of other values than 0/1): the encoder finds them
VALUE_CASES = {"mask_not_0_1", "mask_negative", "mask_float_half", "mask_nan"}
# a packed batch's N is cu_seqlens[-1]: read at append only where cu_seqlens is in CPU memory
NEEDS_N = {"cu_seqlens_not_from_0", "cu_seqlens_decreasing", "packed_field_wrong_N"}


def _error(fn, batch):
    try:
        fn(batch)
    except TrajstoreError as e:
        return type(e), str(e)
    return None


def _at_append(batch):
    check.check(containers.unwrap(batch)[0])


def _encode(batch):
    schema.encode(batch, step=0, split="train")


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_append_check_and_encoder_raise_the_same_error(name):
    make, exc, msg = BATCHES[name]
    enc = _error(_encode, make())
    assert enc is not None and issubclass(enc[0], exc), enc
    got = _error(_at_append, make())
    if name in VALUE_CASES:
        assert got is None, got
    else:
        assert got == enc


class _OnGpu(torch.Tensor):
    """A tensor that says it lives on a GPU and fails on any read of its values."""

    META = {"shape", "dtype", "layout", "ndim", "dim", "size", "__len__", "numel", "__repr__"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        fn = getattr(func, "__self__", None) if getattr(func, "__name__", "") == "__get__" else func
        name = getattr(fn, "__name__", "")
        if name == "device":
            return torch.device("cuda")
        if name in cls.META:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise AssertionError(f"the append-time check read a tensor's values ({name})")


def _on_gpu(v, depth: int = 0):
    """The batch with its strided CPU tensors (inside dicts and lists) on the pretend GPU."""
    if isinstance(v, torch.Tensor):
        ok = depth and v.layout == torch.strided and v.device.type == "cpu"
        return v.as_subclass(_OnGpu) if ok else v
    if isinstance(v, Mapping) and depth < 50:
        return {k: _on_gpu(x, depth + 1) for k, x in v.items()}
    if isinstance(v, list | tuple) and depth < 50:
        return type(v)(_on_gpu(x, depth + 1) for x in v)
    return v


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_append_check_reads_no_gpu_values(name):
    """On a GPU the check looks at dtypes and shapes only: the same error, or (where only values
    or N tell) none."""
    make, _, _ = BATCHES[name]
    got = _error(_at_append, _on_gpu(make()))
    if name in VALUE_CASES | NEEDS_N:
        assert got is None, got
    else:
        assert got == _error(_at_append, make())


def test_append_check_of_a_valid_gpu_batch():
    check.check(_on_gpu(ok()))
    check.check(_on_gpu({"x": torch.zeros(5), "cu_seqlens": torch.tensor([0, 2, 5]), "r": torch.zeros(2)}))
    check.check(_on_gpu([{"ids": torch.arange(3), "uid": "a"}, None]))


# malformations injected into any batch form: both paths give the same error
_BAD = {
    "complex": lambda B: torch.zeros(B, dtype=torch.complex64),
    "wrong_rows": lambda B: torch.zeros(B + 3),
    "wrong_entries": lambda B: ["x"] * (B + 1),
    "opaque": lambda B: object(),
    "non_str_key": lambda B: {1: torch.zeros(B)},
    "mixed": lambda B: [torch.zeros(1)] + ["x"] * (B - 1),
    "cells_dtypes": lambda B: [torch.zeros(1, dtype=torch.int8)] + [torch.zeros(1)] * (B - 1),
    "surrogate": lambda B: ["\ud800"] * B,
    "bytes": lambda B: [b"x"] * B,
    "big_int": lambda B: [2**70] * B,
    "set": lambda B: [{1}] * B,
    "reserved": None,
    "meta_device": lambda B: torch.empty(B, device="meta"),
}


def _inject(batch, bad: str, where: int):
    if isinstance(batch, list | tuple):  # a list of trajectory dicts: the malformation in one row
        rows = [dict(r) if isinstance(r, Mapping) else r for r in batch] or [None]
        i = where % len(rows)
        if rows[i] is None:
            rows[i] = {}
        rows[i]["bad"] = _BAD[bad](1) if _BAD[bad] else torch.zeros(1)
        if bad == "reserved":
            rows[i] = {"step": torch.zeros(1), **rows[i]}
        return type(batch)(rows)
    B = max(1, check.plan(batch).n)
    items = list(batch.items())
    value = torch.zeros(B) if bad == "reserved" else _BAD[bad](B)
    items.insert(where % (len(items) + 1), ("step" if bad == "reserved" else "bad", value))
    return dict(items)


@given(batches(), st.sampled_from(sorted(_BAD)), st.integers(0, 50))
def test_injected_malformations_give_the_same_error(batch, bad, where):
    b = _inject(batch, bad, where)
    enc = _error(_encode, b)
    got = _error(_at_append, b)
    if got is not None:
        assert got == enc
    elif enc is not None:  # the check let it through: only values can show it
        assert "0 or 1" in enc[1] or "cu_seqlens" in enc[1], enc


@given(batches())
def test_valid_batches_pass_the_check_and_round_trip(batch):
    check.check(containers.unwrap(batch)[0])
    t = schema.encode(batch, step=0, split="train")
    spec = json.loads(t.schema.metadata[b"trajstore"])["batch"]
    assert_batch_equal(schema.decode(t, spec, where="mem"), batch)
