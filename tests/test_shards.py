"""The shards of a step joined into the logical batch, and slices of it (trajstore/format/shard/shards.py,
docs/FORMAT.md 3.12): every batch form cut the way dispatch cuts it, each chunk encoded as a rank's
shard, ``join`` decoded by the ordinary decoder is the batch bit for bit; ``take`` of any rows is
those rows; shards padded to widths of their own join widened."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _shards import batch_rows, cuts, decode, encode, joined, select, shard
from trajstore import schema
from trajstore.format.batch.containers import DataProtoLike
from trajstore.format.batch.masks import classify, token_mask
from trajstore.format.shard.shards import RANK_COLUMN, count_columns, join, partition, take, token_counts, uniform
from trajstore.format.spec import columns_for, fields
from trajstore.testing import (
    assert_batch_equal,
    batches,
    group_lists,
    image_batches,
    packed_batches,
    padded_batches,
    prompt_completion_batches,
    tensors,
    trajectory_lists,
    two_sided_batches,
    typed_batches,
)

SETTINGS = settings(deadline=None, suppress_health_check=list(HealthCheck))


# ----------------------------------------------------------------------------- join and take round trips
FORMS = st.one_of(batches(), padded_batches(), two_sided_batches(), prompt_completion_batches(), group_lists(),
                  trajectory_lists(), packed_batches(), typed_batches(dataproto=True), image_batches())


@SETTINGS
@given(st.data())
def test_join_of_chunks_is_the_batch(data):
    batch = data.draw(FORMS)
    chunks = cuts(data.draw, batch_rows(batch))
    assert_batch_equal(decode(*joined(batch, chunks)), batch)


@SETTINGS
@given(st.data())
def test_take_is_the_rows(data):
    batch = data.draw(FORMS)
    doc, table = encode(batch)
    B = doc["num_rows"]
    rows = sorted(data.draw(st.lists(st.integers(0, max(B - 1, 0)), unique=True, max_size=B))) if B else []
    assert_batch_equal(decode(*take(doc, table, rows)), select(batch, rows))


@SETTINGS
@given(st.data())
def test_partitions_taken_and_joined(data):
    """Every rank's slice of either kind is its rows of the batch; the contiguous slices joined
    in rank order are the batch."""
    batch = data.draw(FORMS)
    doc, table = encode(batch)
    B = doc["num_rows"]
    M = data.draw(st.sampled_from([m for m in range(1, B + 1) if B % m == 0] or [1]))
    if not B:
        return
    for how in ("contiguous", "tokens"):
        slices = partition(B, M, how, token_counts(doc, table))
        parts = [take(doc, table, rows) for rows in slices]
        for rows, (d, t) in zip(slices, parts):
            assert_batch_equal(decode(d, t), select(batch, rows))
        if how == "contiguous":
            assert_batch_equal(decode(*join(parts)), batch)


@SETTINGS
@given(st.data())
def test_token_counts_read_only_their_columns(data):
    """``count_columns`` names every column ``token_counts`` reads (a token-balanced slice reads those
    beside the fields it decodes): the counts of a step's table of those columns alone are the whole
    table's, and so are those of the join of shards read for those columns alone (shards of one spec, or
    of a packed batch); None only for a list batch."""
    batch = data.draw(FORMS)
    doc, table = encode(batch)
    cols = count_columns(doc)
    assert (cols is None) == (doc["batch"]["t"] == "seq")
    if cols is None:
        return
    assert set(cols) <= set(table.column_names)
    assert np.array_equal(token_counts(doc, table.select(cols)), token_counts(doc, table))
    parts = [shard(select(batch, rows), r, 9) for r, rows in enumerate(cuts(data.draw, batch_rows(batch)))]
    if doc["batch"].get("form") == "packed" or uniform([d for d, _ in parts]):
        few = join([(d, t.select(count_columns(d))) for d, t in parts])
        assert np.array_equal(token_counts(*few), token_counts(*join(parts)))


@SETTINGS
@given(st.data())
def test_join_of_tables_read_for_one_field(data):
    """Shards read for some fields only (``columns=``, each shard's own columns for them) join
    into those fields of the batch."""
    batch = data.draw(FORMS)
    parts = [shard(select(batch, rows), r, 9) for r, rows in enumerate(cuts(data.draw, batch_rows(batch)))]
    names = sorted({k for d, _ in parts for k in fields(d["batch"])})
    if not names:
        return
    name = data.draw(st.sampled_from(names))
    read = [(d, t.select(["step"] + (columns_for(d["batch"], [name]) if name in fields(d["batch"]) else [])))
            for d, t in parts]
    doc, table = join(read)
    got = schema.decode(table, doc["batch"], where="joined", columns=[name])
    whole = decode(*join(parts))
    if isinstance(whole, list | tuple):
        assert_batch_equal(got, type(whole)(None if e is None else {k: v for k, v in e.items() if k == name}
                                            for e in whole))
    else:
        plain = whole if isinstance(whole, dict) else {**dict(whole.batch.items() if whole.batch is not None else {}),
                                                       **whole.non_tensor_batch} if isinstance(whole, DataProtoLike) \
            else dict(whole.items())
        got = got if isinstance(got, dict) else {**dict(got.batch.items() if got.batch is not None else {}),
                                                 **got.non_tensor_batch} if isinstance(got, DataProtoLike) \
            else dict(got.items())
        assert_batch_equal(got[name], plain[name])


@pytest.mark.parametrize("rows", [
    [{"a": np.False_}, None, []],  # found by hypothesis: a struct in one shard, a value in the other
    [{"a": np.int64(3)}, {"a": np.int64(4)}, [], None],
    [{"a": np.float32(1.5)}, torch.ones(2)],  # a struct and a tensor cell
])
@pytest.mark.parametrize("cut", [1, 2])
def test_join_of_a_dict_field_and_other_values_in_other_shards(rows, cut):
    # a dict holding numpy scalars is stored as a struct; [None, []] or a tensor are not: the joined
    # field holds every row as a typed document, each value (and its numpy type) as it was
    batch = {"r": torch.arange(len(rows), dtype=torch.float32), "lst": rows}
    parts = [shard(select(batch, list(range(0, cut))), 0, 2), shard(select(batch, list(range(cut, len(rows)))), 1, 2)]
    got = decode(*join(parts))
    assert_batch_equal(got, batch)
    assert [type(x.get("a")) if isinstance(x, dict) else type(x) for x in got["lst"]] == \
        [type(x.get("a")) if isinstance(x, dict) else type(x) for x in rows]


def test_join_of_one_shard_drops_rank_and_shard():
    batch = {"input_ids": torch.arange(6).reshape(2, 3), "attention_mask": torch.ones(2, 3, dtype=torch.bool)}
    doc, table = join([shard(batch, 0, 1)])
    assert "shard" not in doc and RANK_COLUMN not in table.column_names
    assert_batch_equal(decode(doc, table), batch)


# ----------------------------------------------------------------------------- shards of different widths
def _pad_to(x: torch.Tensor, W: int, side: str, fill: torch.Tensor, last: bool = False) -> torch.Tensor:
    ax = -1 if last else 1
    extra = W - x.shape[ax]
    if not extra:
        return x
    shape = list(x.shape)
    shape[ax] = extra
    f = fill.reshape([]).expand(shape).clone() if fill.numel() else torch.zeros(shape, dtype=x.dtype)
    return torch.cat([f, x] if side == "left" else [x, f], dim=ax)


def _own_pad(x: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor | None:
    """The one value every padded position of ``x`` holds (bit for bit), else None."""
    vals = x[pad_mask]
    if not vals.numel():
        return None
    b = vals.reshape(-1).view(torch.int16 if x.element_size() == 2 else torch.uint8 if x.element_size() == 1
                              else torch.int32 if x.element_size() == 4 else torch.int64)
    return vals.reshape(-1)[:1] if bool((b == b[0]).all()) else None


@st.composite
def width_shards(draw, side: str) -> list[dict]:
    """The batches of 1-4 ranks, each padded to its own width on ``side`` (right, left or two-sided),
    each per-token field's padding one value per rank (the ranks' values may differ: 0.0 / -0.0),
    or its own values (``noise``)."""
    out = []
    for _ in range(draw(st.integers(1, 4))):
        B, T = draw(st.integers(0, 3)), draw(st.integers(0, 6))
        ar = torch.arange(T)
        rows = []
        for _ in range(B):
            n = draw(st.integers(0, T))
            s = {"right": 0, "left": T - n}.get(side, draw(st.integers(0, T - n)))
            rows.append((ar >= s) & (ar < s + n))
        m = torch.stack(rows) if rows else torch.zeros(0, T, dtype=torch.bool)
        pid = draw(st.integers(0, 2))
        lp_pad = draw(st.sampled_from([0.0, -0.0]))
        b = {"input_ids": torch.where(m, draw(tensors((B, T), [torch.int64])), pid),
             "attention_mask": m.to(torch.int64),
             "logprobs": torch.where(m, draw(tensors((B, T), [torch.float32, torch.bfloat16])).float(),
                                     torch.tensor(lp_pad)).to(torch.bfloat16),
             "noise": draw(tensors((B, T), [torch.int16])),
             "rope": torch.where(m[:, None, :], draw(tensors((B, 7, T), [torch.int32])), torch.tensor(-1, dtype=torch.int32)),
             "rewards": draw(tensors((B,), [torch.float32]))}
        out.append(b)
    return out


def _expected(shards: list[dict]) -> dict:
    """The joined batch: every rank's per-token fields widened to the widest rank on the padding
    side (the left when every rank is left-padded, else the right), the new positions holding the
    rank's pad value (where its padding is one value; else the first rank's that is, else 0). A
    rank without rows adds nothing, its width included."""
    shards = [b for b in shards if len(b["rewards"])] or shards[:1]
    W = max(b["attention_mask"].shape[1] for b in shards)
    masks = [token_mask(b["attention_mask"]) for b in shards]
    sides = [classify(m)[0] if m.shape[1] else "right" for m in masks]
    loose = [bool(((m.sum(1) == 0) | (m.sum(1) == m.shape[1])).all()) for m in masks]
    ext = "left" if "left" in sides and all(s == "left" or lo for s, lo in zip(sides, loose)) else "right"
    out = {}
    for k in shards[0]:
        if k == "rewards":
            out[k] = torch.cat([b[k] for b in shards])
            continue
        last = k == "rope"
        owns = [_own_pad(b[k], ~(m[:, None, :].expand_as(b[k]) if last else m)) for b, m in zip(shards, masks)]
        common = next((p for p in owns if p is not None), torch.zeros(1, dtype=shards[0][k].dtype))
        out[k] = torch.cat([_pad_to(b[k], W, ext, p if p is not None else common, last)
                            for b, p in zip(shards, owns)])
    return out


@pytest.mark.parametrize("side", ["right", "left", "span"])
@SETTINGS
@given(data=st.data())
def test_join_widens_shards_of_other_widths(side, data):
    shards = data.draw(width_shards(side))
    doc, table = join([shard(b, r, len(shards)) for r, b in enumerate(shards)])
    assert_batch_equal(decode(doc, table), _expected(shards))


def test_join_two_sided_responses_of_other_widths():
    """verl: prompts left-padded to one width, responses right-padded to each rank's longest."""
    def rank(lengths_p: list[int], lengths_r: list[int], R: int) -> dict:
        P = 4
        pm = torch.arange(P)[None, :] >= (P - torch.tensor(lengths_p))[:, None]
        rm = torch.arange(R)[None, :] < torch.tensor(lengths_r)[:, None]
        am = torch.cat([pm, rm], 1)
        ids = torch.where(am, torch.arange(am.numel()).reshape(am.shape) + 10, 0)
        return {"prompts": ids[:, :P], "responses": ids[:, P:], "input_ids": ids, "attention_mask": am.to(torch.int64),
                "response_mask": rm.to(torch.int64), "old_log_probs": torch.where(rm, 0.5, 0.0)}

    a, b = rank([2, 4], [3, 1], 3), rank([1], [5], 6)
    doc, table = join([shard(a, 0, 2), shard(b, 1, 2)])
    assert doc["batch"]["form"] == "masked"
    want = {k: torch.cat([_pad_to(a[k], b[k].shape[1], "right", torch.zeros(1, dtype=a[k].dtype)), b[k]])
            if a[k].shape[1] != b[k].shape[1] else torch.cat([a[k], b[k]]) for k in a}
    assert_batch_equal(decode(doc, table), want)


def test_join_prompt_completion_of_other_widths():
    """TRL: each rank's prompts left-padded and completions right-padded to its own longest; the
    join pads each group on its own side to the widest rank's."""
    def rank(p: list[int], c: list[int], P: int, C: int) -> dict:
        pm = torch.arange(P)[None, :] >= (P - torch.tensor(p))[:, None]
        cm = torch.arange(C)[None, :] < torch.tensor(c)[:, None]
        return {"prompt_ids": torch.where(pm, 5, 0), "prompt_mask": pm.to(torch.int64),
                "completion_ids": torch.where(cm, 7, 0), "completion_mask": cm.to(torch.int64),
                "old_per_token_logps": torch.where(cm, 0.25, 0.0), "advantages": torch.arange(len(p), dtype=torch.float32)}

    a, b = rank([1, 3], [2, 4], 3, 4), rank([2], [1], 2, 6)
    doc, table = join([shard(a, 0, 2), shard(b, 1, 2)])
    assert doc["batch"]["form"] == "masked" and [g["W"] for g in doc["batch"]["masks"]] == [3, 6]
    want = {"prompt_ids": torch.tensor([[0, 0, 5], [5, 5, 5], [0, 5, 5]]),
            "prompt_mask": torch.tensor([[0, 0, 1], [1, 1, 1], [0, 1, 1]]),
            "completion_ids": torch.tensor([[7, 7, 0, 0, 0, 0], [7, 7, 7, 7, 0, 0], [7, 0, 0, 0, 0, 0]]),
            "completion_mask": torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]]),
            "old_per_token_logps": torch.tensor([[0.25, 0.25, 0, 0, 0, 0], [0.25] * 4 + [0, 0], [0.25] + [0.0] * 5]),
            "advantages": torch.tensor([0.0, 1.0, 0.0])}
    assert_batch_equal(decode(doc, table), want)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lists=st.lists(st.lists(st.integers(-2**31, 2**31 - 1), max_size=6), min_size=1, max_size=12),
       splits=st.lists(st.integers(0, 12), max_size=4), data=st.data())
def test_the_rows_a_slice_takes_are_pyarrows_take_column_by_column(monkeypatch, lists, splits, data):
    """A slice's rows taken from a joined table (``shards.take``: each column joined, then taken, the columns
    at once on the pool) equal pyarrow's own ``Table.take`` for any rows, in any order, repeated, whatever
    the table's chunks."""
    import pyarrow as pa
    from trajstore.base import threads
    from trajstore.format.shard.shards import _take_rows

    monkeypatch.setattr(threads, "PARALLEL_BYTES", 0)  # every take on the pool
    n = len(lists)
    bounds = sorted({0, n, *(min(c, n) for c in splits)})
    def chunked(arr: pa.Array) -> pa.ChunkedArray:
        return pa.chunked_array([arr.slice(a, b - a) for a, b in zip(bounds, bounds[1:])], type=arr.type)
    t = pa.table({"ids": chunked(pa.array(lists, pa.large_list(pa.int32()))),
                  "mask": chunked(pa.array([[v % 2 == 0 for v in x] for x in lists], pa.large_list(pa.bool_()))),
                  "reward": chunked(pa.array([float(len(x)) for x in lists], pa.float32()))})
    rows = data.draw(st.lists(st.integers(0, n - 1), max_size=2 * n))
    idx = pa.array(rows, pa.int64())
    got = _take_rows(t, idx)
    assert got.schema == t.schema and got.equals(t.take(idx))
