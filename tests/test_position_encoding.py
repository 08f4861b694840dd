"""Position fields (``position_ids``, ``positions``) are stored with PLAIN values, not a dictionary
(docs/FORMAT.md 3.5): their runs counting up compress better so, and cost less to write and read.
The batch comes back bit for bit, outside readers see the same numbers, token ids and other integer
fields keep their dictionary, and a dump written before (dictionary-encoded positions) still reads."""

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings, strategies as st

import trajstore
from trajstore.format import arrow
from trajstore.format.file import parquet
from trajstore.testing import assert_batch_equal

DICT = {"RLE_DICTIONARY", "PLAIN_DICTIONARY"}


def _encodings(f) -> dict[str, set]:
    md = pq.ParquetFile(f).metadata
    out: dict[str, set] = {}
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        for j in range(md.num_columns):
            out.setdefault(rg.column(j).path_in_schema, set()).update(rg.column(j).encodings)
    return out


@st.composite
def position_batches(draw):
    """A verl-like padded batch: left-padded rows, ``position_ids`` counting up over each row's tokens
    (0 on the padding), or, drawn, any int64 values (some outside int32)."""
    B = draw(st.integers(1, 6))
    lens = draw(st.lists(st.integers(0, 12), min_size=B, max_size=B))
    T = max(1, max(lens))
    ar = torch.arange(T)[None, :]
    mask = ar >= (T - torch.tensor(lens))[:, None]
    g = np.random.default_rng(draw(st.integers(0, 2 ** 31)))
    pos = torch.clamp(mask.long().cumsum(1) - 1, min=0)
    if draw(st.booleans()):
        lo, hi = draw(st.sampled_from([(-(1 << 62), 1 << 62), (0, 1 << 20)]))
        pos = torch.from_numpy(g.integers(lo, hi, size=(B, T), dtype=np.int64))
    b = {"input_ids": torch.from_numpy(g.integers(0, 1000, size=(B, T), dtype=np.int64)).masked_fill(~mask, 7),
         "attention_mask": mask, "position_ids": pos,
         "versions": torch.full((B, T), draw(st.integers(0, 3)), dtype=torch.int32)}
    if draw(st.booleans()):
        b["extra"] = {"positions": pos.to(torch.int32)}
    return b


@settings(max_examples=40, deadline=None)
@given(b=position_batches())
def test_positions_are_plain_and_round_trip(tmp_path_factory, b):
    d = tmp_path_factory.mktemp("d")
    with trajstore.Writer(d) as w:
        w.append(0, b)
    r = trajstore.Reader(d)
    assert_batch_equal(r[0], b)
    f = r.file(0)
    enc = _encodings(f)
    positions = [c for c in enc if c.split(".")[0] in ("position_ids", "extra") and "__pad__" not in c]
    assert positions and all(not (enc[c] & DICT) for c in positions), enc
    assert enc["input_ids.list.element"] & DICT and enc["versions.list.element"] & DICT, enc
    # outside readers: every trajectory's stored positions, exactly
    valid = b["attention_mask"]
    want = [b["position_ids"][i][valid[i]].tolist() for i in range(len(valid))]
    assert pq.read_table(f).column("position_ids").to_pylist() == want
    got = duckdb.sql(f"SELECT position_ids FROM read_parquet('{f}')").fetchall()
    assert [list(row[0]) for row in got] == want


def test_the_rule_names_position_columns_only():
    for name in ("position_ids", "positions", "extra.position_ids", "position"):
        assert arrow.is_position_column(name), name
    for name in ("input_ids", "versions", "pos", "x.input_ids", "composition_ids"):
        assert not arrow.is_position_column(name), name


def test_compact_encodings_still_split_positions(tmp_path):
    """``encodings="compact"`` stores every 16/32/64-bit tensor column BYTE_STREAM_SPLIT, positions too."""
    b = {"attention_mask": torch.ones(2, 5, dtype=torch.bool), "position_ids": torch.arange(5).expand(2, 5).clone()}
    with trajstore.Writer(tmp_path, encodings="compact") as w:
        w.append(0, b)
    assert "BYTE_STREAM_SPLIT" in _encodings(trajstore.Reader(tmp_path).file(0))["position_ids.list.element"]


def test_positions_written_with_a_dictionary_before_still_read(tmp_path, monkeypatch):
    """A dump whose position column is dictionary-encoded (every dump before this rule) reads the same."""
    b = {"attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]).bool(),
         "position_ids": torch.tensor([[0, 1, 0], [0, 1, 2]])}
    monkeypatch.setattr(parquet, "is_position_column", lambda name: False)
    with trajstore.Writer(tmp_path) as w:
        w.append(0, b)
    assert _encodings(trajstore.Reader(tmp_path).file(0))["position_ids.list.element"] & DICT
    monkeypatch.undo()
    assert_batch_equal(trajstore.Reader(tmp_path)[0], b)


@pytest.mark.parametrize("name", ["position_ids", "input_ids"])
def test_plain_positions_take_less_room_than_a_dictionary(tmp_path, name):
    """The reason for the rule, on a long-tail step's shape: a position column's PLAIN zstd values are
    smaller than its dictionary encoding (token ids are not positions: they keep the dictionary)."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(200, 2000, (64,), generator=g)
    T = int(lens.max())
    mask = torch.arange(T)[None, :] < lens[:, None]
    b = {"attention_mask": mask, name: torch.arange(T).expand(64, T).clone()}
    sizes = {}
    for rule in (True, False):
        d = tmp_path / str(rule)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(parquet, "is_position_column", lambda n: rule and arrow.is_position_column(n))
            with trajstore.Writer(d) as w:
                w.append(0, b)
        md = pq.ParquetFile(trajstore.Reader(d).file(0)).metadata
        sizes[rule] = sum(md.row_group(i).column(j).total_compressed_size for i in range(md.num_row_groups)
                          for j in range(md.num_columns) if md.row_group(i).column(j).path_in_schema.startswith(name))
    if name == "position_ids":
        assert sizes[True] < sizes[False], sizes
    else:
        assert sizes[True] == sizes[False], sizes
