"""Joining shards, case by case (trajstore/format/shard/shards.py, docs/FORMAT.md 3.12): containers and
their ``meta_info`` (verl's ``DataProto.concat``), the step metadata, values whose types differ,
what is refused and how it says so; token counts and the replaying ranks' partitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _shards import decode, encode, joined, select, shard
from trajstore.errors import ConfigError, FormatError
from trajstore.format.batch.containers import DataProtoLike
from trajstore.format.shard.shards import join, partition, take, token_counts
from trajstore.testing import assert_batch_equal


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


def test_tensordict_with_non_tensor_entries():
    tensordict = pytest.importorskip("tensordict")
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    td = tensordict.TensorDict({"input_ids": m * 3, "attention_mask": m}, batch_size=[3])
    td.set_non_tensor("mode", "train")
    td.set("tags", tensordict.NonTensorStack.from_list(["a", "b", "c"]))
    for chunks in ([[0], [1, 2]], [[0, 1, 2]], [[], [0, 1], [2]]):
        assert_batch_equal(decode(*joined(td, chunks)), td)
    doc, table = encode(td)
    assert_batch_equal(decode(*take(doc, table, [0, 2])), select(td, [0, 2]))


def test_tensordict_data_that_differs_becomes_a_stack():
    """As ``TensorDict.cat`` (inside verl's ``DataProto.concat``) makes it."""
    tensordict = pytest.importorskip("tensordict")
    tds = []
    for mode, n in (("train", 2), ("eval", 1)):
        td = tensordict.TensorDict({"x": torch.arange(n)}, batch_size=[n])
        td.set_non_tensor("mode", mode)
        tds.append(td)
    got = decode(*join([shard(td, r, 2) for r, td in enumerate(tds)]))
    want = torch.cat(tds)
    assert type(got.get("mode")).__name__ == type(want.get("mode")).__name__ == "NonTensorStack"
    assert got.get("mode").tolist() == want.get("mode").tolist() == ["train", "train", "eval"]
    assert_batch_equal(got["x"], want["x"])
