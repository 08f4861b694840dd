"""Reader.column (one field of many steps) and the chunked / parallel decode paths."""

import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _dumps import in_forked_child, write
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore.base import threads as _threads
from trajstore import schema
from trajstore.format.file import parquet
from trajstore.errors import ConfigError, FormatError, StepNotFoundError
from trajstore.testing import assert_batch_equal, batches, padded_batches


def _field_of(batch, name):
    if isinstance(batch, list | tuple):
        return [None if e is None else e.get(name) for e in batch]
    return batch[name]


def _names(batch):
    if isinstance(batch, list | tuple):
        return sorted({k for e in batch if e is not None for k in e})
    return list(batch)


@settings(max_examples=25, deadline=None)
@given(st.lists(batches(), min_size=1, max_size=3), st.sampled_from([None, 1, 3]))
def test_column_equals_per_step_reads(steps, workers):
    with tempfile.TemporaryDirectory() as d:
        r = write(d, dict(enumerate(steps)))
        for name in sorted({n for b in steps for n in _names(b)}):
            have = [s for s, b in enumerate(steps) if name in _names(b)]
            got = r.column(name, have, workers=workers)
            assert list(got) == have
            for s in have:
                assert_batch_equal(_field_of(r.read(s, columns=[name]), name), got[s], f"step {s} {name}")
                assert_batch_equal(_field_of(steps[s], name), got[s], f"step {s} {name} vs appended")


def test_column_plain_fields_all_steps(tmp_path):
    bits = torch.tensor([0x7FC01234, -0x80000000, 0x7F800000], dtype=torch.int32)
    with trajstore.Writer(tmp_path) as w:
        w.append(0, {"rewards": bits.view(torch.float32), "x": torch.arange(3)})
        w.append(2, {"rewards": np.array([1.5, -0.0], dtype=np.float64), "x": torch.arange(2)})
        w.append(5, {"rewards": torch.randn(4).to(torch.bfloat16), "x": torch.arange(4)})
        w.append(7, [{"rewards": torch.tensor([1.0])}, None, {"other": 1}])
    r = trajstore.Reader(tmp_path)
    got = r.column("rewards")
    assert list(got) == [0, 2, 5, 7]
    assert got[0].dtype == torch.float32 and torch.equal(got[0].view(torch.int32), bits)  # NaN payload kept
    assert isinstance(got[2], np.ndarray) and got[2].dtype == np.float64
    assert np.signbit(got[2][1])
    assert got[5].dtype == torch.bfloat16
    assert got[7][1] is None and got[7][2] is None and torch.equal(got[7][0], torch.tensor([1.0]))
    for s in (0, 2, 5):
        assert_batch_equal(r.read(s, columns=["rewards"])["rewards"], got[s])
    assert r.column("x", [5, 0], workers=1).keys() == {5, 0}
    assert list(r.column("x", [5, 0])) == [5, 0]  # the order asked for


def test_column_errors_name_step_and_field(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, {"rewards": torch.zeros(2)})
        w.append(1, {"score": torch.zeros(2)})
    r = trajstore.Reader(tmp_path)
    with pytest.raises(ConfigError, match="rewards"):
        r.column("rewards")  # step 1 has no such field
    with pytest.raises(StepNotFoundError, match="step 9"):
        r.column("rewards", [0, 9])
    with pytest.raises(ConfigError, match="workers"):
        r.column("rewards", workers=0)
    with pytest.raises(ConfigError):
        r.column(3)


def test_column_rejects_a_column_that_contradicts_the_spec(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, {"rewards": torch.zeros(3), "ids": torch.zeros(3, 2)})
    f = trajstore.Reader(tmp_path).file(0)
    t = pq.read_table(f)
    i = t.schema.get_field_index("rewards")
    bad = t.set_column(i, pa.field("rewards", pa.int32()), pa.array([1, 2, 3], pa.int32()))
    pq.write_table(bad.replace_schema_metadata(t.schema.metadata), f)
    r = trajstore.Reader(tmp_path)
    with pytest.raises(FormatError, match="rewards"):
        r.column("rewards")
    with pytest.raises(FormatError):
        r.read(0, columns=["rewards"])


def test_column_verify_checks_the_file(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, {"rewards": torch.arange(4.0)})
    f = trajstore.Reader(tmp_path).file(0)
    assert torch.equal(trajstore.Reader(tmp_path, verify=True).column("rewards")[0], torch.arange(4.0))
    data = bytearray(f.read_bytes())
    data[10] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(trajstore.errors.TrajstoreError):
        trajstore.Reader(tmp_path, verify=True).column("rewards")


@settings(max_examples=30, deadline=None)
@given(padded_batches(max_batch=12))
def test_many_row_groups_and_parallel_fill_round_trip(batch):
    """Tiny thresholds: every step is split into row groups (joined in parallel) and every padded
    output is filled by row ranges on the thread pool."""
    mp = pytest.MonkeyPatch()
    mp.setattr(parquet, "ROW_GROUP_BYTES", 1)
    mp.setattr(_threads, "PARALLEL_BYTES", 0)
    try:
        with tempfile.TemporaryDirectory() as d:
            r = write(d, {0: batch})
            assert_batch_equal(batch, r[0])
            f = r.file(0)
            table, spec = pq.read_table(f), r.info(0)["batch"]
            if len(batch["rewards"]) > 1:
                assert pq.ParquetFile(f).metadata.num_row_groups > 1
            ref = schema.decode(table.combine_chunks(), spec, where="ref", layout="packed")
            assert_batch_equal(ref, r.read(0, layout="packed"))  # the attention mask is not read
            assert_batch_equal(batch["rewards"], r.column("rewards")[0])
    finally:
        mp.undo()


def test_row_groups_follow_step_size(tmp_path):
    small = {"input_ids": torch.zeros(4, 8, dtype=torch.int64), "attention_mask": torch.ones(4, 8, dtype=torch.bool)}
    big_n = (parquet.ROW_GROUP_BYTES * 3) // 8 // 64 + 1
    big = {"input_ids": torch.zeros(64, big_n, dtype=torch.int64), "rewards": torch.zeros(64)}
    with trajstore.Writer(tmp_path) as w:
        w.append(0, small)
        w.append(1, big)
    r = trajstore.Reader(tmp_path)
    assert pq.ParquetFile(r.file(0)).metadata.num_row_groups == 1
    assert 2 <= pq.ParquetFile(r.file(1)).metadata.num_row_groups <= parquet.ROW_GROUPS
    assert_batch_equal(big, r[1])


def _read_in_child(path, q):
    q.put(trajstore.Reader(path)[0]["input_ids"].sum().item())


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_parallel_decode_in_a_forked_child(tmp_path, monkeypatch):
    """A DataLoader-style forked worker decodes on its own pool (the parent's threads are gone)."""
    monkeypatch.setattr(_threads, "PARALLEL_BYTES", 0)
    m = torch.arange(64)[None] < torch.arange(1, 9)[:, None]
    with trajstore.Writer(tmp_path) as w:
        w.append(0, {"input_ids": torch.where(m, 5, 0), "attention_mask": m})
    want = trajstore.Reader(tmp_path)[0]["input_ids"].sum().item()  # the parent's pool now exists
    assert in_forked_child(_read_in_child, str(tmp_path), what="decoding") == want
