"""Several background workers (``Writer(workers=N)``, trajstore/write/pool.py): steps encoded at once,
committed in append order, files identical to one worker's, crash safety kept (issue 16)."""

import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from _dumps import small_batch
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore import WriterError
from trajstore.write import pool as pool_mod
from trajstore.testing import assert_batch_equal, batches


def _files(d: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted((d / "train").iterdir())}


@settings(max_examples=6, deadline=None)
@given(st.lists(batches(), min_size=2, max_size=3))
def test_several_workers_write_the_same_files_as_one(steps):
    """Hypothesis: the step files of 1 and 4 workers are byte-identical and read back as appended."""
    with tempfile.TemporaryDirectory() as d:
        dumps = []
        for workers in (1, 4):
            p = Path(d) / f"w{workers}"
            with trajstore.Writer(p, workers=workers, max_pending_steps=3) as w:
                for i, b in enumerate(steps):
                    w.append(i, b)
            dumps.append(_files(p))
        assert dumps[0] == dumps[1]
        r = trajstore.Reader(Path(d) / "w4")
        for i, b in enumerate(steps):
            assert_batch_equal(b, r[i])


def _slow_encode(monkeypatch, slow_step: int) -> dict:
    """Encoding ``slow_step`` waits until the next step's encoding has started (on another worker),
    so later steps are encoded before it; the returned dict says whether that happened."""
    real = pool_mod.Steps.encode
    later = threading.Event()
    out = {"overlapped": False}

    def encode(self, job):
        if job.step == slow_step + 1:
            later.set()
        if job.step == slow_step:
            out["overlapped"] = later.wait(30)
        return real(self, job)

    monkeypatch.setattr(pool_mod.Steps, "encode", encode)
    return out


def test_commits_and_reports_follow_append_order(tmp_path, monkeypatch):
    slow = _slow_encode(monkeypatch, 0)
    seen = []
    real_commit = pool_mod.commit.commit

    def commit(tmp, final, overwrite):
        seen.append(("commit", final.name))
        return real_commit(tmp, final, overwrite)

    monkeypatch.setattr(pool_mod.commit, "commit", commit)
    with trajstore.Writer(tmp_path, workers=3, on_commit=lambda c: seen.append(("report", c.step))) as w:
        for s in range(5):
            w.append(s, small_batch(seed=s))
    names = [f"step_{s:08d}.parquet" for s in range(5)]
    assert [x for k, x in seen if k == "commit"] == names
    assert [x for k, x in seen if k == "report"] == list(range(5))
    assert slow["overlapped"]  # step 1 was being encoded while step 0 was


def test_failed_step_keeps_the_order_of_the_others(tmp_path, monkeypatch):
    """A step failing in the background (step 1) is reported; later ones are committed, in order."""
    _slow_encode(monkeypatch, 0)
    real = pool_mod.Steps.write

    def write(self, job, table):
        if job.step == 1:
            raise OSError("disk hiccup")
        return real(self, job, table)

    monkeypatch.setattr(pool_mod.Steps, "write", write)
    order = []
    w = trajstore.Writer(tmp_path, workers=3, on_commit=lambda c: order.append(c.step))
    for s in range(4):
        w.append(s, small_batch(seed=s))
    with pytest.raises(WriterError, match="step 1 .*disk hiccup"):
        w.close()
    assert order == [0, 2, 3]
    r = trajstore.Reader(tmp_path)
    assert r.steps == [0, 2, 3] and 1 in r.skipped


_KILLED = """
import os, sys, trajstore
from trajstore import write_pool
from _dumps import small_batch
real = write_pool.commit.commit
def commit(tmp, final, overwrite):
    if final.name == "step_00000003.parquet":
        os._exit(7)  # killed while committing step 3: steps 4..7 are written to temporaries by then
    return real(tmp, final, overwrite)
write_pool.commit.commit = commit
w = trajstore.Writer(sys.argv[1], workers=4)
for s in range(8):
    w.append(s, small_batch(seed=s))
w.close()
"""


def test_killed_mid_run_leaves_a_prefix_of_whole_steps(tmp_path):
    """Killed while committing step 3 with 4 workers: exactly steps 0-2 are visible, whole; the
    next writer removes the temporaries and writes on."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    p = subprocess.run([sys.executable, "-c", _KILLED, str(tmp_path)], env=env, capture_output=True, timeout=120)
    assert p.returncode == 7, p.stderr.decode()[-2000:]
    r = trajstore.Reader(tmp_path, verify=True)
    assert r.steps == [0, 1, 2]
    for s in range(3):
        assert_batch_equal(small_batch(seed=s), r[s])
    with trajstore.Writer(tmp_path, workers=4) as w:
        for s in range(3, 8):
            w.append(s, small_batch(seed=s))
    leftovers = [f for f in tmp_path.rglob("*") if ".tmp-" in f.name]
    assert leftovers == []
    r = trajstore.Reader(tmp_path, verify=True)
    assert r.steps == list(range(8))


def test_default_workers_and_bad_values(tmp_path, monkeypatch):
    w = trajstore.Writer(tmp_path)
    b = trajstore.base.threads.budget()
    assert w.workers == len(w._workers) == b and w.stats["workers"] == w.workers
    assert w.max_pending_steps == max(8, 2 * b)
    w.close()
    monkeypatch.setenv("TRAJSTORE_THREADS", "6")
    with trajstore.Writer(tmp_path / "six") as w:
        assert (w.workers, w.max_pending_steps, w.stats["threads"]) == (6, 12, 6)
    with trajstore.Writer(tmp_path / "given", workers=3, max_pending_steps=5) as w:
        assert (w.workers, w.max_pending_steps) == (3, 5)
    with pytest.raises(trajstore.ConfigError, match="workers must be an int >= 1"):
        trajstore.Writer(tmp_path, workers=0)


def test_turns_let_only_the_next_number_through():
    turns = pool_mod.Turns()
    got = []

    def run(i):
        turns.wait(i)
        got.append(i)
        turns.done(i)

    ts = [threading.Thread(target=run, args=(i,)) for i in (3, 1, 2, 0)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert got == [0, 1, 2, 3]


def test_workers_share_torchs_threads_and_leave_the_callers_alone(tmp_path, monkeypatch):
    """Each of N workers encodes with 1/N of the writer's thread budget as torch's threads (OpenMP: a
    per-thread setting), not of torch's own count; the appending thread keeps its own."""
    seen = []
    real = pool_mod.Steps.encode
    monkeypatch.setattr(pool_mod.Steps, "encode", lambda self, job: (seen.append(torch.get_num_threads()),
                                                                      real(self, job))[1])
    n = torch.get_num_threads()
    later = []
    with trajstore.Writer(tmp_path, workers=2, threads=6) as w:
        w.append(0, small_batch())
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))  # a thread the caller starts
        t.start()
        t.join()
    with trajstore.Writer(tmp_path / "again", workers=2) as w:  # a second writer's workers: the same share
        w.append(0, small_batch())
    assert torch.get_num_threads() == n and later == [n]
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        assert seen == [3, max(1, trajstore.base.threads.budget() // 2)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_workers_run_below_the_trainers_priority(tmp_path):
    """Each background worker thread's nice value is the caller's plus BACKGROUND_NICE (capped at 19);
    the appending thread keeps its own."""
    seen = []

    def probe(rec):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with trajstore.Writer(tmp_path, workers=2, on_commit=probe) as w:
        for s in range(3):
            w.append(s, {"x": torch.arange(4)})
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    assert len(seen) == 3
    # on_commit runs on the worker that committed the step
    assert set(seen) == {min(19, mine + pool_mod.BACKGROUND_NICE)}


def test_each_step_is_fsynced_and_hashed_once_before_its_turn(tmp_path, monkeypatch):
    """A worker fsyncs and hashes its step's temporary while an earlier step is still being written
    (``commit.prepare``: step 0's write waits for step 1's hash, which a hash taken at the commit, in
    append order, would never give it); the commit reuses that hash, and nothing is left behind."""
    from trajstore.store import checksums, commit
    hashed, real, one = [], checksums.file_sha256, threading.Event()

    def sha(p):
        hashed.append(p.name)
        if "00000001" in p.name:
            one.set()
        return real(p)

    real_write, waited = pool_mod.Steps.write, []

    def write(self, job, table):
        if job.step == 0:
            waited.append(one.wait(5))
        return real_write(self, job, table)

    monkeypatch.setattr(checksums, "file_sha256", sha)
    monkeypatch.setattr(pool_mod.Steps, "write", write)
    with trajstore.Writer(tmp_path, workers=3) as w:
        for s in range(6):
            w.append(s, small_batch(seed=s))
    assert waited == [True]
    assert len([n for n in hashed if "step_" in n and ".parquet" in n]) == 6, hashed
    assert commit._prepared == {}
    assert trajstore.Reader(tmp_path, verify=True).steps == list(range(6))


def test_a_temporary_changed_after_prepare_is_hashed_again(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from trajstore.store import checksums, commit, paths
    trajstore.Writer(tmp_path).close()
    d = tmp_path / "train"
    tmp = paths.temp_path(d, 0)
    pq.write_table(pa.table({"v": [1]}), tmp)
    commit.prepare(tmp)
    pq.write_table(pa.table({"v": [2, 3]}), tmp)  # rewritten: another size and time
    final = d / paths.step_name(0)
    commit.commit(tmp, final, False)
    assert checksums.sum_path(final).read_text().split()[0] == checksums.file_sha256(final)
    assert pq.read_table(final)["v"].to_pylist() == [2, 3] and commit._prepared == {}
