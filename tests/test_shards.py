"""The shards of a step joined into the logical batch, and slices of it (trajstore/format/shards.py,
docs/FORMAT.md 3.12): every batch form cut the way dispatch cuts it, each chunk encoded as a rank's
shard, ``join`` decoded by the ordinary decoder is the batch bit for bit; ``take`` of any rows is
those rows; ``partition`` covers every row once, deterministically, balanced."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trajstore import schema
from trajstore.errors import ConfigError, FormatError
from trajstore.format import validate
from trajstore.format.containers import DataProtoLike
from trajstore.format.layout import classify, token_mask
from trajstore.format.shards import RANK_COLUMN, join, partition, take, token_counts
from trajstore.format.spec import columns_for, fields
from trajstore.testing import (assert_batch_equal, batches, group_lists, image_batches, packed_batches,
                               padded_batches, prompt_completion_batches, tensors, trajectory_lists, two_sided_batches,
                               typed_batches)

SETTINGS = settings(deadline=None, suppress_health_check=list(HealthCheck))


# ----------------------------------------------------------------------------- helpers
def encode(batch, step: int = 7, meta: dict | None = None) -> tuple[dict, pa.Table]:
    t = schema.encode(batch, step=step, split="train", meta=meta)
    return json.loads(t.schema.metadata[b"trajstore"]), t


def shard(batch, r: int, n: int, meta: dict | None = None) -> tuple[dict, pa.Table]:
    """A rank's shard as the writer stores it: its envelope names it, its table has ``rank``."""
    doc, t = encode(batch, meta=meta)
    doc["shard"] = {"rank": r, "world_size": n}
    return doc, t.append_column(pa.field(RANK_COLUMN, pa.int32()), pa.array(np.full(t.num_rows, r, np.int32)))


def decode(doc: dict, table: pa.Table):
    validate.check(doc, table.schema, table.num_rows, "joined")
    assert doc["num_rows"] == table.num_rows and RANK_COLUMN not in table.column_names
    return schema.decode(table, doc["batch"], where="joined")


def _rows(batch) -> int:
    if isinstance(batch, list | tuple):
        return len(batch)
    if isinstance(batch, DataProtoLike):
        return len(batch)
    doc, _ = encode(batch)
    return doc["num_rows"]


def select(batch, rows: list[int]):
    """The trajectories ``rows`` of a batch, as a framework's dispatch cuts it: per-row fields
    indexed, per-token fields of a packed batch and image rows by their runs, ``cu_seqlens``
    rebuilt, batch-wide values (widths, ``max_seqlen``, ``meta_info``) kept."""
    if isinstance(batch, list):
        return [batch[i] for i in rows]
    if isinstance(batch, tuple):
        return tuple(batch[i] for i in rows)
    if isinstance(batch, DataProtoLike):
        idx = torch.tensor(rows, dtype=torch.int64)
        return DataProtoLike(batch=None if batch.batch is None else batch.batch[idx],
                             non_tensor_batch={k: v[rows] for k, v in batch.non_tensor_batch.items()},
                             meta_info=batch.meta_info)
    if hasattr(batch, "batch_size"):  # a TensorDict
        return batch[torch.tensor(rows, dtype=torch.int64)]
    spec = encode(batch)[0]["batch"]
    return {k: _cut(batch[k], node, rows, spec, batch, k) for k, node in spec["keys"]}


def _runs(counts: list[int], rows: list[int]) -> list[int]:
    start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return [j for i in rows for j in range(int(start[i]), int(start[i + 1]))]


def _cut(v, node: dict, rows: list[int], spec: dict, batch: dict, name: str):
    t = node["t"]
    if t == "group":
        return {k: _cut(v[k], n, rows, spec, batch, k) for k, n in node["keys"]}
    if t == "seq":
        return v[rows] if isinstance(v, np.ndarray) else type(v)(v[i] for i in rows)
    if t == "segtensor":
        return v[_runs(node["counts"], rows)]
    if t == "gtensor" and spec["form"] == "packed" and name == "cu_seqlens":
        lens = (v[1:] - v[:-1])[rows]
        out = torch.zeros(len(rows) + 1, dtype=v.dtype)
        out[1:] = lens.cumsum(0)
        return out
    if t == "tensor" and spec["form"] == "packed" and node["kind"] == "token":
        cu = batch["cu_seqlens"]
        return v[_runs((cu[1:] - cu[:-1]).tolist(), rows)]
    if t == "tensor":
        return v[rows] if isinstance(v, np.ndarray) else v[torch.tensor(rows, dtype=torch.int64)]
    return v  # a value of the whole batch


def cuts(draw, B: int) -> list[list[int]]:
    """N chunks of 0..B-1 in order: equal (DataProto.chunk) or uneven (each rank its own rollouts)."""
    n = draw(st.integers(1, 4))
    if draw(st.booleans()) and B % n == 0:
        bounds = [B * r // n for r in range(n + 1)]
    else:
        bounds = [0] + sorted(draw(st.lists(st.integers(0, B), min_size=n - 1, max_size=n - 1))) + [B]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def joined(batch, chunks: list[list[int]], metas: list | None = None):
    parts = [shard(select(batch, rows), r, len(chunks), None if metas is None else metas[r])
             for r, rows in enumerate(chunks)]
    return join(parts)


# ----------------------------------------------------------------------------- join and take round trips
FORMS = st.one_of(batches(), padded_batches(), two_sided_batches(), prompt_completion_batches(), group_lists(),
                  trajectory_lists(), packed_batches(), typed_batches(dataproto=True), image_batches())


@SETTINGS
@given(st.data())
def test_join_of_chunks_is_the_batch(data):
    batch = data.draw(FORMS)
    chunks = cuts(data.draw, _rows(batch))
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
def test_join_of_tables_read_for_one_field(data):
    """Shards read for some fields only (``columns=``, each shard's own columns for them) join
    into those fields of the batch."""
    batch = data.draw(FORMS)
    parts = [shard(select(batch, rows), r, 9) for r, rows in enumerate(cuts(data.draw, _rows(batch)))]
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


# ----------------------------------------------------------------------------- containers, values, meta
def test_dataproto_meta_info_merged_as_verl_concat():
    tensordict = pytest.importorskip("tensordict")

    def proto(ids, meta):
        td = tensordict.TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, batch_size=[len(ids)])
        return DataProtoLike(batch=td, non_tensor_batch={"uid": np.array([f"u{i}" for i in range(len(ids))], dtype=object)},
                             meta_info=meta)

    a = proto(torch.arange(6).reshape(2, 3), {"temperature": 1.0, "metrics": {"t": 1}})
    b = proto(torch.arange(3).reshape(1, 3), {"temperature": 1.0, "metrics": {"t": 2}})
    doc, table = join([shard(a, 0, 2), shard(b, 1, 2)])
    got = decode(doc, table)
    assert got.meta_info == {"temperature": 1.0, "metrics": {"t": [1, 2]}}
    assert list(got.batch.batch_size) == [3]
    assert list(got.non_tensor_batch["uid"]) == ["u0", "u1", "u0"]
    same = decode(*join([shard(a, 0, 2), shard(proto(torch.arange(3).reshape(1, 3), a.meta_info), 1, 2)]))
    assert same.meta_info == a.meta_info  # chunks of one batch keep its meta_info as it was
    c = proto(torch.arange(3).reshape(1, 3), {"temperature": 0.5})
    with pytest.raises(FormatError, match=r"step 7.*ranks \[0, 1\].*meta_info key 'temperature'.*one by one"):
        join([shard(a, 0, 2), shard(c, 1, 2)])


def test_step_meta_of_ranks():
    b = {"rewards": torch.zeros(2)}
    doc, _ = join([shard(b, 0, 2, {"lr": 1e-6, "host": "a"}), shard(b, 1, 2, {"lr": 1e-6, "host": "b"})])
    assert doc["meta"] == {"lr": 1e-6, "host": ["a", "b"]}
    doc, _ = join([shard(b, 0, 2, {"lr": 1e-6}), shard(b, 1, 2, {"lr": 1e-6})])
    assert doc["meta"] == {"lr": 1e-6}


def test_value_types_that_differ_become_typed_json():
    a = {"rewards": torch.zeros(2), "info": ["x", "y"], "score": [1, 2]}
    b = {"rewards": torch.zeros(1), "info": [{"k": [1, float("nan")]}], "score": [0.5]}
    got = decode(*join([shard(a, 0, 2), shard(b, 1, 2)]))
    assert_batch_equal(got, {"rewards": torch.zeros(3), "info": ["x", "y", {"k": [1, float("nan")]}], "score": [1, 2, 0.5]})


def test_batch_wide_value_that_differs_is_refused():
    a = {"rewards": torch.zeros(2), "temperature": 1.0}
    b = {"rewards": torch.zeros(1), "temperature": 0.7}
    with pytest.raises(FormatError, match=r"step 7: the shards of ranks \[0, 1\].*'temperature'.*between ranks 0 "
                                          r"and 1.*one by one"):
        join([shard(a, 0, 2), shard(b, 1, 2)])


def test_dtype_that_differs_is_refused():
    a = {"rewards": torch.zeros(2), "x": torch.zeros(2, dtype=torch.float32)}
    b = {"rewards": torch.zeros(1), "x": torch.zeros(1, dtype=torch.float64)}
    with pytest.raises(FormatError, match=r"field 'x'.*dtypes"):
        join([shard(a, 0, 2), shard(b, 1, 2)])


def test_moved_column_is_renamed():
    """A rank that stored a field under a moved name (docs/FORMAT.md 3.11) joins by the spec."""
    a, b = shard({"rewards": torch.zeros(2)}, 0, 2), shard({"rewards": torch.ones(1)}, 1, 2)
    doc, t = b
    doc["batch"]["keys"][0][1]["col"] = "rewards__float"
    t = t.rename_columns(["rewards__float" if c == "rewards" else c for c in t.column_names])
    got = decode(*join([a, (doc, t)]))
    assert_batch_equal(got, {"rewards": torch.tensor([0.0, 0.0, 1.0])})


def test_packed_field_a_shard_could_not_tell():
    """A rank with as many tokens as trajectories cannot tell a per-trajectory field from a
    per-token one by its shape (docs/FORMAT.md 3.4); the ranks that could decide."""
    a = {"input_ids": torch.arange(3), "cu_seqlens": torch.tensor([0, 2, 3], dtype=torch.int32),
         "adv": torch.tensor([1.0, 2.0]), "rewards": torch.arange(3.0)}
    b = {"input_ids": torch.arange(2), "cu_seqlens": torch.tensor([0, 1, 2], dtype=torch.int32),
         "adv": torch.tensor([3.0, 4.0]), "rewards": torch.tensor([5.0, 6.0])}
    assert dict(encode(b)[0]["batch"]["keys"])["adv"]["kind"] == "token"
    assert dict(encode(b)[0]["batch"]["keys"])["rewards"]["kind"] == "sample"
    got = decode(*join([shard(a, 0, 2), shard(b, 1, 2)]))
    assert_batch_equal(got, {"input_ids": torch.tensor([0, 1, 2, 0, 1]),
                             "cu_seqlens": torch.tensor([0, 2, 3, 4, 5], dtype=torch.int32),
                             "adv": torch.tensor([1.0, 2.0, 3.0, 4.0]), "rewards": torch.tensor([0.0, 1, 2, 5, 6])})


def test_image_rows_one_per_sample_in_a_shard():
    """A rank whose samples have one patch row each stores ``pixel_values`` per sample (3.9)."""
    a = {"rewards": torch.zeros(2), "pixel_values": torch.arange(8.0).reshape(4, 2),
         "image_grid_thw": torch.tensor([[1, 1, 3], [1, 1, 1]])}
    b = {"rewards": torch.ones(2), "pixel_values": torch.arange(4.0).reshape(2, 2),
         "image_grid_thw": torch.tensor([[1, 1, 1], [1, 1, 1]])}
    assert dict(encode(b)[0]["batch"]["keys"])["pixel_values"]["t"] == "tensor"
    got = decode(*join([shard(a, 0, 2), shard(b, 1, 2)]))
    assert_batch_equal(got, {k: torch.cat([a[k], b[k]]) for k in a})


def test_dataproto_with_tensordict_joined_and_taken():
    tensordict = pytest.importorskip("tensordict")
    m = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 0]])
    td = tensordict.TensorDict({"input_ids": m * 7, "attention_mask": m,
                                "extra": tensordict.TensorDict({"lp": m * 0.5}, batch_size=[4])}, batch_size=[4])
    batch = DataProtoLike(batch=td, non_tensor_batch={"uid": np.array(["a", "b", "c", "d"], dtype=object)},
                          meta_info={"temperature": 1.0})
    for chunks in ([[0, 1], [2, 3]], [[0], [], [1, 2, 3]]):
        assert_batch_equal(decode(*joined(batch, chunks)), batch)
    doc, table = encode(batch)
    for rows in ([1, 3], [0], []):
        assert_batch_equal(decode(*take(doc, table, rows)), select(batch, rows))


# ----------------------------------------------------------------------------- token counts, partitions
def test_token_counts_of_each_form():
    m = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert token_counts(*encode({"input_ids": m * 5, "attention_mask": m})).tolist() == [2, 3, 0]
    packed = {"input_ids": torch.arange(5), "cu_seqlens": torch.tensor([0, 2, 2, 5], dtype=torch.int32)}
    assert token_counts(*encode(packed)).tolist() == [2, 0, 3]
    rows = [{"input_ids": torch.zeros(4), "attention_mask": torch.tensor([1, 1, 0, 0])}, None,
            {"input_ids": torch.zeros(2), "attention_mask": torch.ones(2, dtype=torch.int64)}]
    assert token_counts(*encode(rows)).tolist() == [2, 0, 2]
    assert token_counts(*encode({"rewards": torch.zeros(3)})).tolist() == [1, 1, 1]


@given(st.lists(st.integers(0, 50), max_size=24), st.integers(1, 8))
def test_partitions_cover_every_row_once_and_balance(counts, M):
    B = len(counts)
    if B % M:
        with pytest.raises(ConfigError, match=f"step 3: .*B={B}.*M={M}.*world size"):
            partition(B, M, "tokens", counts, what="step 3")
        return
    for how in ("contiguous", "tokens"):
        parts = partition(B, M, how, counts)
        assert parts == partition(B, M, how, list(counts))  # deterministic
        assert sorted(i for p in parts for i in p) == list(range(B))
        assert all(len(p) == B // M and p == sorted(p) for p in parts)
    totals = [sum(counts[i] for i in p) for p in partition(B, M, "tokens", counts)]
    assert max(totals) - min(totals) <= max(counts, default=0)
    assert partition(B, M, "contiguous") == [list(range(r * B // M, (r + 1) * B // M)) for r in range(M)]


def test_partition_errors_say_what_to_do():
    with pytest.raises(ConfigError, match=r"step 3: a batch of B=6 trajectories cannot be split into M=4.*divides 6"):
        partition(6, 4, what="step 3")
    with pytest.raises(ConfigError, match="M=0"):
        partition(6, 0)
    with pytest.raises(ConfigError, match="M=8"):
        partition(6, 8)
    with pytest.raises(ConfigError, match="balance"):
        partition(6, 2, "random")
    with pytest.raises(ConfigError, match="token counts"):
        partition(6, 2, "tokens", [1, 2])
    assert partition(0, 3) == [[], [], []]
    assert partition(4, 2, "tokens", [1, 9, 9, 1]) == [[0, 1], [2, 3]]
