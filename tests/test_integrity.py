"""Checksums recorded at commit; Reader(verify=True) and integrity.verify detect any change."""

import hashlib
import os
import shutil
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore.store import checksums, commit, paths
from trajstore.errors import ChecksumError, DumpNotFoundError, FormatError, StepNotFoundError
from trajstore.testing import assert_batch_equal


def _batch(step):
    g = torch.Generator().manual_seed(step)
    mask = torch.arange(12)[None, :] < torch.tensor([12, 5, 9])[:, None]
    return {"input_ids": torch.randint(0, 1000, (3, 12), generator=g).masked_fill(~mask, 0),
            "attention_mask": mask, "logprobs": torch.randn(3, 12, generator=g).masked_fill(~mask, 0),
            "rewards": torch.randn(3, generator=g)}


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    p = tmp_path_factory.mktemp("integrity") / "d"
    with trajstore.Writer(p) as w:
        for s in range(3):
            w.append(s, _batch(s))
    return p


def test_sidecar_in_sha256sum_format(dump):
    d, side = dump / "train", dump / paths.SIDE / "train"
    assert sorted(os.listdir(d)) == [paths.step_name(s) for s in range(3)]  # the split folder: steps only
    for s in range(3):
        f = d / paths.step_name(s)
        assert checksums.sum_path(f) == side / f"step_{s:08d}.sha256"
        line = (side / f"step_{s:08d}.sha256").read_text()
        assert line == f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n"
    if shutil.which("sha256sum"):  # as docs/RELIABILITY.md says to run it
        r = subprocess.run("sha256sum -c ../_trajstore/train/step_*.sha256", shell=True, cwd=d,
                           capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.count(": OK") == 3, r.stdout + r.stderr
    assert trajstore.verify(dump).ok and trajstore.verify(dump).checked == {"train": 3}


@settings(max_examples=300)
@given(pos=st.integers(0, 10**9), bit=st.integers(0, 7), step=st.integers(0, 2))
def test_any_bit_flip_is_detected(dump, pos, bit, step):
    f = dump / "train" / paths.step_name(step)
    orig = f.read_bytes()
    data = bytearray(orig)
    data[pos % len(data)] ^= 1 << bit
    f.write_bytes(bytes(data))
    try:
        with pytest.raises(ChecksumError, match=f"{f.name}.*step {step} is damaged"):
            trajstore.Reader(dump, verify=True)[step]
        rep = trajstore.verify(dump)
        assert set(rep.damaged) == {("train", step)} and not rep.ok
        assert "DAMAGED train/" in rep.summary()
    finally:
        f.write_bytes(orig)
    assert_batch_equal(trajstore.Reader(dump, verify=True)[step], _batch(step))


@pytest.mark.parametrize("how", ["truncate", "append", "empty", "swap"])
def test_size_changes_are_detected(dump, how):
    f = dump / "train" / paths.step_name(1)
    orig = f.read_bytes()
    new = {"truncate": orig[:-100], "append": orig + b"\0", "empty": b"",
           "swap": (dump / "train" / paths.step_name(2)).read_bytes()}[how]
    f.write_bytes(new)
    try:
        with pytest.raises(ChecksumError, match=f.name):
            trajstore.Reader(dump, verify=True)[1]
        assert set(trajstore.verify(dump).damaged) == {("train", 1)}
    finally:
        f.write_bytes(orig)


def test_missing_checksum(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, _batch(0))
    (tmp_path / paths.SIDE / "train" / "step_00000000.sha256").unlink()
    with pytest.raises(ChecksumError, match="no recorded checksum.*verify=False"):
        trajstore.Reader(tmp_path, verify=True)[0]
    assert_batch_equal(trajstore.Reader(tmp_path, verify=False)[0], _batch(0))
    assert ("train", 0) in trajstore.verify(tmp_path).damaged


def test_overwrite_updates_checksum(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, _batch(0))
    with trajstore.Writer(tmp_path, overwrite=True) as w:
        w.append(0, _batch(7))
    assert_batch_equal(trajstore.Reader(tmp_path)[0], _batch(7))
    assert trajstore.verify(tmp_path).ok


def test_interrupted_commit_checksum_is_promoted(tmp_path):
    """A crash after the step became visible but before its checksum was renamed into place."""
    with trajstore.Writer(tmp_path) as w:
        w.append(0, _batch(0))
    with trajstore.Writer(tmp_path, overwrite=True) as w:
        w.append(0, _batch(1))
    d = tmp_path / paths.SIDE / "train"
    good = (d / "step_00000000.sha256").read_text()
    (d / "step_00000000.sha256").write_text(checksums.sum_line("0" * 64, "step_00000000.parquet"))
    dead = 2**22 + 12345  # above the default pid_max: never a live process
    (d / f".step_00000000.sha256.tmp-{dead}-abcd").write_text(good)
    assert_batch_equal(trajstore.Reader(tmp_path)[0], _batch(1))
    assert trajstore.verify(tmp_path).ok
    trajstore.Writer(tmp_path).close()  # reopening for writing promotes it
    assert (d / "step_00000000.sha256").read_text() == good
    assert not [n for n in os.listdir(d) if n.startswith(".")]


def test_stale_temporaries_and_orphans_are_cleaned(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, _batch(0))
    d, side = tmp_path / "train", tmp_path / paths.SIDE / "train"
    dead = 2**22 + 12345
    junk = [f".step_00000001.parquet.tmp-{dead}-ab", f".step_00000001.sha256.tmp-{dead}-cd",
            f".step_00000000.sha256.tmp-{dead}-ef", "step_00000005.sha256"]
    for n in junk:
        (side / n).write_text("junk")
        (d / n).write_text("junk")  # where a writer of layout 1 left them: cleaned too
    (tmp_path / f".trajstore.json.tmp-{dead}").write_text("{}")
    r = trajstore.Reader(tmp_path)
    assert r.steps == [0]
    assert_batch_equal(r[0], _batch(0))
    trajstore.Writer(tmp_path).close()
    assert sorted(os.listdir(d)) == ["step_00000000.parquet"]
    assert sorted(os.listdir(side)) == ["columns.json", "index", "step_00000000.sha256"]
    assert not (tmp_path / f".trajstore.json.tmp-{dead}").exists()


def test_deep_verify_decodes(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, _batch(0))
        w.append(1, _batch(1))
    rep = trajstore.verify(tmp_path, deep=True)
    assert rep.ok and rep.checked == {"train": 2}
    with pytest.raises(DumpNotFoundError):
        trajstore.verify(tmp_path / "nope")
    with pytest.raises(DumpNotFoundError, match="no split 'val'"):
        trajstore.verify(tmp_path, "val")
    assert trajstore.verify(tmp_path, "train").checked == {"train": 2}


def test_skipped_steps_are_recorded(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, _batch(0))
    d = tmp_path / "train"
    assert commit.record_skipped(d, 1, "No space left on device")
    assert os.listdir(d) == [paths.step_name(0)]  # the record is in the side folder
    assert (tmp_path / paths.SIDE / "train" / paths.skipped_name(1)).exists()
    r = trajstore.Reader(tmp_path)
    assert r.skipped == {1: "No space left on device"} and r.steps == [0]
    with pytest.raises(StepNotFoundError, match="recorded it as skipped: No space left"):
        r[1]
    rep = trajstore.verify(tmp_path)
    assert rep.ok and rep.skipped == {("train", 1): "No space left on device"}
    with trajstore.Writer(tmp_path) as w:  # writing the step later clears the record
        w.append(1, _batch(1))
    assert r.skipped == {} and not list(tmp_path.glob("**/*.skipped.json"))
    assert not commit.record_skipped(tmp_path / "missing-dir", 2, "x")  # best effort, never raises


def test_checksum_error_is_a_format_error():
    assert issubclass(ChecksumError, FormatError) and issubclass(ChecksumError, trajstore.TrajstoreError)


def test_cli_verify(tmp_path, capsys):
    import json

    from trajstore.cli import main

    with trajstore.Writer(tmp_path) as w:
        for s in range(3):
            w.append(s, _batch(s))
    assert main(["verify", str(tmp_path)]) == 0
    assert "3 step(s) checked in 1 split(s), 0 damaged" in capsys.readouterr().out
    f = tmp_path / "train" / paths.step_name(1)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 4
    f.write_bytes(bytes(data))
    assert main(["verify", str(tmp_path), "--split", "train"]) == 1
    out = capsys.readouterr().out
    assert "1 damaged" in out and "DAMAGED train/1" in out and f.name in out
    assert main(["verify", str(tmp_path), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and [d["step"] for d in doc["damaged"]] == [1] and doc["checked"] == {"train": 3}
    assert main(["verify", str(tmp_path), "--deep"]) == 1
    assert main(["verify", str(tmp_path / "missing")]) == 2
    assert "no trajstore dump" in capsys.readouterr().err
