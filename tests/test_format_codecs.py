"""The codecs of trajstore/format/: a decode bug of ours surfaces as itself (not as "file damaged"),
a spec that lies about any batch form raises a TrajstoreError naming the file, and edge shapes
round-trip."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from test_corrupt import spec_lies

import trajstore
from trajstore import schema
from trajstore.errors import FormatError, TrajstoreError
from trajstore.format.codec import tensors
from trajstore.format.file import validate
from trajstore.testing import assert_batch_equal, batches, padded_batches

try:
    from tensordict import TensorDict
except ImportError:  # an optional extra
    TensorDict = None


def _encoded(batch):
    t = schema.encode(batch, step=0, split="train")
    return t, json.loads(t.schema.metadata[b"trajstore"])


def _chunked(t: pa.Table, cut: int) -> pa.Table:
    """The same table in two chunks per column (row groups read back from Parquet look like this)."""
    cut = min(cut, t.num_rows)
    return pa.concat_tables([t.slice(0, cut), t.slice(cut)])


def test_a_bug_of_ours_surfaces_as_itself(monkeypatch):
    t, doc = _encoded({"r": torch.zeros(3)})

    def broken(*a, **k):
        raise KeyError("a bug")

    monkeypatch.setattr(tensors, "decode_sample", broken)
    with pytest.raises(KeyError, match="a bug"):
        schema.decode(t, doc["batch"], where="mem")


def test_values_that_contradict_the_spec_are_a_format_error():
    t, doc = _encoded({"x": torch.zeros(3, 2)})
    spec = doc["batch"]
    spec["keys"][0][1]["trail"] = [3]  # 6 values are not 3 rows of [3]
    validate.check(doc, t.schema, t.num_rows, "mem")
    with pytest.raises(FormatError, match="mem: column 'x' holds 6 values"):
        schema.decode(t, spec, where="mem")


def test_json_text_that_is_not_json_is_a_format_error():
    t, doc = _encoded({"r": torch.zeros(2), "o": [[1], {"a": 2}]})
    i = t.schema.get_field_index("o")
    t = t.set_column(i, t.schema.field(i), pa.array(["[1", "{}"]))
    with pytest.raises(FormatError, match="mem: column 'o' holds text that is not JSON"):
        schema.decode(t, doc["batch"], where="mem")


def test_zero_width_token_fields_round_trip(tmp_path):
    """A packed [N, 0] field comes back [N, 0] (its column holds no values; N is from cu_seqlens)."""
    b = {"x": torch.zeros(5, 0), "ids": torch.arange(5), "cu_seqlens": torch.tensor([0, 2, 5])}
    with trajstore.Writer(tmp_path) as w:
        w.append(0, b)
    r = trajstore.Reader(tmp_path)
    assert_batch_equal(r[0], b)
    pad = r.read(0, layout="padded")
    assert pad["x"].shape == (2, 3, 0)
    assert pad["attention_mask"].tolist() == [[True, True, False], [True, True, True]]


def _td(batch):
    """The padded batch as a TensorDict with a nested one (numpy fields left out: a TensorDict
    would turn them into tensors)."""
    batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    B = int(batch["attention_mask"].shape[0])
    inner = {k: v for k, v in batch.items() if k.startswith("tok_")}
    outer = {k: v for k, v in batch.items() if not k.startswith("tok_")}
    return TensorDict({**outer, "inner": TensorDict(inner, batch_size=[B])}, batch_size=[B])


_ANY = batches() if TensorDict is None else st.one_of(batches(), padded_batches().map(_td))


@given(_ANY, st.data())
def test_lying_specs_of_any_batch_form(batch, data):
    """A mutated spec, checked by ``validate`` like the reader does, then decoded (in one or two
    chunks, in any layout): a batch, or a TrajstoreError naming the file."""
    t, doc = _encoded(batch)
    lie = data.draw(spec_lies(doc))
    assume(lie != doc and isinstance(lie.get("batch"), dict))
    table = _chunked(t, data.draw(st.integers(0, 6)))
    try:
        validate.check(lie, table.schema, table.num_rows, "mem")
        schema.decode(table, lie["batch"], where="mem", layout=data.draw(st.sampled_from([None, "padded", "packed"])))
    except TrajstoreError as e:
        assert "mem" in str(e), e


@given(batches(), st.integers(0, 6), st.sampled_from([None, "padded", "packed"]))
def test_chunked_tables_decode_like_one_chunk(batch, cut, layout):
    t, doc = _encoded(batch)
    try:
        want = schema.decode(t, doc["batch"], where="mem", layout=layout)
    except TrajstoreError:  # a layout this batch cannot take
        return
    assert_batch_equal(schema.decode(_chunked(t, cut), doc["batch"], where="mem", layout=layout), want)
