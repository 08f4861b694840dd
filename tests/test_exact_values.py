"""Issue 13, exact nested values: each row's dict keeps its own key order, and every JSON text a step
holds is strict JSON (Polars ``str.json_decode``, DuckDB ``json``, Python ``json`` with NaN refused)
while NaN (payloads too), infinities and -0.0 still round-trip exactly (docs/FORMAT.md 3.7, 3.8)."""

from __future__ import annotations

import json
import math
import struct

import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore.errors import FormatError
from trajstore.format import typed
from trajstore.testing import assert_batch_equal, typed_values

ODD_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000123))[0]
FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.0, ODD_NAN, 1e308, 5e-324]


def _strict(text: str):
    def refuse(c):
        raise ValueError(f"bare {c} is not JSON")
    return json.loads(text, parse_constant=refuse)


def _roundtrip(path, batch, meta=None):
    with trajstore.Writer(path) as w:
        w.append(0, batch, meta=meta)
    r = trajstore.Reader(path, "train")
    assert_batch_equal(r[0], batch)
    if meta is not None:
        assert_batch_equal(r.meta(0), meta)
    return path / "train" / "step_00000000.parquet"


def _json_texts(f) -> list[str]:
    """Every JSON text of a step: its string columns of kind json, the spec, the meta."""
    t = pq.read_table(f)
    out = [t.schema.metadata[b"trajstore"].decode()]
    for fd in t.schema:
        if (fd.metadata or {}).get(b"trajstore.kind") == b"json":
            out += [x for x in t.column(fd.name).to_pylist() if x is not None]
    return out


def test_each_row_keeps_its_key_order(tmp_path):
    rows = [{"a": torch.ones(1), "b": 1, "c": "x"}, {"a": torch.ones(1), "c": "y", "b": 2},
            {"c": "z", "a": torch.zeros(2)}, None, {"b": 3}]
    f = _roundtrip(tmp_path / "list", rows)
    spec = json.loads(pq.read_schema(f).metadata[b"trajstore"])
    assert spec["format_version"] == 3 and spec["batch"]["elem"]["orders"] == [[1, [0, 2, 1]], [2, [2, 0]]]
    _roundtrip(tmp_path / "field", {"x": torch.zeros(5), "d": rows})
    f = _roundtrip(tmp_path / "same", [{"a": torch.ones(1), "b": 1.5}, {"a": torch.ones(1)}])
    assert json.loads(pq.read_schema(f).metadata[b"trajstore"])["format_version"] == 1  # nothing to record


def test_a_lying_key_order_is_refused(tmp_path):
    f = _roundtrip(tmp_path, [{"a": torch.ones(1), "b": 1}, {"b": 2, "a": torch.ones(1)}])
    t = pq.read_table(f)
    doc = json.loads(t.schema.metadata[b"trajstore"])
    for orders in ([[1, [1]]], [[1, [1, 1]]], [[5, [1, 0]]], [[1, [1, 0]], [1, [1, 0]]], [[1, [1, 2]]], "x"):
        doc["batch"]["elem"]["orders"] = orders
        pq.write_table(t.replace_schema_metadata({b"trajstore": json.dumps(doc)}), f)
        with pytest.raises(FormatError):
            trajstore.Reader(tmp_path, "train")[0]


@pytest.mark.parametrize("x", FLOATS, ids=[repr(x) for x in FLOATS])
def test_non_finite_floats_are_strict_json_and_exact(tmp_path, x):
    batch = {"r": torch.zeros(2), "info": [{"v": x}, [x, 1]], "scalar": x, "f": [x, 1.5]}
    meta = {"loss": x, "nested": {"k": [x]}}
    f = _roundtrip(tmp_path, batch, meta)
    for text in _json_texts(f):
        _strict(text)
    got = trajstore.Reader(tmp_path, "train")[0]
    assert struct.pack("<d", got["info"][0]["v"]) == struct.pack("<d", x)  # the NaN payload too


def test_a_lying_float_tag_is_refused():
    for doc in ({"$t": "float", "v": "NaN"}, {"$t": "float", "v": "inf", "bits": "7ff0000000000000"},
                {"$t": "float", "v": "nan", "bits": "3ff0000000000000"}, {"$t": "float", "v": "nan", "bits": 1}):
        with pytest.raises(FormatError):
            typed.decode(doc, "test")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.none(), typed_values(max_leaves=6)), min_size=1, max_size=4),
       st.dictionaries(st.text(max_size=3), st.floats() | typed_values(max_leaves=4), max_size=3))
def test_any_values_round_trip_and_every_json_text_is_strict(tmp_path_factory, values, meta):
    path = tmp_path_factory.mktemp("vals")
    f = _roundtrip(path, {"r": torch.zeros(len(values)), "v": values, "w": [{"k": v} for v in values]}, meta)
    for text in _json_texts(f):
        _strict(text)


def test_polars_and_duckdb_parse_every_json_column(tmp_path):
    pl = pytest.importorskip("polars")
    duckdb = pytest.importorskip("duckdb")
    rows = [{"v": math.nan, "k": [1, -0.0]}, {"v": math.inf, "t": (1, 2)}, {"v": -math.inf}, {"v": 0.5, "b": b"x"}]
    batch = {"r": torch.zeros(4), "info": rows, "plain": [{"a": 1}, [1, 2], "x", None], "f": [math.nan, 1, 2, 3.5]}
    f = _roundtrip(tmp_path, batch)
    t = pq.read_table(f)
    cols = [fd.name for fd in t.schema if (fd.metadata or {}).get(b"trajstore.kind") == b"json"]
    assert sorted(cols) == ["info", "plain"]
    df = pl.read_parquet(f)
    con = duckdb.connect()
    for c in cols:
        for text in df[c].drop_nulls():  # row by row: the rows of a column differ in shape
            assert pl.Series([text]).str.json_decode().to_list()[0] is not None, text
        got = con.sql(f"SELECT json(\"{c}\")::VARCHAR FROM read_parquet('{f}')").fetchall()
        assert [None if g[0] is None else json.loads(g[0]) for g in got] == \
            [None if s is None else json.loads(s) for s in t.column(c).to_pylist()]


def test_a_null_the_spec_does_not_list_is_refused(tmp_path):
    """FORMAT.md 3.7: a value or cell column is null exactly at the rows its node lists in none/missing."""
    import pyarrow as pa

    f = _roundtrip(tmp_path, {"r": torch.zeros(3), "s": ["a", None, "c"], "c": [torch.ones(1), None, torch.ones(2)]})
    t = pq.read_table(f)
    for col, rows in (("s", ["a", None, None]), ("s", ["a", "b", "c"]), ("c", [[1.0], None, None])):
        arr = pa.array(rows, type=t.schema.field(col).type)
        bad = t.set_column(t.schema.get_field_index(col), t.schema.field(col), arr)
        pq.write_table(bad, f)
        with pytest.raises(FormatError, match="null"):
            trajstore.Reader(tmp_path, "train")[0]


def test_zero_width_string_arrays_are_refused():
    with pytest.raises(FormatError):
        typed.decode({"$t": "ndarray", "dtype": "<U0", "shape": [2], "v": ""}, "test")
    assert typed.decode({"$t": "np", "dtype": "<U0", "v": ""}, "test") == ""  # the empty str_ scalar
