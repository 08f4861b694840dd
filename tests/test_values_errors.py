"""Errors of batches that cannot be stored: at append as BatchError, in the background as
BatchWriteError (a WriterError and a BatchError), and in dump mode never stopping training."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import trajstore
from trajstore.errors import BatchError, BatchWriteError, UnsupportedTypeError, WriterError
from trajstore.format.batch.containers import DataProtoLike
from trajstore.testing import assert_batch_equal


def good(i: int) -> dict:
    return {"input_ids": torch.arange(6).reshape(2, 3) + i, "attention_mask": torch.ones(2, 3, dtype=torch.long)}


def unstorable() -> dict:
    return {**good(0), "tags": [{"ids": {1, 2}}, None]}  # a set: no exact representation


def bad_mask() -> dict:
    return {**good(0), "attention_mask": torch.full((2, 3), 2)}  # only its values are wrong


def test_append_raises_batch_error_naming_the_field(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        with pytest.raises(UnsupportedTypeError, match=r"field 'tags' row 0\['ids'\]: a value of type builtins.set"):
            w.append(0, unstorable())
        with pytest.raises(BatchError, match="meta_info"):
            w.append(1, DataProtoLike(non_tensor_batch={"u": np.array([1, 2])}, meta_info={"f": {1, 2}}))
        w.append(2, good(2))
    assert trajstore.Reader(tmp_path).steps == [2]


def test_background_batch_failure_is_a_batch_error(tmp_path):
    w = trajstore.Writer(tmp_path)
    w.append(0, bad_mask())
    with pytest.raises(BatchError) as e:
        w.flush()
    assert isinstance(e.value, WriterError) and isinstance(e.value, BatchWriteError) and e.value.step == 0
    w.close()
    assert 0 in trajstore.Reader(tmp_path).skipped


@pytest.mark.parametrize("make", [unstorable, bad_mask])
def test_dump_never_kills_training(tmp_path, caplog, make):
    b = make()
    with caplog.at_level(logging.ERROR), trajstore.Recorder(dump=True, path=str(tmp_path)) as rec:
        assert rec.batch(0, lambda: b) is b  # training goes on with its batch
        assert_batch_equal(rec.batch(1, lambda: good(1)), good(1))
    field = "tags" if make is unstorable else "attention_mask"
    assert any(r.levelno == logging.ERROR and field in r.getMessage() for r in caplog.records)
    r = trajstore.Reader(tmp_path)
    assert r.steps == [1] and field in r.skipped[0]
    assert_batch_equal(r.read(1), good(1))


def test_strict_dump_raises(tmp_path):
    with trajstore.Recorder(dump=True, path=str(tmp_path), strict=True) as rec, pytest.raises(UnsupportedTypeError):
        rec.batch(0, unstorable)
    with pytest.raises(BatchError):
        with trajstore.Recorder(dump=True, path=str(tmp_path / "b"), strict=True) as rec:
            rec.batch(0, bad_mask)
