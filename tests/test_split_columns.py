"""Issue 13, one column type per field per split (docs/FORMAT.md 3.3 ``num``, 3.11): Python numbers
are one float64 column whatever their mix, a column whose type the split already holds otherwise
moves to a name of its own (trajstore still reads the field exactly), the split records its column
types, and a glob read by DuckDB never returns a wrong number."""

from __future__ import annotations

import json
import logging
import math

import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore.store import columns
from trajstore.testing import assert_batch_equal


def _record(path, split="train") -> dict:
    return json.loads((path / "_trajstore" / split / "columns.json").read_text())["columns"]


def _schema(path, step):
    return pq.read_schema(path / "train" / f"step_{step:08d}.parquet")


def test_numbers_are_one_float64_column_and_come_back_exact(tmp_path):
    steps = [[1, 0, 1], [1.0, 0.5, -0.0], [1, 0.5, None], [2**53, -(2**53), 7]]
    with trajstore.Writer(tmp_path) as w:
        for s, v in enumerate(steps):
            w.append(s, {"score": v})
    r = trajstore.Reader(tmp_path, "train")
    for s, v in enumerate(steps):
        assert str(_schema(tmp_path, s).field("score").type) == "double"
        assert_batch_equal(r[s]["score"], v)
    assert _record(tmp_path) == {"score": "double"}
    doc = json.loads(_schema(tmp_path, 0).metadata[b"trajstore"])
    assert doc["format_version"] == 3 and dict(doc["batch"]["keys"])["score"]["elem"]["ints"] is True
    doc = json.loads(_schema(tmp_path, 1).metadata[b"trajstore"])
    assert doc["format_version"] == 1  # all floats: the version-1 float column, as before


def test_a_column_that_cannot_fit_moves_and_reads_exactly(tmp_path, caplog):
    steps = [{"rewards": torch.tensor([1, 2, 3]), "score": [1, 2, 3]},
             {"rewards": torch.tensor([0.5, 1.5, 2.5]), "score": ["a", "b", "c"]},
             {"rewards": torch.tensor([4.5, 5.5, 6.5]), "score": [2**60, 1, 2]}]
    with caplog.at_level(logging.WARNING, "trajstore.writer"):
        with trajstore.Writer(tmp_path) as w:
            for s, b in enumerate(steps):
                w.append(s, b)
    assert _schema(tmp_path, 1).names == ["step", "rewards__float", "score__string"]
    assert _schema(tmp_path, 2).names == ["step", "rewards__float", "score__int64"]
    assert _schema(tmp_path, 1).field("rewards__float").metadata[b"trajstore.column"] == b"rewards"
    assert _record(tmp_path) == {"rewards": "int64", "score": "double", "rewards__float": "float",
                                 "score__string": "string", "score__int64": "int64"}
    moves = [r.getMessage() for r in caplog.records if "earlier steps of the split" in r.getMessage()]
    assert len(moves) == 3 and "step 1" in moves[0] and "'rewards'" in moves[0]  # once per column and name
    r = trajstore.Reader(tmp_path, "train")
    for s, b in enumerate(steps):
        assert_batch_equal(r[s], b)


def test_the_record_survives_a_restart_and_is_rebuilt_when_lost(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, {"rewards": torch.tensor([1, 2])})
        w.append(1, {"rewards": torch.tensor([0.5, 1.5])})
    with trajstore.Writer(tmp_path) as w:  # a new writer: the record says rewards is int64
        w.append(2, {"rewards": torch.tensor([2.5, 3.5])})
    assert _schema(tmp_path, 2).names == ["step", "rewards__float"]
    (tmp_path / "_trajstore" / "train" / "columns.json").unlink()
    assert columns.read(tmp_path / "train") is None
    with trajstore.Writer(tmp_path) as w:  # rebuilt from the step files, the first step's type first
        w.append(3, {"rewards": torch.tensor([4.5, 5.5])})
    assert _schema(tmp_path, 3).names == ["step", "rewards__float"]
    assert _record(tmp_path) == {"rewards": "int64", "rewards__float": "float"}
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == [f"step_{s:08d}.parquet" for s in range(4)]
    r = trajstore.Reader(tmp_path, "train")
    assert_batch_equal(r[3]["rewards"], torch.tensor([4.5, 5.5]))


_kinds = st.sampled_from(["int", "float", "mixed", "big", "str", "bool", "tensor_i", "tensor_f"])


def _values(kind: str, draw) -> list:
    n = 3
    if kind == "int":
        return draw(st.lists(st.integers(-(2**53), 2**53), min_size=n, max_size=n))
    if kind == "float":
        return draw(st.lists(st.floats(), min_size=n, max_size=n))
    if kind == "mixed":
        return draw(st.lists(st.integers(-9, 9) | st.floats() | st.none(), min_size=n, max_size=n))
    if kind == "big":
        return draw(st.lists(st.integers(2**53 + 1, 2**62), min_size=n, max_size=n))
    if kind == "str":
        return draw(st.lists(st.text(max_size=3), min_size=n, max_size=n))
    if kind == "bool":
        return draw(st.lists(st.booleans(), min_size=n, max_size=n))
    vals = draw(st.lists(st.integers(-9, 9), min_size=n, max_size=n))
    return torch.tensor(vals, dtype=torch.int64 if kind == "tensor_i" else torch.float32)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_any_sequence_of_kinds_reads_exactly_and_duckdb_never_wrong(tmp_path_factory, data):
    duckdb = pytest.importorskip("duckdb")
    path = tmp_path_factory.mktemp("kinds")
    steps = [{"x": _values(k, data.draw)} for k in data.draw(st.lists(_kinds, min_size=1, max_size=4))]
    with trajstore.Writer(path) as w:
        for s, b in enumerate(steps):
            w.append(s, b)
    r = trajstore.Reader(path, "train")
    for s, b in enumerate(steps):
        assert_batch_equal(r[s], b)
    types = {str(_schema(path, s).field("x").type) for s in range(len(steps)) if "x" in _schema(path, s).names}
    assert len(types) <= 1, types  # one type for the column x in the whole split
    query = f"SELECT step, x FROM read_parquet('{path}/train/*.parquet', union_by_name=true) ORDER BY step"
    if not any("x" in _schema(path, s).names for s in range(len(steps))):  # every step all None: no column
        with pytest.raises(duckdb.BinderException, match='"x" not found'):  # an error, never a number
            duckdb.connect().sql(query).fetchall()
        return
    rows = duckdb.connect().sql(query).fetchall()
    for i, (s, got) in enumerate(rows):
        want = steps[s]["x"][i % 3]
        want = want.item() if isinstance(want, torch.Tensor) else want
        if "x" not in _schema(path, s).names or want is None:  # moved, or all None: NULL, never a number
            assert got is None, (s, want, got)
            continue
        assert type(want) is type(got) or isinstance(want, int | float) and isinstance(got, float), (want, got)
        assert got == want or (isinstance(got, float) and math.isnan(got) and math.isnan(want)), (s, want, got)


def test_a_field_that_is_all_none_in_every_step_has_no_column(tmp_path):
    """All-None lists are stored in the step's metadata only; SQL gets an error for 'x', never a number."""
    duckdb = pytest.importorskip("duckdb")
    with trajstore.Writer(tmp_path) as w:
        w.append(0, {"x": [None, None, None]})
    assert trajstore.Reader(tmp_path, "train")[0] == {"x": [None, None, None]}
    assert "x" not in _schema(tmp_path, 0).names
    with pytest.raises(duckdb.BinderException, match='"x" not found'):
        duckdb.connect().sql(f"SELECT x FROM read_parquet('{tmp_path}/train/*.parquet')").fetchall()


def test_info_shows_the_split_columns(tmp_path, capsys):
    from trajstore import cli
    from trajstore.inspection.describe import describe

    with trajstore.Writer(tmp_path) as w:
        w.append(0, {"rewards": torch.tensor([1, 2]), "score": [1, 0.5]})
        w.append(1, {"rewards": torch.tensor([0.5, 1.5]), "score": [2, 3]})
    assert describe(tmp_path)["splits"]["train"]["columns"] == {"rewards": "int64", "score": "double",
                                                                "rewards__float": "float"}
    assert cli.main(["info", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "columns of the split" in text and "rewards__float" in text


def test_two_writers_of_a_split_share_the_record(tmp_path):
    """A writer merges what another writer of the split recorded since it opened (FORMAT.md 3.11)."""
    a = trajstore.Writer(tmp_path)
    with trajstore.Writer(tmp_path) as b:
        b.append(0, {"score": [1, 2]})
    a.append(1, {"score": ["x", "y"]})  # a opened before 'score' was recorded as double
    a.close()
    assert _schema(tmp_path, 1).names == ["step", "score__string"]
    assert _record(tmp_path) == {"score": "double", "score__string": "string"}


def _list_batch(draw, with_none: bool):
    n = draw(st.integers(1, 4))
    rows = []
    for i in range(n):
        L = draw(st.integers(0, 5))
        rows.append({"input_ids": torch.arange(L, dtype=torch.int64) * (i + 1),
                     "logprobs": torch.full((L,), -0.5 * i, dtype=torch.float32)})
    if with_none:
        rows.insert(draw(st.integers(0, n)), None)
    return rows


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_list_batches_with_and_without_none_keep_their_columns(tmp_path_factory, data):
    """A list batch with ``None`` trajectories stores nullable list items, one without stores them
    non-null (and a dict batch non-null too): steps of a split in any order of these keep one column
    per field (the recorded type: items differ only in nullability), read back exactly, and a glob read
    by DuckDB sees every trajectory's values under the field's name."""
    kinds = data.draw(st.lists(st.sampled_from(["none", "full", "dict"]), min_size=2, max_size=5))
    batches = []
    for k in kinds:
        if k == "dict":
            m = torch.tensor([[True, True, False], [True, True, True]])
            batches.append({"input_ids": torch.tensor([[7, 8, 0], [9, 10, 11]]), "attention_mask": m,
                            "logprobs": torch.tensor([[-1.0, -2.0, 0.0], [-3.0, -4.0, -5.0]])})
        else:
            batches.append(_list_batch(data.draw, k == "none"))
    d = tmp_path_factory.mktemp("d")
    with trajstore.Writer(d) as w:
        for s, b in enumerate(batches):
            w.append(s, b)
    r = trajstore.Reader(d)
    want = []
    for s, b in enumerate(batches):
        assert_batch_equal(r[s], b)
        names = _schema(d, s).names
        assert "input_ids" in names and "logprobs" in names, (kinds, s, names)
        assert not any("__large_list" in n for n in names), (kinds, s, names)
        if isinstance(b, dict):
            want += [b["input_ids"][i][b["attention_mask"][i]].tolist() for i in range(len(b["input_ids"]))]
        else:
            want += [None if e is None else e["input_ids"].tolist() for e in b]
    import duckdb

    rows = []
    for s in range(len(batches)):
        rows += pq.read_table(d / "train" / f"step_{s:08d}.parquet", columns=["input_ids"]).column(0).to_pylist()
    assert rows == want
    assert duckdb.sql(f"SELECT count(*) FROM read_parquet('{d}/train/*.parquet', union_by_name=true) "
                      "WHERE input_ids IS NULL").fetchall()[0][0] == sum(x is None for x in want)


def test_items_that_are_null_never_take_a_non_null_record():
    """The rule casts only what holds: a column with null items keeps its own type (and moves) where
    the split records non-null items."""
    import pyarrow as pa

    from trajstore.format.file import columns as fc

    nullable = pa.large_list(pa.field("element", pa.int32(), nullable=True))
    strict = pa.large_list(pa.field("element", pa.int32(), nullable=False))
    meta = {b"trajstore": b'{"batch": {"t": "batch", "keys": [["x", {"t": "tensor", "col": "x"}]]}}'}
    with_null = pa.table({"x": pa.array([[1, None]], type=nullable)}).replace_schema_metadata(meta)
    table, moved, types = fc.fit(with_null, {"x": str(strict)})
    assert moved == {"x": "x__large_list_int32"} and table.column_names == ["x__large_list_int32"]
    without = pa.table({"x": pa.array([[1, 2]], type=nullable)}).replace_schema_metadata(meta)
    table, moved, types = fc.fit(without, {"x": str(strict)})
    assert moved == {} and types == {"x": str(strict)} and table.column(0).to_pylist() == [[1, 2]]
