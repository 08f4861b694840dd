"""Malformed batches are rejected before anything is written, with an error naming the field
and the problem; no step file and no temporary file is left behind."""

import os

import numpy as np
import pytest
import torch
from _dumps import write

import trajstore
from trajstore import schema
from trajstore.errors import BatchError, ConfigError, TrajstoreError, UnsupportedTypeError
from trajstore.testing import assert_batch_equal

B, T = 3, 5
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])


def ok():
    return {"input_ids": torch.arange(B * T).reshape(B, T), "attention_mask": MASK.clone(),
            "rewards": torch.zeros(B)}


def with_(**kw):
    b = ok()
    b.update(kw)
    return b


def _nested(depth, leaf):
    """``leaf`` inside ``depth - 1`` dicts: a field at spec depth ``depth``."""
    for _ in range(depth - 1):
        leaf = {"k": leaf}
    return leaf


class _Opaque:
    pass


# name -> (batch factory, exception class, regex naming the field and the problem)
BATCHES = {
    "field_rows_mismatch": (lambda: with_(rewards=torch.zeros(B + 1)), BatchError, "'rewards'.*leading dimension is 4"),
    "token_field_wrong_T": (lambda: with_(logprobs=torch.zeros(B + 2, T + 1)), BatchError, "'logprobs'.*leading dimension"),
    "list_rows_mismatch": (lambda: with_(uid=["a", "b"]), BatchError, "'uid'.*2 entries.*3 trajectories"),
    "mask_not_0_1": (lambda: with_(attention_mask=MASK * 2), BatchError, "'attention_mask'.*0 or 1"),
    "mask_negative": (lambda: with_(attention_mask=-MASK), BatchError, "'attention_mask'.*0 or 1"),
    "mask_float_half": (lambda: with_(attention_mask=MASK.float() * 0.5), BatchError, "'attention_mask'.*0 or 1"),
    "mask_nan": (lambda: with_(attention_mask=MASK.float().masked_fill(MASK == 0, float("nan"))),
                 BatchError, "'attention_mask'.*0 or 1"),
    "cu_seqlens_not_from_0": (lambda: {"x": torch.zeros(5), "cu_seqlens": torch.tensor([1, 3, 5])},
                              BatchError, "'cu_seqlens'.*starting at 0"),
    "cu_seqlens_decreasing": (lambda: {"x": torch.zeros(5), "cu_seqlens": torch.tensor([0, 4, 2, 5])},
                              BatchError, "'cu_seqlens'.*non-decreasing"),
    "cu_seqlens_float": (lambda: {"x": torch.zeros(5), "cu_seqlens": torch.tensor([0.0, 2.0, 5.0])},
                         BatchError, "'cu_seqlens'.*integer"),
    "cu_seqlens_nan": (lambda: {"x": torch.zeros(5), "cu_seqlens": torch.tensor([0.0, float("nan"), 5.0])},
                       BatchError, "'cu_seqlens'.*integer"),
    "cu_seqlens_empty": (lambda: {"x": torch.zeros(5), "cu_seqlens": torch.tensor([], dtype=torch.int64)},
                         BatchError, "'cu_seqlens'.*non-empty"),
    "packed_field_wrong_N": (lambda: {"x": torch.zeros(7), "cu_seqlens": torch.tensor([0, 2, 5])},
                             BatchError, "'x'.*leading dimension is 7"),
    "complex_dtype": (lambda: with_(c=torch.zeros(B, dtype=torch.complex64)), UnsupportedTypeError, "'c'.*complex64"),
    "quantized_or_float8": (lambda: with_(q=torch.zeros(B).to(torch.float8_e4m3fn)), UnsupportedTypeError, "'q'.*float8"),
    "numpy_big_endian": (lambda: with_(c=np.zeros(B, dtype=">f4")), UnsupportedTypeError, "'c'.*>f4"),
    "numpy_float128": (lambda: with_(d=np.zeros(B, dtype=np.longdouble)), UnsupportedTypeError, "'d'.*float128"),
    "sparse_tensor": (lambda: with_(s=torch.eye(B).to_sparse()), UnsupportedTypeError, "'s'.*sparse.*to_dense"),
    "meta_device_tensor": (lambda: with_(m=torch.empty(B, device="meta")), UnsupportedTypeError, "'m'.*meta"),
    "masked_array": (lambda: with_(m=np.ma.masked_array(np.zeros(B), mask=[0, 1, 0])),
                     UnsupportedTypeError, "'m'.*masked"),
    "non_str_key": (lambda: {**ok(), 3: torch.zeros(B)}, UnsupportedTypeError, "key 3 is a int"),
    "reserved_name_step": (lambda: with_(step=torch.zeros(B)), BatchError, "'step'.*reserved"),
    "column_name_collision": (lambda: {**with_(**{"a.b": torch.zeros(B)}), "a": {"b": torch.zeros(B)}},
                              BatchError, "'a.b'.*already used"),
    "opaque_object": (lambda: with_(o=_Opaque()), UnsupportedTypeError, "'o'.*_Opaque"),
    "set_value": (lambda: with_(o={1, 2}), UnsupportedTypeError, "'o'.*set"),
    "lone_surrogate_str": (lambda: with_(o=["\ud800", "a", "b"]), BatchError, "'o'.*UTF-8"),
    "lone_surrogate_key": (lambda: {**ok(), "\udcff": torch.zeros(B)}, BatchError, "UTF-8"),
    "too_deep_json": (lambda: with_(o=[_deep(5000), None, None]), BatchError, "'o'.*nests more than"),
    "numpy_void": (lambda: with_(v=np.zeros(B, dtype="V4")), UnsupportedTypeError, "'v'.*dtype \\|V4"),
    "numpy_structured": (lambda: with_(v=np.zeros(B, dtype=[("a", "f4")])), UnsupportedTypeError, "'v'.*dtype"),
    "list_batch_of_ints": (lambda: [1, 2, 3], UnsupportedTypeError, "list batch must hold one dict"),
    "batch_is_tensor": (lambda: torch.zeros(3), UnsupportedTypeError, "batch of type Tensor"),
    "batch_is_str": (lambda: "rollout", UnsupportedTypeError, "batch of type str"),
    # one level deeper than a reader accepts (format/limits.py; the boundary: tests/test_hostile_decode.py)
    "fields_nested_too_deep": (lambda: with_(g=_nested(65, torch.zeros(B))), BatchError,
                               "'g(\\.k)+' nests 65 levels.*limit of 64"),
    "too_many_dimensions": (lambda: with_(x=torch.zeros([B] + [1] * 32)), BatchError,
                            "'x' has 33 dimensions.*limit of 32"),
    "rows_nested_too_deep": (lambda: [{"ids": torch.zeros(2), "g": _nested(64, torch.zeros(2))}, None], BatchError,
                             "'g(\\.k)+' nests 65 levels.*limit of 64"),
}


# refused before typed values (format/typed.py); stored exactly now (tests/test_values_typed.py)
NOW_STORED = {
    "cells_different_dtypes": lambda: with_(o=[torch.zeros(1), torch.zeros(1, dtype=torch.int64), None]),
    "json_bytes_value": lambda: with_(o=[b"x", b"y", b"z"]),
    "json_non_str_key": lambda: with_(o=[{1: 2}, {}, {}]),
    "mixed_tensor_and_str": lambda: with_(o=[torch.zeros(1), "x", None]),
    "non_str_nested_key": lambda: with_(g={1: torch.zeros(B)}),
    "numpy_complex": lambda: with_(c=np.zeros(B, dtype=np.complex128)),
    "numpy_datetime": lambda: with_(d=np.zeros(B, dtype="datetime64[s]")),
    "object_array_2d": lambda: with_(o=np.empty((B, 2), dtype=object)),
    "object_array_tensor_and_str": lambda: with_(o=np.array([torch.zeros(2), "x", None], dtype=object)),
}


@pytest.mark.parametrize("name", sorted(NOW_STORED))
def test_formerly_refused_values_round_trip(tmp_path, name):
    b = NOW_STORED[name]()
    with trajstore.Writer(tmp_path) as w:
        w.append(0, b)
    assert_batch_equal(trajstore.Reader(tmp_path).read(0), b)


def _deep(n):
    v = []
    for _ in range(n):
        v = [v]
    return v


def test_at_least_30_kinds():
    assert len(BATCHES) + len(WRITER_CASES) >= 30


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_encode_rejects(name):
    make, exc, msg = BATCHES[name]
    with pytest.raises(exc, match=msg):
        schema.encode(make(), step=0, split="train")


def _assert_nothing_written(path, step=1):
    d = path / "train"
    names = os.listdir(d)
    # a step rejected in the background is recorded as skipped (why it is missing), never written
    assert not [n for n in names if n.startswith(f"step_{step:08d}") and not n.endswith(".skipped.json")], names
    assert not [n for n in names if n.startswith(".")], names


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_writer_rejects_and_writes_nothing(tmp_path, name):
    make, exc, msg = BATCHES[name]
    w = trajstore.Writer(tmp_path)
    w.append(0, ok())
    with pytest.raises(TrajstoreError, match=msg):
        w.append(1, make())
        w.flush()  # a check that runs in the background is raised here, naming the step
    w.close()
    _assert_nothing_written(tmp_path)
    r = trajstore.Reader(tmp_path)
    assert r.steps == [0]


# step / split / meta: checked by Writer.append itself
WRITER_CASES = {
    "step_negative": (dict(step=-1), ConfigError, "step -1 is negative"),
    "step_float": (dict(step=1.0), ConfigError, "step 1.0 is a float"),
    "step_bool": (dict(step=True), ConfigError, "step True is a bool"),
    "step_str": (dict(step="1"), ConfigError, "step '1' is a str"),
    "step_none": (dict(step=None), ConfigError, "step None"),
    "step_too_large": (dict(step=2**63), ConfigError, "too large"),
    "step_numpy_float": (dict(step=np.float32(1)), ConfigError, "float32"),
    "meta_not_dict": (dict(meta=[1]), ConfigError, "meta must be a dict"),
    "meta_oversized": (dict(meta={"x": "a" * (2 << 20)}), BatchError, "meta is .* bytes.*limit"),
    "meta_opaque_value": (dict(meta={"x": {"y": [object()]}}), UnsupportedTypeError,
                          r"step 1 meta\['x'\]\['y'\]\[0\].*object cannot be stored; convert it"),
    "meta_set_key": (dict(meta={frozenset(): 2}), UnsupportedTypeError, "meta key.*frozenset"),
    "meta_meta_tensor": (dict(meta={"x": torch.empty(1, device="meta")}), UnsupportedTypeError, "meta.*'x'"),
    "meta_surrogate": (dict(meta={"x": "\ud800"}), BatchError, "meta.*UTF-8"),
}


@pytest.mark.parametrize("name", sorted(WRITER_CASES))
def test_writer_rejects_bad_step_or_meta(tmp_path, name):
    kw, exc, msg = WRITER_CASES[name]
    w = trajstore.Writer(tmp_path)
    args = {"step": 1, "batch": ok(), "meta": None, **kw}
    with pytest.raises(exc, match=msg):
        w.append(args["step"], args["batch"], meta=args["meta"])
        w.flush()
    w.close()
    _assert_nothing_written(tmp_path)
    assert trajstore.Reader(tmp_path).steps == []


@pytest.mark.parametrize("split", ["a/b", "..", "../x", "", ".hidden", "-x", "a" * 200, "tr ain", "x\0y", 3, None])
def test_bad_split_names(tmp_path, split):
    with pytest.raises(ConfigError, match="split .* is not a valid name"):
        trajstore.Writer(tmp_path, split=split)
    assert not (tmp_path / "a").exists() and not (tmp_path.parent / "x").exists()


def test_views_are_copied_exactly(tmp_path):
    """Non-contiguous, overlapping (stride 0), transposed, negative-view and conj views are not
    errors: they are stored as the values they show (a contiguous copy), exactly."""
    base = torch.arange(B * T * 2, dtype=torch.float32).reshape(B, T * 2)
    batch = {"strided": base[:, ::2], "expanded": torch.arange(T).expand(B, T), "transposed": base.T.contiguous().T,
             "neg": torch._neg_view(torch.ones(B)), "overlap": torch.as_strided(torch.arange(5.0), (B, 3), (1, 1)),
             "np_strided": np.arange(20.0)[::-1][:B]}
    got = write(tmp_path, {0: batch})[0]
    for k, v in batch.items():
        want = torch.as_tensor(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v.contiguous()
        have = torch.as_tensor(got[k]) if isinstance(got[k], np.ndarray) else got[k]
        assert torch.equal(have, want), k
