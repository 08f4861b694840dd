"""``benchmarks/least.py``, the least replay that stages through pinned memory (the bound the padded benchmark
sets beside the decoder ceiling): what it stages of a step are the step's values as stored, every column a
packed replay reads and nothing else, so its rate is the rate of moving those bytes. No time is asserted."""

import threading

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

import trajstore
from benchmarks import least


def _batch(lengths: list[int], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.where(mask, torch.randint(0, 150_000, (B, T), generator=g), 0)
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": mask & (torch.rand(B, T, generator=g) < 0.6),
            "logprobs": torch.where(mask, -torch.rand(B, T, generator=g), 0.0),
            "rewards": torch.randn(B, generator=g)}


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12), seed=st.integers(0, 2 ** 16))
def test_it_stages_each_columns_values_as_stored(tmp_path_factory, lengths, seed):
    d = tmp_path_factory.mktemp("least") / "d"
    b = _batch(lengths, seed)
    with trajstore.Writer(d) as w:
        w.append(0, b)
    r = trajstore.Reader(d)
    f = r.file(0)
    cols = least.columns(f)
    assert "attention_mask" not in cols and {"input_ids", "loss_mask", "logprobs", "rewards"} <= set(cols)
    buf, where = least.stage(f, cols, lambda n: np.empty(n, np.uint8))
    got: dict = {}
    for name, lo, hi in where:
        got.setdefault(name, []).append(buf[lo:hi])
    packed = r.read(0, layout="packed")
    ids = np.concatenate(got["input_ids"]).view(np.int32)  # token ids stored as int32 (docs/FORMAT.md 3.2)
    assert ids.tolist() == packed["input_ids"].tolist()
    assert np.concatenate(got["logprobs"]).view(np.float32).tolist() == packed["logprobs"].tolist()
    assert np.concatenate(got["rewards"]).view(np.float32).tolist() == packed["rewards"].tolist()
    # a bool column: its bitmap's bytes, least significant bit first (one chunk: no bits of another row group)
    bits = np.unpackbits(np.concatenate(got["loss_mask"]), bitorder="little")[:len(packed["loss_mask"])]
    assert bits.astype(bool).tolist() == packed["loss_mask"].tolist()
    assert {name for name, _, _ in where} == set(cols) and sum(hi - lo for _, lo, hi in where) == len(buf)


def test_a_pass_reads_every_file_k_at_a_time(tmp_path, monkeypatch):
    """``gbps`` stages each file once, on at most ``k`` threads at once, and gives the bytes over the pass."""
    with trajstore.Writer(tmp_path / "d") as w:
        for s in range(5):
            w.append(s, _batch([5, 9, 3], s))
    r = trajstore.Reader(tmp_path / "d")
    files = [r.file(s) for s in r.steps] * 2
    seen, running, most = [], [0], [0]
    real, lock = least.stage, threading.Lock()

    def spy(f, cols, take):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            seen.append(f)
        try:
            return real(f, cols, take)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(least, "stage", spy)
    rate = least.gbps(files, 10 ** 6, 3)
    assert sorted(map(str, seen)) == sorted(map(str, files)) and most[0] <= 3 and rate > 0



@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12), seed=st.integers(0, 2 ** 16),
       row_groups=st.integers(1, 3))
def test_the_least_cpu_read_gives_the_packed_values(tmp_path_factory, monkeypatch, lengths, seed, row_groups):
    """``least.read_cpu`` (the benchmark's floor of a packed read to host memory): each column's values, as
    ``Reader.read(step, layout="packed")`` gives them (ids widened to int64, bools unpacked), over row groups."""
    from trajstore.format.file import parquet as pq_layout

    monkeypatch.setattr(pq_layout, "ROW_GROUP_BYTES", 1)  # several row groups: chunks to join
    monkeypatch.setattr(pq_layout, "ROW_GROUPS", row_groups)
    d = tmp_path_factory.mktemp("least_cpu") / "d"
    with trajstore.Writer(d, workers=1) as w:
        w.append(0, _batch(lengths, seed))
    r = trajstore.Reader(d)
    f = r.file(0)
    import pyarrow.parquet as pq

    groups = pq.ParquetFile(f).metadata.num_row_groups
    assert groups > 1 if row_groups > 1 and len(lengths) > 1 else groups == 1
    got, packed = least.read_cpu(f, least.columns(f)), r.read(0, layout="packed")
    for name in ("input_ids", "loss_mask", "logprobs", "rewards"):
        want = packed[name]
        assert got[name].dtype == want.numpy().dtype and got[name].tolist() == want.tolist(), name
