"""A token-balanced slice (``Reader(..., balance="tokens")``) reads the fields it decodes and the columns
that count each row's tokens (``shards.count_columns``), not every column of every shard, and gets what
reading every column gave (``read/shards.py`` ``_joined``); ``Reader.ids`` of such a slice reads only the
counting columns."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _shards import batch_rows, select
import trajstore
from trajstore.format.shard import shards
from trajstore.read import decode as read_decode
from trajstore.testing import (
    assert_batch_equal,
    packed_batches,
    padded_batches,
    prompt_completion_batches,
    trajectory_lists,
    two_sided_batches,
)

FORMS = st.one_of(padded_batches(), two_sided_batches(), prompt_completion_batches(), packed_batches(),
                  trajectory_lists())


def dump(d, batch, n: int) -> None:
    B = batch_rows(batch)
    for r in range(n):
        with trajstore.Writer(d, rank=r, world_size=n) as w:
            w.append(0, select(batch, list(range(B * r // n, B * (r + 1) // n))))


def outcome(read):
    try:
        return read()
    except Exception as e:  # the same refusal either way (a layout a form cannot take)
        return type(e), str(e)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_token_balanced_slice_of_some_columns_is_what_every_column_gave(tmp_path_factory, data):
    """Any form dumped by N ranks, any M dividing B, any ``columns`` and ``layout``: each rank's token-balanced
    slice read with the counting columns only equals the slice read from every column (the path before)."""
    batch = data.draw(FORMS)
    B = batch_rows(batch)
    n = data.draw(st.sampled_from([k for k in (1, 2, 3) if k <= B] or [1]))
    d = tmp_path_factory.mktemp("tokens")
    dump(d, batch, n)
    m = data.draw(st.sampled_from([k for k in range(2, B + 1) if B % k == 0] or [1]))
    names = [k for k, _ in trajstore.Reader(d).info(0)["batch"].get("keys", [])]  # a dict batch's fields
    columns = data.draw(st.sampled_from([None] + [[k] for k in names]))
    layout = data.draw(st.sampled_from([None, "packed", "padded"])) if isinstance(batch, dict) else None
    for k in range(m):
        r = trajstore.Reader(d, rank=k, world_size=m, balance="tokens")
        got = outcome(lambda: r.read(0, columns=columns, layout=layout))
        ids = r.ids(0)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(shards, "count_columns", lambda doc: None)  # every column, as before
            want = outcome(lambda: r.read(0, columns=columns, layout=layout))
            want_ids = r.ids(0)
        assert (ids == want_ids).all()
        if isinstance(want, tuple) and len(want) == 2 and isinstance(want[0], type):
            assert got == want
        else:
            assert_batch_equal(got, want)


def padded_dump(d, n: int = 4, rows: int = 6, T: int = 12) -> None:
    for r in range(n):
        g = torch.Generator().manual_seed(r)
        am = torch.arange(T)[None] < torch.randint(1, T + 1, (rows, 1), generator=g)
        with trajstore.Writer(d, rank=r, world_size=n) as w:
            w.append(0, {"input_ids": torch.randint(1, 99, (rows, T), generator=g) * am, "attention_mask": am,
                         "old_logprobs": torch.randn(rows, T, generator=g) * am, "rewards": torch.randn(rows, generator=g)})


def test_a_token_balanced_read_of_one_field_reads_its_columns_and_the_lengths(tmp_path, monkeypatch):
    padded_dump(tmp_path)
    read = []
    real = read_decode.read_columns
    monkeypatch.setattr(read_decode, "read_columns", lambda pf, src, cols, *a, **k: read.append(cols) or
                        real(pf, src, cols, *a, **k))
    r = trajstore.Reader(tmp_path, rank=1, world_size=2, balance="tokens")
    got = r.read(0, columns=["rewards"])
    assert read and all(set(c) == {"rewards", "step", "__len__attention_mask"} for c in read), read
    whole = trajstore.Reader(tmp_path)[0]
    rows = [int(i) for i in r.ids(0)[:, 1]]
    assert torch.equal(got["rewards"], whole["rewards"][rows])
    read.clear()
    r.ids(0)
    assert read and all(c == ["step", "__len__attention_mask"] for c in read), read
    read.clear()
    r.read(0)  # every field: every column but the attention mask of ones (rebuilt from the lengths)
    assert read and all("old_logprobs" in c and "attention_mask" not in c for c in read), read


def test_a_field_read_in_a_layout_from_shards_that_pad_another_field_their_own_way(tmp_path):
    """A layout conversion of some fields also reads one token field for the rows' lengths; where the shards
    store that field's padding differently (one a pad value, the other its padded values' column), its
    padding column is read too, so the shards join (the logical step and a token-balanced slice alike)."""
    ids = torch.tensor([[7, -2], [-5, -7], [-4, -8]])
    b = {"prompts": ids[:, :1], "responses": ids[:, 1:], "response_mask": torch.zeros(3, 1, dtype=torch.int64),
         "input_ids": ids, "attention_mask": torch.zeros(3, 2, dtype=torch.int64),
         "token_level_rewards": torch.tensor([[-3.8], [1.8e24], [-2.9e30]])}
    dump(tmp_path, b, 2)  # rank 1's two rows pad `responses` with two values: a __pad__ column there only
    r = trajstore.Reader(tmp_path)
    whole = r.read(0, layout="packed")
    got = r.read(0, columns=["prompts"], layout="packed")
    assert_batch_equal(got, {k: whole[k] for k in got})
    assert set(got) == {"prompts", "prompt_cu_seqlens", "prompt_max_seqlen"}
    part = trajstore.Reader(tmp_path, rank=0, world_size=3, balance="tokens").read(0, columns=["prompts"],
                                                                                    layout="packed")
    assert set(part) == set(got)
