"""Per-trajectory lists of ints or of floats (SkyRL's ``response_ids``, ``loss_masks``,
``rollout_logprobs``) are ``large_list`` columns (value types ``ilist`` / ``flist``, format version 4):
they round-trip exactly with their Python types, SQL ``len()`` counts their items, and lists of
other kinds stay JSON values."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trajstore
from trajstore.errors import FormatError

INT64 = st.integers(-(2**63), 2**63 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)


def write(d, batch):
    with trajstore.Writer(d) as w:
        w.append(0, batch)
    return trajstore.Reader(d)


def same(a, b):
    assert type(a) is type(b)
    if isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, float):
        assert a == b or (a != a and b != b)
    else:
        assert a == b


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["int", "float"]), rows=st.lists(st.one_of(st.none(), st.lists(st.none())), min_size=1,
                                                              max_size=5), data=st.data())
def test_any_number_lists_round_trip(tmp_path_factory, kind, rows, data):
    item = INT64 if kind == "int" else FLOATS
    rows = [None if r is None else data.draw(st.lists(item, max_size=6)) for r in rows]
    if not any(r for r in rows):
        rows[0] = [data.draw(item)]
    r = write(tmp_path_factory.mktemp("n"), {"ids": rows})
    got = r[0]["ids"]
    same(rows, got)
    col = dict(r.info(0)["batch"]["keys"])["ids"]["elem"]
    assert col["ptype"] == ("ilist" if kind == "int" else "flist") and r.info(0)["format_version"] == 4


def test_sql_counts_items_and_other_lists_stay_json(tmp_path):
    batch = {"response_ids": [[5, 6, 7], [8], []], "logprobs": [[-0.5, -1.0], [], [0.0]],
             "mixed": [[1, 0.5], [2], [3]], "bools": [[True], [False], []], "empty": [[], [], []]}
    r = write(tmp_path / "d", batch)
    assert r[0] == batch and [type(x) for x in r[0]["mixed"][0]] == [int, float]
    rows = r.duckdb().sql("select len(response_ids), len(logprobs), typeof(mixed), typeof(bools) from train").fetchall()
    assert rows == [(3, 2, "VARCHAR", "VARCHAR"), (1, 0, "VARCHAR", "VARCHAR"), (0, 1, "VARCHAR", "VARCHAR")]


def test_an_old_version_file_with_a_list_column_is_refused(tmp_path):
    write(tmp_path / "d", {"ids": [[1, 2], [3]]})
    f = next((tmp_path / "d" / "train").glob("step_*.parquet"))
    t = pq.read_table(f)
    md = dict(t.schema.metadata)
    key = next(k for k in md if b"trajstore" in k)
    md[key] = md[key].replace(b'"format_version": 4', b'"format_version": 3').replace(b'"format_version":4', b'"format_version":3')
    assert md[key] != dict(t.schema.metadata)[key]
    pq.write_table(t.replace_schema_metadata(md), f)
    (tmp_path / "d" / "_trajstore" / "train" / "step_0.sha256").unlink(missing_ok=True)
    with pytest.raises(FormatError, match="needs 4"):
        trajstore.Reader(tmp_path / "d")[0]
