"""Crash safety: a writer SIGKILLed at random moments leaves only whole, exact steps.

The full stress run (>= 100 trials) is ``python tests/stress/crash_stress.py --trials 200``.
"""

import os
import signal

from stress.crash_stress import batch_for, check_dump, run

import trajstore


def test_sigkill_stress_fast(tmp_path):
    tot = run(12, seed=int.from_bytes(os.urandom(2), "little"), workdir=str(tmp_path), max_delay=0.3,
              log=print)
    assert tot["failures"] == 0, tot
    assert tot["trials"] == 12 and tot["killed"] >= 1, tot
    assert tot["steps_checked"] > 0, tot


def test_check_dump_catches_a_wrong_step(tmp_path):
    """The stress check is not vacuous: a step holding another version's batch fails it."""
    with trajstore.Writer(tmp_path / "dump") as w:
        w.append(0, batch_for(0, 1), meta={"version": 1})
    try:
        check_dump(tmp_path / "dump", {0: {2}})
    except AssertionError as e:
        assert "version 1 never appended" in str(e)
    else:
        raise AssertionError("check_dump accepted a step version that was never appended")


def test_check_dump_catches_a_torn_step(tmp_path):
    with trajstore.Writer(tmp_path / "dump") as w:
        w.append(0, batch_for(0, 1), meta={"version": 1})
    f = tmp_path / "dump" / "train" / "step_00000000.parquet"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    try:
        check_dump(tmp_path / "dump", {0: {1}})
    except trajstore.ChecksumError as e:
        assert f.name in str(e)
    else:
        raise AssertionError("a half-written step was accepted")




def test_check_dump_of_a_writer_killed_before_its_first_temporary(tmp_path):
    """The side folder of a split is made with its first temporary: a dump killed just before has none."""
    from trajstore.store import manifest, paths

    manifest.create_manifest(tmp_path / "dump")
    (tmp_path / "dump" / "train").mkdir()
    assert not (tmp_path / "dump" / paths.SIDE / "train").exists()
    assert check_dump(tmp_path / "dump", {})["steps"] == 0
