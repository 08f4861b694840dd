"""Typed values (format/typed.py): every non-tensor value a verl / AReaL / TRL batch holds comes back
with its type, through Writer -> Reader and through the Recorder's dump -> replay."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import trajstore
from trajstore.errors import FormatError, UnsupportedTypeError
from trajstore.format import typed
from trajstore.format.batch.containers import DataProtoLike
from trajstore.testing import assert_batch_equal, typed_batches, typed_values

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


def _version(r: trajstore.Reader, step: int) -> int:
    return json.loads(pq.read_schema(r.file(step)).metadata[b"trajstore"])["format_version"]


@SETTINGS
@given(typed_values())
def test_typed_document_roundtrip(v):
    typed.needs_typed(v, "v")
    doc = json.loads(json.dumps(typed.encode(v)))
    assert_batch_equal(typed.decode(doc, "here"), v)


@SETTINGS
@given(typed_batches(dataproto=True))
def test_typed_batches_roundtrip_writer_reader(tmp_path_factory, batch):
    d = tmp_path_factory.mktemp("typed")
    with trajstore.Writer(d) as w:
        w.append(0, batch)
    assert_batch_equal(trajstore.Reader(d).read(0), batch)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(typed_batches(dataproto=True))
def test_typed_batches_roundtrip_recorder(tmp_path_factory, batch):
    d = tmp_path_factory.mktemp("rec")
    with trajstore.Recorder(dump=True, path=str(d)) as rec:
        assert rec.batch(0, lambda: batch) is batch
    with trajstore.Recorder(replay=True, path=str(d)) as rec:
        assert_batch_equal(rec.batch(0, lambda: pytest.fail("replay calls fn")), batch)


def test_issue_repros_and_versions(tmp_path):
    """The issue's cases; plain-JSON steps stay format version 1, typed ones need 2."""
    verl = DataProtoLike(non_tensor_batch={"uid": np.array(["a", "b"], dtype=object),
                                           "__num_turns__": np.array([2, 3], dtype=np.int32)},
                         meta_info={"t": np.float64(1.5), "timing": {"gen": np.float32(0.25)},
                                    "shape": (1, 2), 7: torch.tensor([1.0])})
    batch = {"s": np.float32(1.25), "o": np.array([np.int64(7)], dtype=object),
             "acc": np.array([{"acc": np.float64(1.0)}], dtype=object)}
    with trajstore.Writer(tmp_path) as w:
        w.append(0, verl)
        w.append(1, batch)
        w.append(2, {"x": torch.arange(2), "j": [{"a": [1, "b"]}, None], "c": "plain"})
    r = trajstore.Reader(tmp_path)
    assert_batch_equal(r.read(0), verl)
    assert_batch_equal(r.read(1), batch)
    assert [_version(r, s) for s in (0, 1, 2)] == [2, 1, 1]  # np scalars in object arrays: cells, as before


def test_unstorable_value_named_with_path_and_fix(tmp_path):
    class Thing:
        pass

    with trajstore.Writer(tmp_path) as w, pytest.raises(UnsupportedTypeError) as e:
        w.append(0, {"x": torch.arange(2), "extra": [{"a": [1, Thing()]}, None]})
    msg = str(e.value)
    assert "field 'extra' row 0['a'][1]" in msg and "Thing" in msg and "dataclasses.asdict" in msg
    assert "cannot be stored exactly" not in msg


@pytest.mark.parametrize("doc", [
    {"$t": "np", "dtype": "<f8", "v": "AAAA"},  # 3 bytes for a float64
    {"$t": "np", "dtype": "|O", "v": ""},
    {"$t": "ndarray", "dtype": "<V8", "shape": [1], "v": "AAAAAAAAAAA="},
    {"$t": "ndarray", "dtype": "|O", "shape": [3], "v": [1]},
    {"$t": "tensor", "dtype": "float32", "shape": [2], "v": "AAAAAA=="},
    {"$t": "dict", "v": [[[1], 2]]},  # a list key is not hashable
    {"$t": "pickle", "v": ""},
    {"$t": "bytes", "v": "***"},
])
def test_lying_typed_documents_raise_format_error(doc):
    with pytest.raises(FormatError):
        typed.decode(doc, "file")


def test_lying_typed_file_raises_format_error(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, {"x": torch.arange(2), "when": np.datetime64("2024-01-01", "D")})
    f = trajstore.Reader(tmp_path).file(0)
    t = pq.read_table(f)
    doc = json.loads(t.schema.metadata[b"trajstore"])
    dict(doc["batch"]["keys"])["when"]["v"]["dtype"] = "<V8"
    pq.write_table(t.replace_schema_metadata({b"trajstore": json.dumps(doc).encode()}), f)
    with pytest.raises(FormatError, match="typed value"):
        trajstore.Reader(tmp_path, verify=False).read(0)


def test_lying_typed_row_raises_format_error(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, {"x": torch.arange(2), "v": [(1, 2), None]})
    f = trajstore.Reader(tmp_path).file(0)
    t = pq.read_table(f)
    lie = pa.array(['{"$t": "np", "dtype": "<f8", "v": "AAAA"}', None], type=pa.string())
    pq.write_table(t.set_column(t.schema.get_field_index("v"), "v", lie), f)
    with pytest.raises(FormatError, match="column 'v'.*typed value is malformed"):
        trajstore.Reader(tmp_path, verify=False).read(0)


def test_old_reader_refuses_typed_steps_by_version(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, {"x": torch.arange(2), "when": np.datetime64("2024-01-01")})
    doc = json.loads(pq.read_schema(trajstore.Reader(tmp_path).file(0)).metadata[b"trajstore"])
    assert doc["format_version"] == 2 and dict(doc["batch"]["keys"])["when"]["t"] == "tvalue"
    with pytest.raises(trajstore.errors.FormatVersionError):
        trajstore.format.spec.check_version(doc["format_version"], "f", "a step file", newest=1)
