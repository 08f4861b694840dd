"""int64 token-id columns stored as int32 where every value fits (docs/FORMAT.md 3.2, format version 6):
the batch comes back bit for bit as int64, the column is int32 exactly when it holds identifiers and
every value of the step's column fits (other int64 fields keep 64 bits, so outside readers' sums of
them stay exact), outside readers see the same numbers, a file claiming an older version with such a
column is refused, files written before (int64 columns) still read, and shards that stored one
column as int32 and as int64 join exactly."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings, strategies as st

import trajstore
from trajstore.errors import FormatError
from trajstore.format import arrow
from trajstore.format.spec import FORMAT_VERSION
from trajstore.testing import (
    assert_batch_equal,
    group_lists,
    packed_batches,
    padded_batches,
    prompt_completion_batches,
    trajectory_lists,
    two_sided_batches,
)

I32 = (-(1 << 31), (1 << 31) - 1)


def _batch(draw, big: bool):
    B = draw(st.integers(1, 6))
    lens = draw(st.lists(st.integers(0, 9), min_size=B, max_size=B))
    T = max(1, max(lens))
    mask = torch.arange(T)[None, :] < torch.tensor(lens)[:, None]
    lo, hi = (-(1 << 62), 1 << 62) if big else I32
    seed = draw(st.integers(0, 2 ** 31))
    g = np.random.default_rng(seed)
    ids = torch.from_numpy(g.integers(lo, hi, size=(B, T), endpoint=True, dtype=np.int64))
    if not big:  # the extremes of int32 itself are still narrowed
        ids.view(-1)[0] = draw(st.sampled_from(I32))
    return {"input_ids": ids.masked_fill(~mask, draw(st.integers(-5, 5))), "attention_mask": mask.long(),
            "versions": torch.full((B, T), draw(st.integers(0, 3)), dtype=torch.int64),
            "clock_ms": torch.full((B, T), 2_000_000_000, dtype=torch.int64),  # fits int32; its sums do not
            "rewards": torch.randn(B, generator=torch.Generator().manual_seed(seed))}


def _doc(f):
    return json.loads(pq.read_metadata(f).metadata[b"trajstore"])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_round_trip_and_column_type(tmp_path_factory, data):
    big = data.draw(st.booleans())
    b = _batch(data.draw, big)
    d = tmp_path_factory.mktemp("d")
    with trajstore.Writer(d) as w:
        w.append(0, b)
    r = trajstore.Reader(d)
    got = r[0]
    assert_batch_equal(got, b)
    assert got["input_ids"].dtype == torch.int64
    packed = r.read(0, layout="packed")
    valid = b["attention_mask"].bool()
    assert torch.equal(packed["input_ids"], b["input_ids"][valid]) and packed["input_ids"].dtype == torch.int64
    f = r.file(0)
    t = pq.read_table(f)
    # every valid id fits int32 unless drawn from the wide range (whose draws of 64 bits never all fit)
    fits = bool(((b["input_ids"][valid] >= I32[0]) & (b["input_ids"][valid] <= I32[1])).all())
    want = "int32" if fits else "int64"
    assert str(t.schema.field("input_ids").type.value_type) == want
    for name in ("versions", "attention_mask", "clock_ms"):  # not identifiers: int64, whatever they hold
        assert str(t.schema.field(name).type.value_type) == "int64", name
    assert _doc(f)["format_version"] == (6 if fits else 1)
    # outside readers see the numbers, one list per trajectory
    rows = t.column("input_ids").to_pylist()
    assert rows == [b["input_ids"][i][valid[i]].tolist() for i in range(len(rows))]


def test_written_before_still_reads(tmp_path, monkeypatch):
    """A dump of int64 columns (what writers before version 6 wrote) reads as before, and records the
    older version."""
    b = {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 0]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    monkeypatch.setattr(arrow, "NARROW_TOKENS", False)
    with trajstore.Writer(tmp_path) as w:
        w.append(0, b)
    monkeypatch.setattr(arrow, "NARROW_TOKENS", True)
    r = trajstore.Reader(tmp_path)
    assert str(pq.read_schema(r.file(0)).field("input_ids").type.value_type) == "int64"
    assert _doc(r.file(0))["format_version"] < 6
    assert_batch_equal(r[0], b)


def test_an_older_version_claimed_with_an_int32_column_is_refused(tmp_path):
    """A file whose int64 token column is int32 but whose metadata claims version 5 is refused, naming
    the column: a version-5 reader would misread it."""
    b = {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 0]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    with trajstore.Writer(tmp_path / "a") as w:
        w.append(0, b)
    f = trajstore.Reader(tmp_path / "a").file(0)
    t = pq.read_table(f)
    doc = _doc(f)
    assert doc["format_version"] == 6 == FORMAT_VERSION
    doc["format_version"] = 5
    pq.write_table(t.replace_schema_metadata({**t.schema.metadata, b"trajstore": json.dumps(doc)}), f)
    with pytest.raises(FormatError, match="input_ids"):
        trajstore.Reader(tmp_path / "a")[0]


@pytest.mark.parametrize("wide_first", [True, False])
def test_shards_one_fitting_one_not_join_exactly(tmp_path, wide_first):
    """One rank's ids fit int32, the other's do not. The split's column record keeps one type per
    name (FORMAT 3.11): where the int64 shard came first the other's int32 column goes back to int64;
    where the int32 one came first the int64 column moves to a name of its own. Either way a logical
    read (1 rank of a 2-rank dump) and each rank's own slice come back bit for bit as int64."""
    shards = []
    bases = ((1 << 40), 7) if wide_first else (7, (1 << 40))
    for r, base in enumerate(bases):
        ids = torch.arange(12, dtype=torch.int64).reshape(3, 4) + base
        m = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
        shards.append({"input_ids": ids * m, "attention_mask": m})
        with trajstore.Writer(tmp_path, rank=r, world_size=2) as w:
            w.append(0, shards[-1])
    r = trajstore.Reader(tmp_path)
    schemas = [pq.read_schema(f) for f in r.files(0)]
    if wide_first:
        assert [str(s.field("input_ids").type.value_type) for s in schemas] == ["int64", "int64"]
    else:
        assert str(schemas[0].field("input_ids").type.value_type) == "int32"
        assert "input_ids" not in schemas[1].names and "input_ids__large_list_int64" in schemas[1].names
    whole = r[0]
    assert whole["input_ids"].dtype == torch.int64
    assert torch.equal(whole["input_ids"][:3], shards[0]["input_ids"])
    assert torch.equal(whole["input_ids"][3:], shards[1]["input_ids"])
    packed = r.read(0, layout="packed")
    assert torch.equal(packed["input_ids"], torch.cat([s["input_ids"][s["attention_mask"].bool()] for s in shards]))
    for k in range(2):
        assert_batch_equal(trajstore.Reader(tmp_path, rank=k, world_size=2)[0], shards[k])


def test_a_split_of_int64_columns_keeps_them(tmp_path, monkeypatch):
    """Appending to a dump whose split holds the column as int64 (written before version 6) keeps it
    int64 under its own name (no second column), and every step reads exactly."""
    b = {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 0]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    monkeypatch.setattr(arrow, "NARROW_TOKENS", False)
    with trajstore.Writer(tmp_path) as w:
        w.append(0, b)
    monkeypatch.setattr(arrow, "NARROW_TOKENS", True)
    with trajstore.Writer(tmp_path) as w:
        w.append(1, b)
    r = trajstore.Reader(tmp_path)
    for s in (0, 1):
        sch = pq.read_schema(r.file(s))
        assert str(sch.field("input_ids").type.value_type) == "int64" and len(sch.names) == len(set(sch.names))
        assert_batch_equal(r[s], b)


def test_shard_tables_of_both_types_unify_to_int64():
    """Shards that stored one int64 token column as int32 and as int64 without a shared record (object
    storage, where ranks' writers race on it) are joined as int64; other type mixes are refused."""
    from trajstore.format.shard import shards

    n32 = pa.large_list(pa.field("element", pa.int32(), nullable=False))
    n64 = pa.large_list(pa.field("element", pa.int64(), nullable=False))
    assert shards._unify([n32, n64], "input_ids", None) == n64
    assert shards._unify([n64, n32, n32], "input_ids", None) == n64

    class J:
        def fail(self, msg, ranks):
            return FormatError(msg)

    with pytest.raises(FormatError, match="input_ids"):
        shards._unify([n32, pa.large_list(pa.field("element", pa.float32(), nullable=False))], "input_ids", J())


def test_many_row_groups_join_int32_values_exactly(tmp_path, monkeypatch):
    """A step of several row groups: its int32 id column is joined back to int64 as the row groups
    arrive (the stream join takes it: widened by the copy) and after the read, bit for bit."""
    import _dumps
    from trajstore.format.file import joining

    _dumps.many_row_groups(monkeypatch)
    g = torch.Generator().manual_seed(3)
    B, T = 64, 96
    lens = torch.randint(1, T + 1, (B,), generator=g)
    m = torch.arange(T)[None, :] < lens[:, None]
    b = {"input_ids": torch.randint(0, 152_064, (B, T), generator=g).masked_fill(~m, 0), "attention_mask": m.long()}
    with trajstore.Writer(tmp_path) as w:
        w.append(0, b)
    r = trajstore.Reader(tmp_path)
    assert pq.read_metadata(r.file(0)).num_row_groups > 1
    joined = []
    real = joining.StreamJoin.parts
    monkeypatch.setattr(joining.StreamJoin, "parts", lambda self, t: joined.append(out := real(self, t)) or out)
    got = r.read(0, layout="packed")
    assert "input_ids" in joined[-1] and joined[-1]["input_ids"][1].dtype == np.int64
    assert torch.equal(got["input_ids"], b["input_ids"][m]) and got["input_ids"].dtype == torch.int64
    assert_batch_equal(r[0], b)
    for _, x in r.iter(prefetch=2, layout="packed"):
        assert torch.equal(x["input_ids"], b["input_ids"][m])


def test_int32_stored_ids_are_joined_into_the_arena_at_their_decoded_width(tmp_path, monkeypatch):
    """The pinned staging of replay to a GPU is sized for the decoded int64 values, not the int32
    column: a step whose ids alone outgrow the arena's slack joins every token column inside it."""
    import _dumps
    from trajstore import torch_bridge
    from trajstore.format.codec.late import flat_nbytes

    _dumps.many_row_groups(monkeypatch)
    g = torch.Generator().manual_seed(1)
    B, T = 64, 5000  # 2.6 MB of int64 ids, 1.3 MB stored
    b = {"input_ids": torch.randint(0, 152_064, (B, T), generator=g), "attention_mask": torch.ones(B, T, dtype=torch.bool),
         "logprobs": torch.randn(B, T, generator=g)}
    with trajstore.Writer(tmp_path) as w:
        w.append(0, b)
    r = trajstore.Reader(tmp_path)
    t = pq.read_table(r.file(0))
    assert str(t.schema.field("input_ids").type.value_type) == "int32"
    assert flat_nbytes(t) >= B * T * (8 + 4 + 1)
    arena = torch_bridge.Arena(torch_bridge.PinnedPool())
    got = r._read(0, None, "packed", arena)
    assert arena.holds(got["input_ids"]) and arena.holds(got["logprobs"])
    assert got["input_ids"].dtype == torch.int64 and torch.equal(got["input_ids"], b["input_ids"].reshape(-1))
    arena.release()


@settings(max_examples=60, deadline=None)
@given(st.one_of(padded_batches(), two_sided_batches(), prompt_completion_batches(), packed_batches(),
                 trajectory_lists(), group_lists()))
def test_every_form_round_trips_and_narrows_exactly_the_fitting_token_columns(tmp_path_factory, batch):
    """Over the batch forms (hypothesis: tensors of arbitrary bits, so int64 values of every range): the
    batch comes back bit for bit, every int64 token column (and cell column of a list batch) is int32
    exactly when it holds identifiers (by its name) and all its values fit, and a step holding one
    records format version 6."""
    d = tmp_path_factory.mktemp("forms")
    with trajstore.Writer(d) as w:
        w.append(0, batch)
    r = trajstore.Reader(d)
    assert_batch_equal(r[0], batch)
    t = pq.read_table(r.file(0))
    narrowed = False
    for f in t.schema:
        m = f.metadata or {}
        if m.get(b"trajstore.kind") not in (b"token", b"cell") or m.get(b"trajstore.dtype") != b"int64":
            continue
        vals = t.column(f.name).combine_chunks().flatten().to_numpy(zero_copy_only=False)
        fits = bool(len(vals) == 0 or (vals.min() >= I32[0] and vals.max() <= I32[1])) \
            and arrow.is_id_field((f.name.split(".")[-1],))
        assert f.type.value_type == (pa.int32() if fits else pa.int64()), f.name
        narrowed |= fits
    assert (_doc(r.file(0))["format_version"] == 6) == narrowed


def test_only_identifier_fields_are_narrowed_so_outside_sums_stay_exact(tmp_path):
    """A per-token int64 field that is not an identifier (a clock in ms) keeps int64 even where every
    value fits int32: Polars sums an int32 list in 32 bits (wrapping), so its row sums read from the
    file would be wrong. The ids beside it are narrowed."""
    polars = pytest.importorskip("polars")
    B, T = 2, 4
    m = torch.ones(B, T, dtype=torch.long)
    b = {"input_ids": torch.arange(B * T).reshape(B, T), "attention_mask": m,
         "clock_ms": torch.full((B, T), 2_000_000_000, dtype=torch.int64)}
    with trajstore.Writer(tmp_path) as w:
        w.append(0, b)
    f = trajstore.Reader(tmp_path).file(0)
    sch = pq.read_schema(f)
    assert sch.field("input_ids").type.value_type == pa.int32() and sch.field("clock_ms").type.value_type == pa.int64()
    sums = polars.read_parquet(f).select(polars.col("clock_ms").list.sum())["clock_ms"].to_list()
    assert sums == [4 * 2_000_000_000] * B
    assert [arrow.is_id_field((n,)) for n in ("input_ids", "prompt_ids", "position_ids", "responses", "uid_id",
                                              "versions", "clock_ms", "rewards", "attention_mask")] \
        == [True] * 5 + [False] * 4


def test_a_list_batch_appended_to_an_int64_dump_keeps_its_columns(tmp_path, monkeypatch):
    """A list batch (one trajectory None: its cell column built with nullable ``item`` entries) appended
    by this writer to a dump whose split records the column as int64 keeps the column's name and type."""
    def batch():
        return [{"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.tensor([[1, 1, 1]])}, None,
                {"input_ids": torch.tensor([[4, 5]]), "attention_mask": torch.tensor([[1, 1]])}]

    monkeypatch.setattr(arrow, "NARROW_TOKENS", False)
    with trajstore.Writer(tmp_path) as w:
        w.append(0, batch())
    monkeypatch.setattr(arrow, "NARROW_TOKENS", True)
    with trajstore.Writer(tmp_path) as w:
        w.append(1, batch())
    r = trajstore.Reader(tmp_path)
    names = [pq.read_schema(r.file(s)).names for s in (0, 1)]
    assert names[0] == names[1] and not any(n.startswith("input_ids__") for n in names[1])
    assert pq.read_schema(r.file(1)).field("input_ids").type.value_type == pa.int64()
    for s in (0, 1):
        assert_batch_equal(r[s], batch())
    with trajstore.Writer(tmp_path / "new") as w:  # a new dump narrows it
        w.append(0, batch())
    assert pq.read_schema(trajstore.Reader(tmp_path / "new").file(0)).field("input_ids").type.value_type == pa.int32()
