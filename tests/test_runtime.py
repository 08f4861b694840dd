"""The runtime pieces: the writer's per-step commit report, the Recorder built on it and on
``Reader.iter`` read-ahead, the one tensor-tree walker, the prefetch module, store temporaries."""

import logging
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from _dumps import small_batch

import trajstore
from trajstore import WriterError
from trajstore.read import prefetch
from trajstore.device import bridge as torch_bridge, tree
from trajstore.write import pool as pool_mod
from trajstore.write import writer as writer_mod
from trajstore.record.config import DumpReplayConfig, location
from trajstore.errors import ConfigError
from trajstore.record.recorder import Recorder
from trajstore.store import commit, files
from trajstore.store import index as _index
from trajstore.testing import assert_batch_equal
from trajstore.write.writer import Committed


def read_threads():
    return [t for t in threading.enumerate() if t.name.startswith("trajstore-read")]


# ----------------------------------------------------------------------------- Writer(on_commit=)
def test_on_commit_reports_each_committed_step_before_flush_returns(tmp_path):
    got, threads = [], set()

    def on_commit(c):
        threads.add(threading.current_thread().name)
        assert c.path.exists()  # called once the step is committed
        got.append(c)

    with trajstore.Writer(tmp_path, on_commit=on_commit) as w:
        for s in (3, 0, 7):
            w.append(s, small_batch(B=2 + s, seed=s))
        w.flush()
        assert [c.step for c in got] == [3, 0, 7]
    for c in got:
        assert isinstance(c, Committed)
        assert c.path == tmp_path / "train" / f"step_{c.step:08d}.parquet"
        assert c.bytes == c.path.stat().st_size and c.rows == 2 + c.step and c.seconds >= 0
    assert threads and all(n.startswith("trajstore-writer") for n in threads)


def test_a_raising_on_commit_is_logged_and_never_stops_the_writer(tmp_path, caplog):
    calls = []

    def on_commit(c):
        calls.append(c.step)
        raise (SystemExit if c.step == 1 else RuntimeError)(f"callback broke at {c.step}")

    with caplog.at_level(logging.ERROR, "trajstore.writer"):
        with trajstore.Writer(tmp_path, on_commit=on_commit) as w:
            for s in range(3):
                w.append(s, small_batch(seed=s))
            w.flush()  # the callback's errors are not the writer's
            assert all(t.is_alive() for t in w._workers._threads)
            w.append(3, small_batch(seed=3))
    assert calls == [0, 1, 2, 3] and trajstore.Reader(tmp_path).steps == [0, 1, 2, 3]
    assert "callback broke at 0" in caplog.text and "callback broke at 1" in caplog.text
    assert "the writer goes on" in caplog.text


def test_on_commit_is_not_called_for_failed_steps_and_must_be_callable(tmp_path, monkeypatch):
    real = writer_mod.commit.commit

    def commit_but_step_1(tmp, final, overwrite):
        if final.name == "step_00000001.parquet":
            raise OSError(28, "No space left on device")
        real(tmp, final, overwrite)

    monkeypatch.setattr(writer_mod.commit, "commit", commit_but_step_1)
    got = []
    w = trajstore.Writer(tmp_path, on_commit=lambda c: got.append(c.step))
    for s in range(3):
        w.append(s, small_batch(seed=s))
    with pytest.raises(WriterError) as ei:
        w.close()
    assert got == [0, 2] and ei.value.step == 1 and ei.value.steps == [1]
    with pytest.raises(ConfigError, match="on_commit must be callable"):
        trajstore.Writer(tmp_path / "x", on_commit="print")


def test_writer_error_of_several_steps_names_them_all(tmp_path, monkeypatch):
    appended = threading.Event()  # both steps fail, but only once both are appended (no race with append)

    def failing(*a, **k):
        appended.wait(30)
        raise OSError("disk gone")

    monkeypatch.setattr(pool_mod.pq, "write_table", failing)
    w = trajstore.Writer(tmp_path)
    for s in (4, 5):
        w.append(s, small_batch(seed=s))
    appended.set()
    with pytest.raises(WriterError, match="2 steps failed in the background: \\[4, 5\\]") as ei:
        w.close()
    assert ei.value.step == 4 and ei.value.steps == [4, 5]


# ----------------------------------------------------------------------------- Recorder
def rollout(step):
    return small_batch(B=3, T=6, seed=step)


def test_dump_log_lines_come_from_the_commits(tmp_path, caplog):
    caplog.set_level(logging.INFO, "trajstore.recorder")
    with Recorder(dump=True, path=str(tmp_path), total_steps=4) as rec:
        for s in range(4):
            rec.batch(s, lambda s=s: rollout(s))
        rec._writer.flush()
        lines = [r for r in caplog.records if r.getMessage().startswith("trajstore dump step=")]
        assert len(lines) == 4  # every step is logged once it is committed, not at a later call
        assert all(r.threadName.startswith("trajstore-writer-") for r in lines)
        est = rec.estimate(4)
    sizes = [(tmp_path / "train" / f"step_{s:08d}.parquet").stat().st_size for s in range(4)]
    assert est["bytes_per_step"] == sum(sizes) / 4 and est["bytes"] == sum(sizes)
    for s, r in enumerate(lines):
        m = rollout(s)["attention_mask"]
        assert f"step={s} " in r.getMessage() and f"tokens={int(m.sum())} " in r.getMessage()
        assert f"bytes={sizes[s]}" in r.getMessage() and "trajectories=3 " in r.getMessage()
    assert any("KiB on disk" in r.getMessage() for r in caplog.records)  # binary units


def test_rotation_waits_for_a_step_still_being_written(tmp_path, monkeypatch):
    gate = threading.Event()
    real = pool_mod.pq.write_table

    def slow(table, where, **k):
        gate.wait(10)
        return real(table, where, **k)

    monkeypatch.setattr(pool_mod.pq, "write_table", slow)
    with Recorder(dump=True, path=str(tmp_path), max_keep=1) as rec:
        rec.batch(0, lambda: rollout(0))
        assert rec._dumped.landing(0)
        threading.Timer(0.2, gate.set).start()
        rec.batch(1, lambda: rollout(1))  # rotates step 0 out: waits for it to land, then deletes it
        assert not rec._dumped.landing(0)
    assert trajstore.Reader(tmp_path).steps == [1] == rec.steps


def test_replay_read_ahead_uses_reader_iter_in_any_order(tmp_path):
    steps = [0, 2, 3, 5, 8]
    with Recorder(dump=True, path=str(tmp_path)) as rec:
        for s in steps:
            rec.batch(s, lambda s=s: rollout(s))
    before = len(read_threads())
    with Recorder(replay=True, path=str(tmp_path)) as rec:
        for s in [0, 2, 3, 8, 5, 5, 0, 3, 8]:
            assert_batch_equal(rollout(s), rec.batch(s, lambda: pytest.fail("called in replay")))
            nxt = [x for x in steps if x > s]
            assert (rec._ahead.step if rec._ahead else None) == (nxt[0] if nxt else None)
            assert (len(read_threads()) > before) == bool(nxt)  # the last step ends the read-ahead
        assert not [t for t in threading.enumerate() if t.name.startswith("trajstore-replay")]
        rec.batch(2, lambda: None)
        assert rec._ahead.step == 3
    assert len(read_threads()) == before  # close() ends the read-ahead
    with pytest.raises(KeyError, match="step 4 is not in dump"):
        Recorder(replay=True, path=str(tmp_path)).batch(4, lambda: None)


def test_config_steps_use_the_shared_step_parser_and_location():
    c = DumpReplayConfig(steps="0-2,7:8", pin_steps=[9, 1])
    assert c.steps == (0, 1, 2, 7, 8) and c.pin_steps == (1, 9)
    with pytest.raises(ConfigError, match="DumpReplayConfig.steps"):
        DumpReplayConfig(steps="1,x")
    with pytest.raises(ConfigError, match="DumpReplayConfig.pin_steps"):
        DumpReplayConfig(pin_steps=3)
    path, split = location(DumpReplayConfig(path="/d", split="eval"), 4, 2)
    assert (str(path), split) == ("/d", "eval")  # every rank writes its shards of the one split
    assert location(DumpReplayConfig(run_id="r1"), 1, 0)[0].parts[-2:] == ("trajstore_dumps", "r1")


# ----------------------------------------------------------------------------- tree walker, prefetch
def test_map_tree_rebuilds_containers_and_passes_paths():
    obj = {"a": [1, (2, {"b": 3})], "c": np.zeros(2)}
    seen = []
    out = tree.map_tree(obj, lambda v, p: seen.append(p) or v, ())
    assert seen == [("a", 0), ("a", 1, 0), ("a", 1, 1, "b"), ("c",)]
    assert out == {**obj, "c": out["c"]} and out is not obj and out["a"] is not obj["a"]
    assert isinstance(out["a"][1], tuple) and out["c"] is obj["c"]
    none = []
    tree.map_tree(obj, lambda v, p: none.append(p) or v)
    assert none == [None] * 4


def test_snapshot_and_map_tensors_share_the_walker(monkeypatch):
    calls = []
    real = tree.map_tree

    def spy(obj, leaf, path=None):
        calls.append(path)
        return real(obj, leaf, path)

    b = small_batch()
    monkeypatch.setattr(tree, "map_tree", spy)
    tree.map_tensors(b, lambda t: t)
    assert calls
    monkeypatch.setattr(trajstore.write.snapshot, "map_tree", spy)
    calls.clear()
    trajstore.write.snapshot.Snapshot(b, False, torch_bridge.PinnedPool())
    assert calls[0] == ()


def test_prefetch_lives_reader_side_and_torch_bridge_leaves_the_codec_pool_alone(tmp_path):
    assert not hasattr(torch_bridge, "iterate") and "_threads" not in vars(torch_bridge)
    with trajstore.Writer(tmp_path) as w:
        for s in range(6):
            w.append(s, small_batch(seed=s))
    r = trajstore.Reader(tmp_path)
    serial = []
    read = lambda s, arena: (serial.append(trajstore.base.threads.is_serial()), r.read(s))[1]  # noqa: E731
    got = list(prefetch.iterate(read, [5, 1, 3], prefetch=prefetch.SERIAL_PREFETCH))
    assert [s for s, _ in got] == [5, 1, 3] and all(serial)
    serial.clear()
    list(prefetch.iterate(read, [0, 1], prefetch=1))
    assert serial == [False, False]


# ----------------------------------------------------------------------------- store temporaries
def test_one_rule_for_leftover_temporaries(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    me, live = os.getpid(), os.getppid()
    idx = tmp_path / _index.DIR
    idx.mkdir()
    names = {f".step_00000001.parquet.tmp-{dead}-ab", f".step_00000002.parquet.tmp-{live}-ab",
             f".step_00000003.parquet.tmp-{me}-ab", ".step_00000004.parquet.tmp-x", "step_00000005.parquet"}
    for n in names:
        (tmp_path / n).write_text("")
        (idx / n.replace(".step_", ".steps_")).write_text("")
    assert files.stale_temps(tmp_path, ".step_") == sorted(
        [f".step_00000001.parquet.tmp-{dead}-ab", f".step_00000003.parquet.tmp-{me}-ab", ".step_00000004.parquet.tmp-x"])
    assert files.stale_temps(tmp_path, ".step_", keep_own=True) == sorted(
        [f".step_00000001.parquet.tmp-{dead}-ab", ".step_00000004.parquet.tmp-x"])
    assert commit.clean_temp(tmp_path, keep_own=True) == sorted(
        [f".step_00000001.parquet.tmp-{dead}-ab", ".step_00000004.parquet.tmp-x"])
    left = sorted(os.listdir(tmp_path))
    assert left == sorted([_index.DIR, f".step_00000002.parquet.tmp-{live}-ab",
                           f".step_00000003.parquet.tmp-{me}-ab", "step_00000005.parquet"])
    _index.clean_temp(tmp_path)
    assert sorted(os.listdir(idx)) == sorted([f".steps_00000002.parquet.tmp-{live}-ab", "step_00000005.parquet"])
