"""Disk full and I/O errors at every point of a step's write: the error names the step and the
path, earlier steps stay intact, nothing half-written is left, and the step can be written again."""

import errno
import os
from pathlib import Path

import pytest
import torch
from stress.faults import inject

import trajstore
from trajstore.store import checksums, commit, listing, paths
from trajstore.errors import TrajstoreError
from trajstore.testing import assert_batch_equal


def batch(step, v=0):
    g = torch.Generator().manual_seed(step * 10 + v)
    return {"input_ids": torch.randint(0, 100, (4, 64), generator=g), "rewards": torch.randn(4, generator=g)}


def _leftovers(d: Path):
    """Temporaries in split folder ``d`` and in its side folder."""
    return [n for p in paths.places(d) for n in os.listdir(p) if n.startswith(".")]


def _intact(path, steps, v=0):
    r = trajstore.Reader(path)
    assert r.steps == steps
    for s in steps:
        assert_batch_equal(r[s], batch(s, v))
    assert trajstore.verify(path).ok


POINTS = [("data", errno.ENOSPC), ("data", errno.EIO), ("open", errno.ENOSPC), ("write", errno.ENOSPC),
          ("fsync", errno.EIO), ("fsync", errno.ENOSPC), ("link", errno.ENOSPC), ("link", errno.EIO),
          ("replace", errno.EIO)]


@pytest.mark.parametrize("point,err", POINTS, ids=[f"{p}-{errno.errorcode[e]}" for p, e in POINTS])
@pytest.mark.parametrize("nth", [1, 2])
def test_writer_error_names_step_and_path(tmp_path, point, err, nth):
    w = trajstore.Writer(tmp_path)
    w.append(0, batch(0))
    w.append(1, batch(1))
    w.flush()
    with inject(tmp_path, point, err, nth=nth, after_bytes=100) as fault:
        w.append(2, batch(2))
        try:
            w.flush()
        except TrajstoreError as e:
            raised = e
        else:
            raised = None
    if not fault.fired:  # this point is not on the path for this nth (e.g. one link per step)
        assert raised is None
        w.close()
        _intact(tmp_path, [0, 1, 2])
        return
    if point == "replace":  # renaming the checksum into place, after the step became visible
        assert raised is None, raised
        _intact(tmp_path, [0, 1, 2])  # the pending checksum is accepted
        w.close()
        trajstore.Writer(tmp_path).close()  # and promoted on reopen
        assert _leftovers(tmp_path / "train") == []
        _intact(tmp_path, [0, 1, 2])
        return
    assert raised is not None, f"{point} fault was swallowed"
    msg = str(raised)
    assert "step 2" in msg and os.strerror(err) in msg, msg
    assert "step_00000002.parquet" in msg or str(tmp_path) in msg, msg
    d = tmp_path / "train"
    assert not (d / "step_00000002.parquet").exists()
    assert not checksums.sum_path(d / "step_00000002.parquet").exists()
    assert sorted(os.listdir(d)) == [paths.step_name(0), paths.step_name(1)]
    assert _leftovers(d) == []
    _intact(tmp_path, [0, 1])
    assert 2 in trajstore.Reader(tmp_path).skipped  # recorded as skipped, with the reason
    w.append(2, batch(2))  # the disk has room again: the same step can be written
    w.close()
    _intact(tmp_path, [0, 1, 2])
    assert trajstore.Reader(tmp_path).skipped == {}


def test_disk_full_persists(tmp_path):
    """A full disk: every write fails until space is freed; earlier steps are untouched."""
    w = trajstore.Writer(tmp_path)
    w.append(0, batch(0))
    w.flush()
    with inject(tmp_path, "data", errno.ENOSPC, nth=1, persist=True, after_bytes=0):
        for s in (1, 2, 3):
            w.append(s, batch(s)) if s == 1 else None
            with pytest.raises(TrajstoreError, match=f"step {s}.*No space left on device"):
                if s > 1:
                    w.append(s, batch(s))
                w.flush()
    w.close()
    _intact(tmp_path, [0])
    assert sorted(trajstore.Reader(tmp_path).skipped) == [1, 2, 3]
    assert _leftovers(tmp_path / "train") == []


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("point", ["open", "write", "fsync", "link", "replace"])
def test_commit_fault_at_every_call(tmp_path, point, overwrite):
    """commit.commit failing at its k-th call of ``point``, for every k: the old state or the new
    one, each with a matching checksum, and no temporary file left."""
    d = tmp_path / "train"
    trajstore.Writer(tmp_path).close()
    import pyarrow as pa
    import pyarrow.parquet as pq

    final = d / paths.step_name(0)
    if overwrite:
        old = paths.temp_path(d, 0)
        pq.write_table(pa.table({"v": [0]}), old)
        commit.commit(old, final, False)
    for k in range(1, 20):
        tmp = paths.temp_path(d, 0)
        pq.write_table(pa.table({"v": [k]}), tmp)
        with inject(tmp_path, point, errno.EIO, nth=k) as fault:
            try:
                commit.commit(tmp, final, overwrite)
                failed = False
            except FileExistsError:
                assert not overwrite
                failed = True
            except OSError as e:
                assert e.errno == errno.EIO
                failed = True
        tmp.unlink(missing_ok=True)  # the writer's own cleanup
        if final.exists():
            checksums.check_digest(final, 0, checksums.file_sha256(final))  # pending or recorded: consistent
        if not fault.fired and not failed:
            break
        commit.clean_temp(d)
        assert _leftovers(d) == [], (k, _leftovers(d))
        assert os.listdir(d) == ([final.name] if final.exists() else []), k  # the split folder: steps only
        if final.exists():
            assert checksums.read_sum(checksums.sum_path(final)) == checksums.file_sha256(final), k
        if not overwrite:
            final.unlink(missing_ok=True)
            checksums.sum_path(final).unlink(missing_ok=True)
    else:
        raise AssertionError("commit never completed")
    assert pq.read_table(final)["v"][0].as_py() == k
    assert checksums.read_sum(checksums.sum_path(final)) == checksums.file_sha256(final)


def test_record_skipped_under_a_full_disk(tmp_path):
    trajstore.Writer(tmp_path).close()
    d = tmp_path / "train"
    with inject(tmp_path, "write", errno.ENOSPC, nth=1, persist=True):
        assert commit.record_skipped(d, 5, "No space left on device") is False
    assert _leftovers(d) == [] and listing.list_skipped(d) == {}
    assert commit.record_skipped(d, 5, "No space left on device") is True
    assert listing.list_skipped(d) == {5: "No space left on device"}


def test_on_error_warn_keeps_the_run_going(tmp_path, caplog):
    w = trajstore.Writer(tmp_path, on_error="warn")
    w.append(0, batch(0))
    w.flush()
    with inject(tmp_path, "data", errno.ENOSPC, nth=1, after_bytes=100) as fault:
        w.append(1, batch(1))
        w.flush()  # no raise: the policy is to warn
    assert fault.fired
    w.append(2, batch(2))
    w.close()
    assert "step 1 was not written" in caplog.text
    r = trajstore.Reader(tmp_path)
    assert r.steps == [0, 2]
    assert 1 in r.skipped and "No space left" in r.skipped[1] or "ENOSPC" in r.skipped[1]
    with pytest.raises(trajstore.StepNotFoundError):
        r[1]


def test_on_error_must_be_known(tmp_path):
    with pytest.raises(trajstore.ConfigError, match="on_error"):
        trajstore.Writer(tmp_path, on_error="ignore")


def test_two_writers_in_one_process_keep_each_others_temporaries(tmp_path):
    d = tmp_path / "train"
    w1 = trajstore.Writer(tmp_path)
    tmp = paths.temp_path(d, 5)
    tmp.write_bytes(b"in flight")
    w2 = trajstore.Writer(tmp_path)
    assert tmp.exists()
    w1.close(), w2.close()


def test_on_error_warn_says_whether_the_skip_record_was_written(tmp_path, caplog):
    """A full disk also fails the skip record: the warning says so instead of "recorded as skipped"."""
    w = trajstore.Writer(tmp_path, on_error="warn")
    w.append(0, batch(0))
    w.flush()
    with inject(tmp_path, "open", errno.ENOSPC, nth=1, persist=True) as fault:
        w.append(1, batch(1))
        w.flush()
    assert fault.fired >= 2  # the step's commit and its skip record
    w.append(2, batch(2))
    w.flush()
    with inject(tmp_path, "data", errno.ENOSPC, nth=1, after_bytes=100):
        w.append(3, batch(3))
        w.flush()
    w.close()
    lines = {s: [r.getMessage() for r in caplog.records if f"step {s} was not written" in r.getMessage()]
             for s in (1, 3)}
    assert len(lines[1]) == 1 and "no skipped record was written: the record could not be written" in lines[1][0]
    assert len(lines[3]) == 1 and "the step is recorded as skipped in" in lines[3][0]
    assert sorted(trajstore.Reader(tmp_path).skipped) == [3]
