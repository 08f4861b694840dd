"""Issue 13, step files every Parquet reader reads right: half precision stored readable (format
version 3, docs/FORMAT.md 3.2: bfloat16 and float16 tensor values widened to float32, which every
reader shows as numbers, and back with their exact dtype and bits: NaN payloads, -0.0, infinities,
subnormals); companion column names without dots (3.1); packed steps' ``cu_seqlens`` as a column and
N == B (3.4, 3.7). Encodings: tests/test_writer_async.py; every reader: tests/test_readers.py."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trajstore
from trajstore import FormatError
from trajstore.format import dtypes as dt
from trajstore.format.file import parquet, validate
from trajstore.format.spec import check_version
from trajstore.testing import assert_batch_equal, padded_batches, prompt_completion_batches, two_sided_batches

ALL = np.arange(1 << 16, dtype=np.uint16)  # every 16-bit pattern


def _storage(name: str, bits: np.ndarray) -> np.ndarray:
    return bits if name == "bfloat16" else bits.view(np.float16)


@pytest.mark.parametrize("name", dt.HALF)
def test_every_bit_pattern_widens_and_narrows_exactly(name):
    """All 65536 patterns: the float32 is the half's number (NaN for NaN), and narrowing gives the
    original bits back."""
    wide = dt.widen(_storage(name, ALL), name)
    assert wide.dtype == np.float32
    back = dt.narrow(wide, name)
    assert back.dtype == dt.storage_numpy(name)
    assert np.array_equal(back.view(np.uint16), ALL)
    t = torch.from_numpy(ALL.view(np.int16).copy()).view(torch.bfloat16 if name == "bfloat16" else torch.float16)
    ref = t.float().numpy()
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(wide), nan)
    assert np.array_equal(wide[~nan].view(np.uint32), ref[~nan].view(np.uint32))  # -0.0, inf, subnormals
    if name == "bfloat16":  # the half is the float32's high 16 bits, NaN payloads included
        assert np.array_equal(wide.view(np.uint32) >> 16, ALL.astype(np.uint32))


@pytest.mark.parametrize("name", dt.HALF)
def test_narrow_into_a_given_buffer(name):
    out = np.empty(len(ALL), dt.storage_numpy(name))
    assert dt.narrow(dt.widen(_storage(name, ALL), name), name, out=out) is out
    assert np.array_equal(out.view(np.uint16), ALL)


def _half(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(np.asarray(bits, dtype=np.uint16).view(np.int16)).view(dtype)


@st.composite
def half_batches(draw):
    """A padded batch whose half fields hold arbitrary bit patterns: token fields (one padded with
    differing values: a pad companion), a sample field, a [B, k] field, and a packed step's flat one."""
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    m = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    word = st.integers(0, (1 << 16) - 1)
    grid = lambda *shape: _half(draw(st.lists(word, min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))),  # noqa: E731
                                dtype).reshape(shape)
    return {"input_ids": torch.arange(B * T).reshape(B, T), "attention_mask": m, "lp": grid(B, T),
            "lp_zero_pad": grid(B, T).masked_fill(~m, 0.0), "r": grid(B), "topk": grid(B, 2),
            "cells": [grid(int(n), 2) for n in lengths]}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(half_batches())
def test_half_fields_roundtrip_bit_for_bit(tmp_path_factory, int64_tokens, batch):
    path = tmp_path_factory.mktemp("half")
    with trajstore.Writer(path) as w:
        w.append(0, batch)
    assert_batch_equal(trajstore.Reader(path)[0], batch)
    f = path / "train" / "step_00000000.parquet"
    t = pq.read_table(f)
    doc = json.loads(t.schema.metadata[b"trajstore"])
    assert doc["format_version"] == 3
    for name in ("lp", "r", "topk"):  # the columns a reader sees: float32 numbers
        typ = t.schema.field(name).type
        assert (typ.value_type if pa.types.is_large_list(typ) else typ) == pa.float32()
    got = np.asarray(t.column("r").to_numpy(), np.float32)
    want = batch["r"].float().numpy()
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))


@settings(max_examples=10, deadline=None)
@given(half_batches())
def test_packed_half_fields_roundtrip(tmp_path_factory, batch):
    """Packed steps, and padded reads of them."""
    m = batch["attention_mask"]
    lens = m.sum(1)
    packed = {"input_ids": batch["input_ids"][m], "lp": batch["lp"][m],
              "cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)]), "r": batch["r"]}
    path = tmp_path_factory.mktemp("packed")
    with trajstore.Writer(path) as w:
        w.append(0, packed)
    assert_batch_equal(trajstore.Reader(path)[0], packed)
    padded = trajstore.Reader(path).read(0, layout="padded")
    assert torch.equal(padded["lp"][padded["attention_mask"]].view(torch.int16), packed["lp"].view(torch.int16))


def test_many_row_groups_narrow_while_joining(tmp_path, monkeypatch):
    """A step of several row groups: the widened chunks are narrowed as they are joined (packed read)
    and as they are scattered (padded read)."""
    monkeypatch.setattr(parquet, "ROW_GROUP_BYTES", 1 << 10)
    g = torch.Generator().manual_seed(0)
    B, T = 64, 40
    m = torch.arange(T)[None, :] < torch.randint(0, T + 1, (B,), generator=g)[:, None]
    bits = torch.randint(-(1 << 15), 1 << 15, (B, T), generator=g, dtype=torch.int16)
    batch = {"input_ids": torch.arange(B * T).reshape(B, T), "attention_mask": m,
             "lp": bits.view(torch.bfloat16).masked_fill(~m, 0.0), "h": bits.view(torch.float16), "r": bits[:, 0].view(torch.bfloat16)}
    with trajstore.Writer(tmp_path) as w:
        w.append(0, batch)
    assert pq.ParquetFile(tmp_path / "train" / "step_00000000.parquet").metadata.num_row_groups > 1
    r = trajstore.Reader(tmp_path)
    assert_batch_equal(r[0], batch)
    packed = r.read(0, layout="packed")
    assert torch.equal(packed["lp"].view(torch.int16), batch["lp"][m].view(torch.int16))
    assert_batch_equal(r.column("r")[0], batch["r"])


def _written(path, batch) -> tuple:
    """Write ``batch`` as step 0: (its file, Arrow schema, trajstore metadata)."""
    with trajstore.Writer(path) as w:
        w.append(0, batch)
    f = path / "train" / "step_00000000.parquet"
    schema_ = pq.read_schema(f)
    return f, schema_, json.loads(schema_.metadata[b"trajstore"])


def test_a_version_2_reader_refuses_a_widened_file(tmp_path):
    """A version-2 reader refuses the file by its version; one that looked at the columns anyway
    would find float32 where its bfloat16 needs uint16 bits (and float16 needs halffloat): refused."""
    f, schema_, doc = _written(tmp_path, {"x": torch.tensor([0.5, -1.0]).to(torch.bfloat16),
                                          "y": torch.tensor([1.0, 2.0]).half()})
    assert doc["format_version"] == 3
    with pytest.raises(trajstore.FormatVersionError, match="upgrade"):
        check_version(doc["format_version"], str(f), "step file", newest=2)
    with pytest.raises(FormatError, match="Arrow type float"):
        validate.check({**doc, "format_version": 2}, schema_, 2, str(f))


def test_steps_without_half_fields_keep_their_version(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, {"x": torch.tensor([0.5, -1.0]), "ids": ["a", "b"]})
    assert trajstore.Reader(tmp_path).info(0)["format_version"] == 1


def test_a_float32_column_labelled_half_is_refused_unless_its_metadata_agrees(tmp_path):
    """A float32 field relabelled bfloat16 in the spec (its column says float32) is refused."""
    f, schema_, doc = _written(tmp_path, {"x": torch.tensor([0.5, -1.0]), "y": torch.tensor([1.0, 2.0]).to(torch.bfloat16)})
    dict(doc["batch"]["keys"])["x"]["dtype"] = "bfloat16"
    with pytest.raises(FormatError, match="the spec says bfloat16"):
        validate.check(doc, schema_, 2, str(f))


# ----------------------------------------------------------------------------- companion column names
def test_companion_columns_have_no_dot_and_fields_cannot_take_their_names(tmp_path):
    """``__pad__<col>``, ``__shape__<col>``, ``__start__<src>``: no dot (fastparquet reads them); a
    field whose column starts like one is refused at append, so the two can never collide."""
    m = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]])
    batch = {"input_ids": torch.arange(8).reshape(2, 4), "attention_mask": m,
             "lp": torch.randn(2, 4), "cells": [torch.ones(2), torch.zeros(3)]}
    with trajstore.Writer(tmp_path) as w:
        w.append(0, batch)
        for name in ("__pad__lp", "__shape__x", "__start__attention_mask"):
            with pytest.raises(trajstore.BatchError, match="companion"):
                w.append(1, {**batch, name: torch.zeros(2)})
    names = pq.read_schema(tmp_path / "train" / "step_00000000.parquet").names
    assert {"__pad__lp", "__shape__cells", "__start__attention_mask"} <= set(names), names
    assert_batch_equal(trajstore.Reader(tmp_path)[0], batch)


# ----------------------------------------------------------------------------- packed steps for SQL
@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.sampled_from([torch.int32, torch.int64]))
def test_packed_cu_seqlens_is_a_plain_column(tmp_path_factory, lengths, dtype):
    """Row i of column ``cu_seqlens`` is ``cu_seqlens[i + 1]`` in its dtype; trajstore still
    decodes the inline tensor (the column is for other readers)."""
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=dtype)
    batch = {"input_ids": torch.arange(int(cu[-1])), "cu_seqlens": cu}
    path = tmp_path_factory.mktemp("cu")
    with trajstore.Writer(path) as w:
        w.append(0, batch)
    t = pq.read_table(path / "train" / "step_00000000.parquet")
    assert t.column("cu_seqlens").to_pylist() == cu[1:].tolist()
    assert t.schema.field("cu_seqlens").type == dt.arrow_type(str(dtype).split(".")[1])
    assert [len(r) for r in t.column("input_ids").to_pylist()] == lengths  # len(input_ids) in SQL
    assert_batch_equal(trajstore.Reader(path)[0], batch)


def test_a_missing_cu_seqlens_column_is_refused(tmp_path):
    f, schema_, doc = _written(tmp_path, {"input_ids": torch.arange(3), "cu_seqlens": torch.tensor([0, 1, 3])})
    dict(doc["batch"]["keys"])["cu_seqlens"]["col"] = "nope"
    with pytest.raises(FormatError, match="nope"):
        validate.check(doc, schema_, 2, str(f))


@pytest.mark.parametrize("name, kind", [("rewards", "sample"), ("scores", "sample"), ("logprobs", "token")])
def test_packed_with_as_many_tokens_as_trajectories(tmp_path, name, kind):
    """N == B: ``rewards`` / ``scores`` (docs/FORMAT.md 3.4) stay one number per trajectory, any
    other field of leading size N is per-token; both round-trip exactly."""
    batch = {"input_ids": torch.arange(3), "cu_seqlens": torch.tensor([0, 2, 2, 3]), name: torch.tensor([1.5, 2.5, 3.5])}
    with trajstore.Writer(tmp_path) as w:
        w.append(0, batch)
    r = trajstore.Reader(tmp_path)
    assert dict(r.info(0)["batch"]["keys"])[name]["kind"] == kind
    assert_batch_equal(r[0], batch)
    col = pq.read_table(tmp_path / "train" / "step_00000000.parquet").column(name).to_pylist()
    assert col == ([1.5, 2.5, 3.5] if kind == "sample" else [[1.5, 2.5], [], [3.5]])
    padded = r.read(0, layout="padded")
    assert padded[name].shape == ((3,) if kind == "sample" else (3, 2))


# ----------------------------------------------------------------------------- lengths as plain columns
def _lens_from_sql(d) -> dict:
    """Every ``__len__`` column of step 0, read by DuckDB straight from the file."""
    duckdb = pytest.importorskip("duckdb")
    f = next(d.rglob("step_*.parquet"))
    names = [n for n in pq.read_schema(f).names if n.startswith("__len__")]
    rows = duckdb.sql(f"SELECT {', '.join(names)} FROM read_parquet('{f}')").fetchall() if names else []
    return {n: [r[i] for r in rows] for i, n in enumerate(names)}


@settings(max_examples=25, deadline=None)
@given(st.one_of(padded_batches(), two_sided_batches(), prompt_completion_batches()))
def test_each_mask_groups_token_counts_are_a_plain_column(tmp_path_factory, batch):
    """docs/FORMAT.md 3.4: per-trajectory valid token counts of each mask group (``len_col``) are
    an int64 column SQL reads directly, equal to the mask's valid entries, holes included."""
    from trajstore.format.batch.masks import token_mask

    d = tmp_path_factory.mktemp("lens")
    with trajstore.Writer(d) as w:
        w.append(0, batch)
    spec = trajstore.Reader(d).info(0)["batch"]
    if spec.get("t") != "batch" or spec["form"] not in ("padded", "masked"):
        return
    got = _lens_from_sql(d)
    groups = spec.get("masks") or [{"src": "attention_mask", "lo": 0, "W": spec["T"], "len_col": spec.get("len_col")}]
    for g in groups:
        m = batch[g["src"]]
        if "len_col" not in g or g["len_col"] is None:
            continue  # a mask that is not 0/1: its fields are stored whole
        want = token_mask(torch.as_tensor(m))[:, g["lo"]:g["lo"] + g["W"]].sum(1).tolist()
        assert got[g["len_col"]] == want, (g, got)
    assert spec.get("len_col") or spec.get("masks"), spec


def test_a_mask_with_holes_gives_its_count_not_the_padded_width(tmp_path):
    m = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    with trajstore.Writer(tmp_path) as w:
        w.append(0, {"input_ids": torch.arange(15).reshape(3, 5) * m, "attention_mask": m})
    assert _lens_from_sql(tmp_path) == {"__len__attention_mask": [3, 5, 0]}
    assert_batch_equal({"input_ids": torch.arange(15).reshape(3, 5) * m, "attention_mask": m}, trajstore.Reader(tmp_path)[0])
