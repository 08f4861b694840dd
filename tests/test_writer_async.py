"""The background writer: snapshots, pending limits, failures, flush/close/exit semantics."""

import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from _dumps import clone, small_batch
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore import StepExistsError, WriterError
from trajstore.write import pool as pool_mod
from trajstore.format.dtypes import bits_view
from trajstore.testing import assert_batch_equal, batches, padded_batches


def batch(B=3, T=5, seed=0):
    return small_batch(B, T, seed, logprobs=False)


def mutate(x):
    """Change every tensor / array of ``x`` in place (and every list's contents)."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bool:
            x.logical_not_()
        else:
            bits_view(x).bitwise_not_()
    elif isinstance(x, np.ndarray):
        if x.dtype.kind in "biuf" and x.size:
            (x[None] if x.ndim == 0 else x).view(np.uint8)[...] ^= 0xFF  # a 0-d array: through a 1-d view
    elif isinstance(x, dict):
        for v in x.values():
            mutate(v)
        x["__added_after_append"] = 1
    elif isinstance(x, list):
        for v in x:
            mutate(v)
        x.append(None)


class Gate:
    """Hold the background writer inside ``pq.write_table`` until ``open()``."""

    def __init__(self, monkeypatch):
        self.ev = threading.Event()
        self.entered = threading.Semaphore(0)
        real = pool_mod.pq.write_table

        def slow(*a, **k):
            self.entered.release()
            self.ev.wait(30)
            return real(*a, **k)

        monkeypatch.setattr(pool_mod.pq, "write_table", slow)

    def open(self):
        self.ev.set()


def test_append_returns_before_the_write(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    w = trajstore.Writer(tmp_path)
    w.append(0, batch())
    assert gate.entered.acquire(timeout=30)
    assert w.stats["pending_steps"] == 1 and trajstore.Reader(tmp_path).steps == []
    gate.open()
    w.flush()
    assert w.stats["pending_steps"] == 0 and w.stats["written"] == 1
    assert trajstore.Reader(tmp_path).steps == [0]
    w.close()


@pytest.mark.parametrize("limit", ["steps", "bytes"])
def test_pending_limit_makes_append_wait_and_reports_it(tmp_path, monkeypatch, limit):
    gate = Gate(monkeypatch)
    b = batch()
    nbytes = sum(v.numel() * v.element_size() for v in b.values())
    kw = {"max_pending_steps": 2} if limit == "steps" else {"max_pending_bytes": 2 * nbytes}
    w = trajstore.Writer(tmp_path, **kw)
    w.append(0, batch(seed=0))
    w.append(1, batch(seed=1))
    t = threading.Thread(target=w.append, args=(2, batch(seed=2)))
    t.start()
    t.join(0.5)
    assert t.is_alive(), "append must wait while the pending limit is reached"
    assert w.stats["pending_steps"] == 2
    gate.open()
    t.join(30)
    assert not t.is_alive()
    w.close()
    s = w.stats
    assert s["waits"] == 1 and s["wait_s"] > 0 and s["max_wait_s"] == s["wait_s"]
    assert s["written"] == 3 and trajstore.Reader(tmp_path).steps == [0, 1, 2]


def test_a_step_larger_than_the_byte_limit_still_goes_alone(tmp_path):
    with trajstore.Writer(tmp_path, max_pending_bytes=1) as w:
        for s in range(3):
            w.append(s, batch(seed=s))
    assert trajstore.Reader(tmp_path).steps == [0, 1, 2]


def test_background_failure_surfaces_on_next_call_naming_the_step(tmp_path, monkeypatch):
    real = pool_mod.pq.write_table

    def failing(table, where, **k):
        if "step_00000001" in str(where):
            raise OSError(28, "No space left on device")
        return real(table, where, **k)

    monkeypatch.setattr(pool_mod.pq, "write_table", failing)
    w = trajstore.Writer(tmp_path)
    w.append(0, batch())
    w.append(1, batch())
    with pytest.raises(WriterError, match="step 1.*No space left") as ei:
        w.flush()
    assert ei.value.step == 1
    w.append(2, batch())  # the error was reported once; later steps keep being written
    w.close()
    r = trajstore.Reader(tmp_path)
    assert r.steps == [0, 2]
    assert "No space left" in r.skipped.get(1, "")
    with pytest.raises(KeyError, match="skipped"):
        r[1]


@pytest.mark.parametrize("where", ["append", "close"])
def test_background_failure_raised_by_append_and_close(tmp_path, monkeypatch, where):
    monkeypatch.setattr(pool_mod.pq, "write_table", lambda *a, **k: (_ for _ in ()).throw(OSError("disk gone")))
    w = trajstore.Writer(tmp_path)
    w.append(5, batch())
    while w.stats["pending_steps"]:
        threading.Event().wait(0.01)
    if where == "append":
        with pytest.raises(WriterError, match="step 5.*disk gone.*step 6 was not appended"):
            w.append(6, batch())
        w.close()
    else:
        with pytest.raises(WriterError, match="step 5"):
            w.close()
        w.close()  # idempotent
    with pytest.raises(WriterError, match="closed"):
        w.append(7, batch())


def test_cpu_tensor_modified_in_place_after_append_fails_loudly(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    b = batch()
    w = trajstore.Writer(tmp_path)
    w.append(0, b, copy=False)  # the opt-in: no copy, the version counters are checked
    b["rewards"].add_(1.0)  # the caller reuses its buffer before the step is written
    gate.open()
    with pytest.raises(WriterError, match="step 0: field 'rewards' was modified in place.*copy=True"):
        w.flush()
    w.close()
    assert trajstore.Reader(tmp_path).steps == []


def test_modification_during_encoding_is_caught(tmp_path, monkeypatch):
    b = batch()
    real = pool_mod.pq.write_table

    def racing(*a, **k):
        b["input_ids"][0, 0] = 7  # lands after the first version check, before the commit
        return real(*a, **k)

    monkeypatch.setattr(pool_mod.pq, "write_table", racing)
    w = trajstore.Writer(tmp_path, copy=False)
    w.append(0, b)
    with pytest.raises(WriterError, match="'input_ids' was modified in place"):
        w.close()
    assert trajstore.Reader(tmp_path).steps == []


@settings(max_examples=25)
@given(batches())
def test_copy_true_records_the_batch_as_at_append(batch_):
    import tempfile

    want = clone(batch_)
    with tempfile.TemporaryDirectory() as d:
        ev = threading.Event()
        real = pool_mod.pq.write_table
        pool_mod.pq.write_table = lambda *a, **k: (ev.wait(30), real(*a, **k))[1]
        try:
            w = trajstore.Writer(d)
            w.append(0, batch_, copy=True)
            mutate(batch_)
            ev.set()
            w.close()
        finally:
            pool_mod.pq.write_table = real
        assert_batch_equal(want, trajstore.Reader(d)[0])


def test_numpy_and_python_structure_are_snapshotted_without_copy_flag(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    b = {"input_ids": torch.arange(6).reshape(2, 3), "scores": np.array([1.5, 2.5]),
         "uids": ["a", "b"], "info": [{"k": [1, 2]}, {"k": [3]}]}
    want = clone(b)
    w = trajstore.Writer(tmp_path)
    w.append(0, b)
    b["scores"][0] = 9.0     # numpy: copied at append
    b["uids"][1] = "zz"      # list contents: structure copied at append
    b["extra"] = 1           # dict keys: structure copied at append
    gate.open()
    w.close()
    assert_batch_equal(want, trajstore.Reader(tmp_path)[0])


@settings(max_examples=20)
@given(st.lists(padded_batches(), min_size=1, max_size=4), st.integers(1, 3))
def test_many_steps_round_trip_through_background_workers(steps, workers):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with trajstore.Writer(d, workers=workers, max_pending_steps=2) as w:
            for i, b in enumerate(steps):
                w.append(i, b)
        r = trajstore.Reader(d)
        assert r.steps == list(range(len(steps)))
        for i, b in enumerate(steps):
            assert_batch_equal(b, r[i])


def test_step_exists_considers_pending_steps(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    w = trajstore.Writer(tmp_path)
    w.append(3, batch(seed=0))
    with pytest.raises(StepExistsError, match="step 3 is already appended.*not yet written"):
        w.append(3, batch(seed=1))
    w.append(3, batch(seed=2), overwrite=True)  # queued behind the first write of step 3
    gate.open()
    w.close()
    assert_batch_equal(batch(seed=2), trajstore.Reader(tmp_path)[3])


def test_overwrite_of_pending_step_keeps_order_with_several_workers(tmp_path):
    with trajstore.Writer(tmp_path, workers=3) as w:
        for seed in range(5):
            w.append(0, batch(seed=seed), overwrite=True)
    assert_batch_equal(batch(seed=4), trajstore.Reader(tmp_path)[0])


def test_batch_errors_are_raised_by_append_itself(tmp_path):
    b = batch()
    b["rewards"] = torch.zeros(4)
    with trajstore.Writer(tmp_path) as w:
        with pytest.raises(trajstore.BatchError, match="'rewards'"):
            w.append(0, b)
        assert w.stats["appended"] == 0


def test_exception_in_with_block_still_writes_and_is_not_masked(tmp_path, monkeypatch):
    monkeypatch.setattr(pool_mod.pq, "write_table", lambda *a, **k: (_ for _ in ()).throw(OSError("x")))
    with pytest.raises(ZeroDivisionError):
        with trajstore.Writer(tmp_path) as w:
            w.append(0, batch())
            1 / 0


def test_bad_limits(tmp_path):
    for kw in ({"max_pending_steps": 0}, {"max_pending_bytes": -1}, {"workers": 0}):
        with pytest.raises(trajstore.ConfigError, match=next(iter(kw))):
            trajstore.Writer(tmp_path, **kw)


def test_interpreter_exit_flushes(tmp_path):
    code = (
        "import torch, trajstore\n"
        f"w = trajstore.Writer({str(tmp_path)!r})\n"
        "for s in range(3):\n"
        "    w.append(s, {'x': torch.full((4,), s), 'y': [s] * 4})\n"
    )  # no flush, no close
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    r = trajstore.Reader(tmp_path)
    assert r.steps == [0, 1, 2]
    assert torch.equal(r[2]["x"], torch.full((4,), 2))


def test_stats_counts(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        for s in range(3):
            w.append(s, batch(seed=s))
    st_ = w.stats
    assert st_["appended"] == 3 and st_["written"] == 3 and st_["failed"] == 0
    assert st_["bytes_written"] > 0 and st_["bytes_in"] > 0 and st_["pending_steps"] == 0
    assert st_["append_s"] >= st_["max_append_s"] > 0


def test_parquet_encodings_reach_the_list_columns(tmp_path):
    import pyarrow.parquet as pq

    def encodings(path, **kw):
        with trajstore.Writer(path, **kw) as w:
            w.append(0, batch())
        md = pq.ParquetFile(trajstore.Reader(path).file(0)).metadata.row_group(0)
        assert all(md.column(j).compression == "ZSTD" for j in range(md.num_columns))
        return {md.column(j).path_in_schema: set(md.column(j).encodings) for j in range(md.num_columns)}

    # the default: encodings every Parquet reader decodes (docs/FORMAT.md 3.5)
    enc = encodings(tmp_path / "portable")
    assert all(e <= {"PLAIN", "RLE", "RLE_DICTIONARY", "PLAIN_DICTIONARY"} for e in enc.values()), enc
    assert "RLE_DICTIONARY" in enc["input_ids.list.element"]  # per-token int64 values
    assert "RLE_DICTIONARY" not in enc["rewards"]             # per-trajectory float32: PLAIN
    enc = encodings(tmp_path / "compact", encodings="compact")
    assert "BYTE_STREAM_SPLIT" in enc["input_ids.list.element"]
    assert "BYTE_STREAM_SPLIT" in enc["rewards"]
    with pytest.raises(trajstore.ConfigError, match="encodings"):
        trajstore.Writer(tmp_path / "bad", encodings="small")


@pytest.mark.parametrize("trail", [(), (2,), (0,)])
def test_padded_fields_pad_check(tmp_path, trail):
    B, T = 3, 6
    m = torch.arange(T)[None, :] < torch.tensor([2, 6, 4])[:, None]
    const = torch.full((B, T) + trail, -7, dtype=torch.int32)
    if const.numel():
        const[m] = torch.arange(int(m.sum()) * const[0, 0].numel(), dtype=torch.int32).reshape((-1,) + trail)
    varied = const.clone()
    if varied.numel():
        varied[0, 5] = 9  # one padded position differs: the padded values are kept beside the tokens
    b = {"attention_mask": m, "const": const, "varied": varied}
    with trajstore.Writer(tmp_path) as w:
        w.append(0, b)
    r = trajstore.Reader(tmp_path)
    keys = dict(r.info(0)["batch"]["keys"])
    if const.numel():
        assert keys["const"]["kind"] == "token" and keys["const"]["pad"] == -7
    else:  # zero-width tokens have no pad value: stored whole
        assert keys["const"]["kind"] == "sample"
    if varied.numel():
        assert keys["varied"]["kind"] == "token" and keys["varied"]["pad_col"] == "__pad__varied"
    else:
        assert keys["varied"]["kind"] == "sample"
    assert_batch_equal(b, r[0])
