"""Live tailing: a reader opened while a writer runs sees whole steps only."""

import multiprocessing as mp
import threading
import time

import pytest
from stress.crash_stress import _child, batch_for

import trajstore
from trajstore.errors import StepNotFoundError
from trajstore.testing import assert_batch_equal


def test_wait_for_follows_a_writer_thread(tmp_path):
    w = trajstore.Writer(tmp_path)
    r = trajstore.Reader(tmp_path)
    assert r.steps == []
    n = 15

    def produce():
        for s in range(n):
            w.append(s, batch_for(s, 1), meta={"version": 1})
            time.sleep(0.005)
        w.close()

    th = threading.Thread(target=produce)
    th.start()
    try:
        for s in range(n):
            r.wait_for(s, timeout=60)
            assert s in r.steps
            assert_batch_equal(r[s], batch_for(s, 1), f"step {s}")
    finally:
        th.join()
    assert r.refresh() == list(range(n))


def test_refresh_never_shows_a_partial_step(tmp_path):
    """A writer process appends while this process lists and reads every visible step."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "pyarrow.parquet", "trajstore"])
    trajstore.Writer(tmp_path).close()
    n = 40
    p = ctx.Process(target=_child, args=(str(tmp_path), list(range(n)), 1, False), daemon=True)
    p.start()
    r = trajstore.Reader(tmp_path)
    seen, reads = set(), 0
    deadline = time.monotonic() + 120
    while len(seen) < n and time.monotonic() < deadline:
        for s in r.refresh():
            assert_batch_equal(r[s], batch_for(s, 1), f"step {s}")
            seen.add(s)
            reads += 1
    p.join(60)
    assert p.exitcode == 0
    assert seen == set(range(n)) and reads >= n


def test_wait_for_times_out_with_a_useful_error(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(3, batch_for(3, 1))
    r = trajstore.Reader(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(StepNotFoundError, match=r"step 9 did not appear .* within 0.2 s: .*nearest: 3") as e:
        r.wait_for(9, timeout=0.2)
    assert time.monotonic() - t0 >= 0.2
    assert isinstance(e.value, KeyError) and e.value.step == 9
    r.wait_for(3, timeout=0)  # already there: returns at once
    with pytest.raises(trajstore.ConfigError):
        r.wait_for(-1, timeout=0)


def test_wait_for_sees_a_step_written_later(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, batch_for(0, 1))
    r = trajstore.Reader(tmp_path)

    def later():
        time.sleep(0.3)
        with trajstore.Writer(tmp_path) as w2:
            w2.append(1, batch_for(1, 1))

    th = threading.Thread(target=later)
    th.start()
    r.wait_for(1, timeout=60)
    th.join()
    assert r.steps == [0, 1]
    assert_batch_equal(r[1], batch_for(1, 1))


def test_wait_for_a_skipped_step_fails_at_once(tmp_path):
    from trajstore.store import commit

    with trajstore.Writer(tmp_path) as w:
        w.append(0, batch_for(0, 1))
    commit.record_skipped(tmp_path / "train", 1, "OSError: [Errno 28] No space left on device")
    t0 = time.monotonic()
    with pytest.raises(StepNotFoundError, match="step 1 will not appear.*skipped.*No space left"):
        trajstore.Reader(tmp_path).wait_for(1, timeout=30)
    assert time.monotonic() - t0 < 10


def test_reading_while_a_step_is_overwritten(tmp_path):
    """A reader polling a step that another thread keeps overwriting sees one whole version each time."""
    with trajstore.Writer(tmp_path) as w:
        w.append(0, batch_for(0, 1), meta={"version": 1})
    stop = threading.Event()

    def overwrite():
        v = 2
        with trajstore.Writer(tmp_path, overwrite=True) as w2:
            while not stop.is_set() and v < 60:
                w2.append(0, batch_for(0, v), meta={"version": v})
                w2.flush()
                v += 1

    th = threading.Thread(target=overwrite)
    th.start()
    r = trajstore.Reader(tmp_path)
    try:
        for _ in range(60):
            got = r.read(0)
            assert any(_equal(got, batch_for(0, v)) for v in range(1, 61))
    finally:
        stop.set()
        th.join()


def _equal(a, b):
    try:
        assert_batch_equal(a, b)
        return True
    except AssertionError:
        return False
