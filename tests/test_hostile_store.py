"""Hostile dumps and odd file systems, the store's part (issue 17; docs/RELIABILITY.md, threat model):
only regular files are read, small files only up to a cap, names are ASCII full matches, a writer
never deletes or writes outside the dump, and racing writers leave neither false damage nor false
skip records. Cases that could hang run in a subprocess under a timeout."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _dumps import small_batch, write

import trajstore
from trajstore.errors import ConfigError, FormatError, StepExistsError, WriterError
from trajstore.store import checksums, commit, listing, paths, regular, upgrade
from trajstore.testing import assert_batch_equal

ROOT = Path(__file__).resolve().parents[1]


def _dump(path: Path, steps=(0, 1)) -> Path:
    write(path, {s: small_batch(seed=s) for s in steps})
    return path


def _run(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


# ----------------------------------------------------------------------------- special files: no hang
_COMMANDS = r'''
import contextlib, faulthandler, io, json, sys
faulthandler.dump_traceback_later(30, exit=True)  # a hang names where it hangs, and ends
import trajstore
from trajstore import cli
from trajstore.errors import TrajstoreError
out = {}
for case, path in json.loads(sys.argv[1]).items():
    res = {}
    for name, argv in (("info", ["info", path]), ("verify", ["verify", path]),
                       ("sql", ["sql", path, "SELECT count(*) AS n FROM train"]),
                       ("export", ["export", path, "-o", path + ".jsonl"])):
        buf = io.StringIO()
        with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(buf):
            try:
                rc = cli.run(argv)
            except BaseException as e:  # a raw exception: what the test forbids
                rc = f"RAW {type(e).__name__}: {e}"
        res[name] = [rc, buf.getvalue()[-2000:]]
    for name, verify, step in (("read", False, None), ("read_verified", True, None), ("step2", False, 2)):
        try:
            r = trajstore.Reader(path, verify=verify)
            for s in (r.steps if step is None else [step]):
                r[s]
            res[name] = ["ok", r.steps, {str(k): v for k, v in r.skipped.items()}]
        except TrajstoreError as e:
            res[name] = [type(e).__name__, str(e)]
        except BaseException as e:
            res[name] = [f"RAW {type(e).__name__}", str(e)]
    try:  # a writer opening the dump (it reads the manifest and the column record, and cleans up)
        trajstore.Writer(path).close()
        res["write"] = ["ok"]
    except TrajstoreError as e:
        res["write"] = [type(e).__name__, str(e)]
    except BaseException as e:
        res["write"] = [f"RAW {type(e).__name__}", str(e)]
    out[case] = res
print(json.dumps(out))
'''


def _hostile(tmp_path: Path) -> dict[str, Path]:
    """One dump per case: a FIFO or /dev/zero where a step file, the manifest, a checksum or a skip
    record should be, and a manifest over the cap (sparse: no bytes written)."""
    base = _dump(tmp_path / "base")
    commit.record_skipped(base / "train", 3, "disk full")
    side = base / paths.SIDE / "train"
    targets = {"step": base / "train" / paths.step_name(2), "manifest": base / paths.MANIFEST,
               "sum": side / "step_00000000.sha256", "skipped": side / paths.skipped_name(3)}
    cases = {}
    for what, f in targets.items():
        for how in ("fifo", "zero"):
            d = tmp_path / f"{how}_{what}"
            shutil.copytree(base, d)
            g = d / f.relative_to(base)
            g.unlink(missing_ok=True)
            os.mkfifo(g) if how == "fifo" else os.symlink("/dev/zero", g)
            cases[f"{how}_{what}"] = d
    d = tmp_path / "big_manifest"
    shutil.copytree(base, d)
    with open(d / paths.MANIFEST, "r+b") as fh:
        fh.truncate(regular.MAX_SMALL_FILE_BYTES + 1)
    cases["big_manifest"] = d
    return cases


def test_special_files_hang_nothing_and_are_named(tmp_path):
    cases = _hostile(tmp_path)
    p = _run(_COMMANDS, json.dumps({k: str(v) for k, v in cases.items()}))
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout)
    for case, res in out.items():
        for name, (rc, *rest) in res.items():
            text = json.dumps(rest)
            assert "RAW" not in str(rc) and "Traceback" not in text, (case, name, rc, text)
    kinds = {"fifo": "FIFO", "zero": "character device"}
    for how, word in kinds.items():
        # a step file that is not a regular file: not a step; verify names it; reading it says what it is
        res = out[f"{how}_step"]
        assert res["read"][:2] == ["ok", [0, 1]] and res["read_verified"][:2] == ["ok", [0, 1]]
        assert res["step2"][0] == "FormatError" and word in res["step2"][1], res["step2"]
        assert "step_00000002.parquet" in res["step2"][1]
        assert res["verify"][0] == 1 and word in res["verify"][1] and "step_00000002.parquet" in res["verify"][1]
        assert res["info"][0] == 0 and res["sql"][0] == 0 and res["export"][0] == 0, res
        # the manifest: every command stops at once, naming it
        res = out[f"{how}_manifest"]
        for name in ("info", "verify", "sql", "export"):
            assert res[name][0] == 2 and "trajstore.json" in res[name][1] and word in res[name][1], (name, res)
        assert res["read"][0] == "FormatError" and word in res["read"][1]
        assert res["write"][0] == "FormatError" and word in res["write"][1]
        # a checksum: a plain read does not look at it, a verified read and verify name it
        res = out[f"{how}_sum"]
        assert res["read"][:2] == ["ok", [0, 1]] and res["info"][0] == 0
        assert res["read_verified"][0] == "FormatError" and "step_00000000.sha256" in res["read_verified"][1]
        assert res["verify"][0] == 1 and "step_00000000.sha256" in res["verify"][1] and word in res["verify"][1]
        # a skip record: still listed as skipped, its reason unreadable
        res = out[f"{how}_skipped"]
        assert res["read"][0] == "ok" and "unreadable record" in res["read"][2]["3"] and word in res["read"][2]["3"]
        assert res["info"][0] == 0 and res["verify"][0] == 0
    for case in ("fifo_step", "zero_step", "fifo_sum", "zero_sum", "fifo_skipped", "zero_skipped"):
        assert out[case]["write"] == ["ok"], (case, out[case]["write"])
    res = out["big_manifest"]
    assert res["read"][0] == "FormatError" and str(regular.MAX_SMALL_FILE_BYTES) in res["read"][1]
    assert res["info"][0] == 2 and "MAX_SMALL_FILE_BYTES" in res["info"][1]


def test_size_caps_name_file_and_cap(tmp_path):
    d = _dump(tmp_path / "d")
    side = d / paths.SIDE / "train"
    sum0 = side / "step_00000000.sha256"
    sum0.write_text(sum0.read_text() + " " * regular.MAX_SUM_BYTES)  # a valid line, then padding over the cap
    with pytest.raises(FormatError, match=rf"step_00000000\.sha256.*over the {regular.MAX_SUM_BYTES} bytes"):
        trajstore.Reader(d, verify=True)[0]
    rep = trajstore.verify(d)
    assert list(rep.damaged) == [("train", 0)] and "MAX_SUM_BYTES" in rep.damaged[("train", 0)]
    rec = side / paths.skipped_name(5)
    rec.write_bytes(b"{" + b" " * regular.MAX_SMALL_FILE_BYTES + b"}")
    assert "over the" in trajstore.Reader(d).skipped[5]
    cols = side / "columns.json"
    good = cols.read_text()
    cols.write_text(good + " " * regular.MAX_SMALL_FILE_BYTES)
    from trajstore.store import columns

    assert columns.read(d / "train") is None  # over the cap: a writer rebuilds the record from the steps
    assert columns.load(d / "train") == json.loads(good)["columns"]


def test_step_files_reach_pyarrow_checked(tmp_path):
    from trajstore.store.fs import source

    d = _dump(tmp_path / "d")
    f = d / "train" / paths.step_name(0)
    src = source(f)
    assert not isinstance(src, str | Path) and src.size() == f.stat().st_size  # a checked open file
    g = d / "train" / paths.step_name(7)
    os.mkfifo(g)  # non-blocking open: returns at once
    with pytest.raises(FormatError, match="FIFO"):
        source(g)
    with pytest.raises(FormatError, match="FIFO"):
        checksums.file_sha256(g)


def test_symlinked_step_files_are_read(tmp_path):
    """A dump assembled with links (``cp -s``) reads as its copy: links to regular files are followed."""
    d = _dump(tmp_path / "d")
    e = tmp_path / "e"
    (e / "train").mkdir(parents=True)
    shutil.copy(d / paths.MANIFEST, e / paths.MANIFEST)
    for s in (0, 1):
        os.symlink(d / "train" / paths.step_name(s), e / "train" / paths.step_name(s))
    r = trajstore.Reader(e)
    assert r.steps == [0, 1]
    assert_batch_equal(r[1], small_batch(seed=1))


# ----------------------------------------------------------------------------- names
ODD_NAMES = ["step_00000003.parquet\n", "step_\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0664.parquet",
             "step_0000000\u0665.parquet", "step_00000006.rank00000-of-00001.parquet\n",
             "step_00000007.rank0000\u0660-of-00001.parquet"]


def test_name_patterns_are_ascii_full_matches():
    for rx, good in ((paths.STEP_RE, "step_00000003.parquet"), (paths.SKIPPED_RE, "step_00000003.skipped.json"),
                     (paths.SHARD_RE, "step_00000003.rank00001-of-00002.parquet"),
                     (paths.SHARD_SKIPPED_RE, "step_00000003.rank00001-of-00002.skipped.json"),
                     (paths.SUM_RE, "step_00000003.sha256"), (paths.SUM_RE, "step_00000003.rank00001-of-00002.sha256"),
                     (paths.TMP_SUM_RE, ".step_00000003.sha256.tmp-12-ab"), (upgrade._SIDECAR_RE, "step_00000003.sha256"),
                     (paths.RANK_RE, "train-rank3")):
        assert rx.match(good), (rx, good)
        assert not rx.match(good.replace("3", "\u0663")), (rx, "Arabic-Indic digit")
        if rx is not paths.TMP_SUM_RE:  # a prefix pattern
            assert not rx.match(good + "\n"), (rx, "trailing newline")
    for bad in ("train\n", "tr\u0660in\n", "\u0663", "train\r"):
        with pytest.raises(ConfigError):
            paths.check_split(bad)


def test_temporaries_pids_are_ascii(tmp_path):
    """A pid of other digits is no pid: such a temporary is stale, not a live writer's (pid 1 is alive)."""
    from trajstore.store import files

    names = [".step_00000001.parquet.tmp-\u0661-ab", ".step_00000002.parquet.tmp-1-ab"]
    for n in names:
        (tmp_path / n).write_text("")
    assert files.stale_temps(tmp_path, ".step_") == [names[0]]


def test_odd_names_are_not_steps(tmp_path):
    d = _dump(tmp_path / "d")
    for n in ODD_NAMES:
        shutil.copy(d / "train" / paths.step_name(1), d / "train" / n)
    (d / "train\n").mkdir()  # a split name no writer makes
    shutil.copy(d / "train" / paths.step_name(1), d / "train\n" / paths.step_name(1))
    r = trajstore.Reader(d)
    assert r.steps == [0, 1] and r.splits == ["train"]
    assert trajstore.verify(d).ok
    from trajstore.cli import run

    assert run(["info", str(d)]) == 0
    assert run(["sql", str(d), "SELECT count(DISTINCT step) AS n FROM train"]) == 0
    assert run(["export", str(d), "-o", str(tmp_path / "out.jsonl")]) == 0
    with pytest.raises(ConfigError):
        trajstore.Reader(d, split="train\n")
    with pytest.raises(ConfigError):
        trajstore.Writer(d, split="train\n")
    # a writer's clean-up leaves files of names it does not make alone
    side = d / paths.SIDE / "train"
    for n in ("step_00000009.sha256\n", "step_0000000\u0669.sha256", "ISO.sha256"):
        (side / n).write_text("x")
        (d / "train" / n).write_text("x")
    trajstore.Writer(d).close()
    for n in ("step_00000009.sha256\n", "step_0000000\u0669.sha256", "ISO.sha256"):
        assert (side / n).exists() and (d / "train" / n).exists(), n


# ----------------------------------------------------------------------------- writer confinement
def _victim(tmp_path: Path) -> tuple[Path, list[str]]:
    v = tmp_path / "victim"
    v.mkdir()
    for n in ("ISO.sha256", "step_00000004.sha256", ".step_00000001.parquet.tmp-1", "notes.txt"):
        (v / n).write_text("precious")
    return v, sorted(os.listdir(v))


@pytest.mark.parametrize("link", ["train", "_trajstore", "_trajstore/train", "_trajstore/train/index"])
def test_writer_refuses_linked_folders_before_cleaning(tmp_path, link):
    victim, before = _victim(tmp_path)
    evil = tmp_path / "evil"
    if link != "train":
        _dump(evil)
        shutil.rmtree(evil / link)
    (evil / link).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(victim, evil / link)
    with pytest.raises(FormatError, match=re.escape(str(evil / link)) + ".*symbolic link"):
        trajstore.Writer(evil)
    assert sorted(os.listdir(victim)) == before
    assert all((victim / n).read_text() == "precious" for n in before)


def test_upgrade_refuses_a_linked_split(tmp_path):
    from trajstore.store import upgrade as up

    d = _dump(tmp_path / "d")
    doc = json.loads((d / paths.MANIFEST).read_text())
    (d / paths.MANIFEST).write_text(json.dumps({**doc, "format_version": 1}))
    victim, before = _victim(tmp_path)
    os.symlink(victim, d / "val")
    with pytest.raises(FormatError, match="symbolic link"):
        up.upgrade_layout(d)
    assert sorted(os.listdir(victim)) == before


def test_a_linked_dump_folder_is_the_callers_choice(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    r = write(tmp_path / "link", {0: small_batch()})
    assert r.steps == [0] and (real / "train" / paths.step_name(0)).is_file()


@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES])
def test_writer_on_a_read_only_mount(tmp_path, monkeypatch, err):
    real_mkdir = os.mkdir

    def ro(p, *a, **k):  # what a read-only mount (or a folder without write permission) answers
        if str(p).startswith(str(tmp_path)):
            if os.path.lexists(p):  # Linux answers EEXIST first
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(p))
            raise OSError(err, os.strerror(err), str(p))
        return real_mkdir(p, *a, **k)

    monkeypatch.setattr(os, "mkdir", ro)
    with pytest.raises(WriterError, match=re.escape(str(tmp_path / "new")) + ".*" + re.escape(os.strerror(err))):
        trajstore.Writer(tmp_path / "new")
    monkeypatch.undo()
    d = _dump(tmp_path / "d")
    shutil.rmtree(d / "train")
    monkeypatch.setattr(os, "mkdir", ro)
    with pytest.raises(WriterError, match="split folder"):
        trajstore.Writer(d)


# ----------------------------------------------------------------------------- concurrent writers
def _racer(path: str, seed: int, n: int, overwrite: bool, log: str, barrier) -> None:
    """One writer of a race (a forked process: no second import of torch)."""
    import random
    import time

    handler = logging.FileHandler(log)
    logging.getLogger("trajstore.writer").addHandler(handler)
    rng = random.Random(seed)
    real = os.replace

    def slow(src, dst, *a, **k):  # widen the window between a step's two renames, as a loaded machine does
        if str(dst).endswith(".sha256"):
            time.sleep(rng.random() * 0.02)
        return real(src, dst, *a, **k)

    os.replace = slow
    with trajstore.Writer(path, overwrite=overwrite, on_error="warn", max_pending_steps=1) as w:
        for s in range(n):
            barrier.wait(60)  # the writers append each step together: all write it at once
            try:
                w.append(s, small_batch(B=2, T=4, seed=seed * 1000 + s))
            except StepExistsError:  # committed by the other writer before this append: no race
                pass
    handler.flush()


def _race(path: Path, procs: int, n: int, overwrite: bool) -> list[str]:
    import multiprocessing

    trajstore.Writer(path).close()
    ctx = multiprocessing.get_context("fork")
    logs = [str(path.parent / f"{path.name}.log{k}") for k in range(procs)]
    barrier = ctx.Barrier(procs)
    ps = [ctx.Process(target=_racer, args=(str(path), k, n, overwrite, logs[k], barrier)) for k in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(240)
        assert p.exitcode == 0, p.exitcode
    return [Path(f).read_text() for f in logs]


def test_overwriting_writers_leave_no_false_damage(tmp_path):
    """4 processes overwrite the same steps: each step's file and checksum come from one writer."""
    d = tmp_path / "d"
    _race(d, 4, 24, overwrite=True)
    rep = trajstore.verify(d)
    assert rep.ok and not rep.damaged and rep.checked == {"train": 24}, rep.damaged
    r = trajstore.Reader(d, verify=True)
    assert r.steps == list(range(24)) and r.skipped == {}
    for s in r.steps:
        r[s]


def test_racing_writers_leave_no_false_skip_records(tmp_path):
    """2 processes write the same steps without overwrite: each step is written once, none is recorded
    as skipped, and the losers' warnings say no record was written."""
    d = tmp_path / "d"
    errs = _race(d, 2, 24, overwrite=False)
    r = trajstore.Reader(d, verify=True)
    assert r.steps == list(range(24)) and r.skipped == {}
    assert trajstore.verify(d).ok
    lost = [line for e in errs for line in e.splitlines() if "was not written" in line]
    assert lost and all("no skipped record was written: its step file is there" in line for line in lost), lost
    assert not any("recorded as skipped" in line for e in errs for line in e.splitlines())


def test_record_skipped_of_a_committed_step_writes_none(tmp_path, caplog, monkeypatch):
    d = _dump(tmp_path / "d")
    assert commit.record_skipped(d / "train", 1, "lost the race") is False
    assert listing.list_skipped(d / "train") == {}
    assert commit.record_skipped(d / "train", 2, "disk full") is True
    real = commit.commit

    def racer_first(tmp, final, overwrite):  # another writer commits the step while this one writes it
        shutil.copy(d / "train" / paths.step_name(0), final)
        return real(tmp, final, overwrite)

    monkeypatch.setattr(commit, "commit", racer_first)
    with caplog.at_level(logging.ERROR, "trajstore.writer"):
        w = trajstore.Writer(d, on_error="warn")
        w.append(5, small_batch(seed=9))
        w.close()
    assert "step 5 was not written" in caplog.text
    assert "no skipped record was written: its step file is there" in caplog.text
    assert set(listing.list_skipped(d / "train")) == {2}
