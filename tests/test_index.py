"""The per-split index of per-trajectory columns (trajstore/store/index.py and segments.py, docs/FORMAT.md section 6):
``Reader.column`` gives the same values, of the same types, with and without it, and falls back to
the step files wherever the index is missing, stale or damaged."""

import errno
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stress.faults import inject

import trajstore
from trajstore.store import index, paths
from trajstore.inspection import describe as _info
from trajstore.read.reader import Reader
from trajstore.record.recorder import DumpReplayConfig, Recorder
from trajstore.testing import TORCH_DTYPES, assert_batch_equal, tensors


def _batch(step, B=4, v=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(step * 10 + v)
    return {"input_ids": torch.randint(0, 100, (B, 5), generator=g),
            "attention_mask": torch.ones(B, 5, dtype=torch.bool),
            "rewards": torch.randn(B, generator=g).to(dtype), "seq_len": torch.full((B,), 5 + step)}


def _idx(path, split="train"):
    """Where new segments of the split go (``_trajstore/<split>/index/`` in a dump of layout 2)."""
    return index.dirs(Path(path) / split)[0]


def _segments(path, split="train"):
    d = _idx(path, split)
    return sorted(n for n in os.listdir(d) if index.SEGMENT_RE.match(n)) if d.exists() else []


def _rehash(f):
    """Record ``f``'s SHA-256 in its sidecar, as a writer of the segment would (a consistent forgery)."""
    f.with_suffix(".sha256").write_text(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n")


def _write(path, steps, **kw):
    with trajstore.Writer(path, **kw) as w:
        for s in steps:
            w.append(s, _batch(s))


def _same(a, b, where):
    assert_batch_equal(a, b, where)
    if isinstance(a, np.ndarray):
        assert a.flags.writeable == b.flags.writeable, where


def _file_path(r, name, steps):
    """What ``column`` returns without the index: each step read from its file."""
    return {s: r._column(s, name) for s in steps}


class _Spy:
    """Records the steps ``Reader.column`` read from their files."""

    def __init__(self):
        self.steps = []

    def __enter__(self):
        orig = Reader._column

        def spy(r, step, name):
            self.steps.append(step)
            return orig(r, step, name)

        self._p = mock.patch.object(Reader, "_column", spy)
        self._p.start()
        return self

    def __exit__(self, *exc):
        self._p.stop()


# ----------------------------------------------------------------------------- property
@st.composite
def _steps(draw):
    """Steps (random numbers) each holding ``rewards`` of a random batch size and dtype (torch or
    numpy), sometimes per-token or [B, k] (not indexable), sometimes absent."""
    nums = draw(st.lists(st.integers(0, 40), min_size=1, max_size=7, unique=True))
    out = {}
    for s in nums:
        B = draw(st.integers(0, 6))
        kind = draw(st.sampled_from(["plain"] * 4 + ["trail", "missing", "list"]))
        b = {"input_ids": torch.zeros(B, 3, dtype=torch.int32), "attention_mask": torch.ones(B, 3, dtype=torch.bool)}
        if kind == "plain":
            b["rewards"] = draw(tensors((B,), TORCH_DTYPES, numpy=None))
        elif kind == "trail":
            b["rewards"] = draw(tensors((B, 2)))
        elif kind == "list":
            b = [{"rewards": draw(tensors((1,), [torch.float32]))} for _ in range(B)]
        if draw(st.booleans()) and isinstance(b, dict):
            b["seq_len"] = draw(tensors((B,), [torch.int64, torch.int32]))
        out[s] = b
    return out


@settings(max_examples=40, deadline=None)
@given(_steps(), st.integers(1, 4), st.sampled_from([1, 2]), st.data())
def test_column_same_with_and_without_index(batches, every, workers, data):
    nums = list(batches)
    with tempfile.TemporaryDirectory() as d, mock.patch.object(index, "INDEX_EVERY", every), \
            mock.patch.object(logging.getLogger("trajstore.reader"), "disabled", True):
        with trajstore.Writer(d, workers=workers) as w:
            for s in nums:
                w.append(s, batches[s])
        assert _segments(d) or not any(index.fields(trajstore.Reader(d).info(s)["batch"]) for s in nums)
        stale = set()
        redo = data.draw(st.lists(st.sampled_from(nums), unique=True, max_size=2), "overwritten")
        if redo:  # rewritten by a writer killed before it wrote its segment
            with mock.patch.object(index.Collector, "flush"):
                with trajstore.Writer(d, overwrite=True) as w:
                    for s in redo:
                        w.append(s, {"rewards": torch.arange(3, dtype=torch.float64)})
            stale |= set(redo)
        segs = _segments(d)
        # (segment names, sizes and counts vary from run to run: draw positions and fractions)
        hit = data.draw(st.lists(st.integers(0, 7), unique=True, max_size=2), "damaged segments")
        for n in [segs[i] for i in hit if i < len(segs)]:
            f = _idx(d) / n
            raw = f.read_bytes()
            f.write_bytes(raw[: int(len(raw) * data.draw(st.floats(0, 0.99), "cut at"))])
            stale |= {s for s in nums if index.SEGMENT_RE.match(n) and
                      int(n[6:14]) <= s <= int(n.split("-")[1].split(".")[0])}
        r = trajstore.Reader(d)
        ask = data.draw(st.lists(st.sampled_from(nums), min_size=1), "asked")
        have = [s for s in dict.fromkeys(ask) if "rewards" in _names(r, s)]
        ref = _file_path(r, "rewards", have)
        rv = trajstore.Reader(d, verify=True).column("rewards", have)
        with _Spy() as spy:
            got = r.column("rewards", have, workers=data.draw(st.sampled_from([None, 3]), "column workers"))
        assert list(got) == have == list(rv)
        for s in have:
            _same(got[s], ref[s], f"step {s}")
            _same(got[s], rv[s], f"step {s} verify=True")
        for s in set(have) - set(spy.steps):
            assert "rewards" in dict(index.fields(r.info(s)["batch"])), s  # only indexable fields skip the file
        # every indexable step whose segment is intact and whose file was not rewritten skips its file
        assert not [s for s in spy.steps if s not in stale and "rewards" in dict(index.fields(r.info(s)["batch"]))]


def _names(r, s):
    spec = r.info(s)["batch"]
    return [k for k, _ in (spec if spec["t"] == "batch" else spec["elem"]).get("keys", [])]


# ----------------------------------------------------------------------------- behaviour
def test_index_written_on_close_and_used(tmp_path):
    _write(tmp_path, range(5))
    assert len(_segments(tmp_path)) == 1 and _segments(tmp_path)[0].startswith("steps_00000000-00000004.")
    t = pq.read_table(_idx(tmp_path) / _segments(tmp_path)[0])
    assert t.column_names == ["step", "row", "rewards", "seq_len", "~0"]
    assert (t.schema.field("step").type, t.schema.field("row").type) == (pa.int64(), pa.int32())
    meta = json.loads(t.schema.metadata[index.KEY])
    assert meta["version"] == 1 and meta["split"] == "train"
    assert meta["derived"] == [["~0", "tokens", []]] and t.column("~0").to_pylist() == [5] * 20
    assert (_idx(tmp_path) / _segments(tmp_path)[0]).with_suffix(".sha256").read_text() == \
        f"{hashlib.sha256((_idx(tmp_path) / _segments(tmp_path)[0]).read_bytes()).hexdigest()}  {_segments(tmp_path)[0]}\n"
    assert [k for k, _ in meta["fields"]] == ["rewards", "seq_len"] and len(meta["steps"]) == 5
    st_ = os.stat(tmp_path / "train" / paths.step_name(3))
    assert meta["steps"][3] == [3, 4, st_.st_ino, st_.st_size, st_.st_mtime_ns]
    r = trajstore.Reader(tmp_path)
    with _Spy() as spy:
        got = r.column("rewards")
        seq = r.column("seq_len", [4, 0])
    assert spy.steps == []
    for s in range(5):
        _same(got[s], _batch(s)["rewards"], f"step {s}")
    assert list(seq) == [4, 0] and torch.equal(seq[4], torch.full((4,), 9))
    with _Spy() as spy:  # not a plain per-trajectory field: from the files
        r.column("input_ids", [0, 1])
    assert spy.steps == [0, 1]


def test_segments_every_n_steps_and_on_flush(tmp_path, monkeypatch):
    monkeypatch.setattr(index, "INDEX_EVERY", 3)
    w = trajstore.Writer(tmp_path)
    for s in range(7):
        w.append(s, _batch(s))
    w.flush()
    assert [n[:23] for n in _segments(tmp_path)] == ["steps_00000000-00000002", "steps_00000003-00000005",
                                                      "steps_00000006-00000006"]
    w.flush()  # nothing kept: no new segment
    assert len(_segments(tmp_path)) == 3
    w.append(7, {"rewards": torch.zeros(2, dtype=torch.float64)})  # another set of fields: another segment
    w.append(8, _batch(8))
    w.close()
    assert [n[:23] for n in _segments(tmp_path)][3:] == ["steps_00000007-00000007", "steps_00000008-00000008"]
    got = trajstore.Reader(tmp_path).column("rewards")
    assert got[7].dtype == torch.float64 and got[8].dtype == torch.float32


def test_overwritten_step_is_read_from_its_file(tmp_path):
    _write(tmp_path, range(4))
    with mock.patch.object(index.Collector, "flush"):  # no segment for the new version
        with trajstore.Writer(tmp_path, overwrite=True) as w:
            w.append(2, _batch(2, B=6, v=1, dtype=torch.bfloat16))
    r = trajstore.Reader(tmp_path)
    with _Spy() as spy:
        got = r.column("rewards")
    assert spy.steps == [2]
    _same(got[2], _batch(2, B=6, v=1, dtype=torch.bfloat16)["rewards"], "step 2")
    _same(got[1], _batch(1)["rewards"], "step 1")
    _write(tmp_path, [2], overwrite=True)  # rewritten again, indexed this time: the new segment serves it
    r = trajstore.Reader(tmp_path)
    with _Spy() as spy:
        got = r.column("rewards")
    assert spy.steps == [] and len(_segments(tmp_path)) == 2
    _same(got[2], _batch(2)["rewards"], "step 2")


def test_overwrite_in_one_writer_keeps_the_last_version(tmp_path):
    with trajstore.Writer(tmp_path, overwrite=True) as w:
        w.append(0, _batch(0))
        w.flush()
        w.append(0, _batch(0, v=1))
        w.append(1, _batch(1))
    got = trajstore.Reader(tmp_path).column("rewards")
    _same(got[0], _batch(0, v=1)["rewards"], "step 0")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "no-metadata", "wrong-rows",
                                    "wrong-steps", "newer-version", "other-split", "wrong-type", "bad-node",
                                    "bad-derived", "derived-clash", "no-checksum", "bad-checksum"])
def test_damaged_segment_is_ignored(tmp_path, caplog, damage):
    """Damage of any kind, also where its checksum is recomputed to match (its structure is checked)."""
    _write(tmp_path, range(3))
    f = _idx(tmp_path) / _segments(tmp_path)[0]
    raw = f.read_bytes()
    t = pq.read_table(f)
    meta = json.loads(t.schema.metadata[index.KEY])
    if damage == "truncated":
        f.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        f.write_bytes(os.urandom(len(raw)))
    elif damage == "empty":
        f.write_bytes(b"")
    else:
        if damage == "no-metadata":
            t = t.replace_schema_metadata({})
        elif damage == "wrong-rows":
            t = t.set_column(1, "row", pa.array(np.zeros(t.num_rows, np.int32)))
        elif damage == "wrong-steps":
            meta["steps"][1][0] = 7
        elif damage == "newer-version":
            meta["version"] = 2
        elif damage == "other-split":
            meta["split"] = "val"
        elif damage == "wrong-type":
            t = t.set_column(2, "rewards", t.column("rewards").cast(pa.float64()))
        elif damage == "bad-node":
            meta["fields"][0][1]["trail"] = [2]
        elif damage == "bad-derived":
            meta["derived"][0][1] = "mean"
        elif damage == "derived-clash":
            meta["derived"][0][0] = "rewards"
        if damage not in ("no-metadata", "no-checksum", "bad-checksum"):
            t = t.replace_schema_metadata({index.KEY: json.dumps(meta)})
        f.unlink()
        pq.write_table(t, f)
    if damage == "no-checksum":
        f.with_suffix(".sha256").unlink()
    elif damage == "bad-checksum":
        f.with_suffix(".sha256").write_text("0" * 64 + "  x\n")
    elif damage not in ("truncated", "garbage", "empty"):
        _rehash(f)
    r = trajstore.Reader(tmp_path)
    with caplog.at_level(logging.WARNING, "trajstore.reader"), _Spy() as spy:
        got = r.column("rewards")
        r.column("rewards")  # warned once: the segment stays ignored
    assert spy.steps == [0, 1, 2, 0, 1, 2]
    for s in range(3):
        _same(got[s], _batch(s)["rewards"], f"step {s}")
    warned = [m for m in caplog.messages if "is ignored" in m]
    assert len(warned) == 1 and f.name in warned[0], caplog.messages


def test_falsified_segment_is_ignored_even_with_its_size_and_mtime(tmp_path, caplog):
    """Issue 17: a segment whose values were falsified in place (same inode, size and mtime; its
    step files untouched) fails its checksum: ``Reader.column`` returns the step files' values."""
    _write(tmp_path, range(3))
    f = _idx(tmp_path) / _segments(tmp_path)[0]
    st0, raw = os.stat(f), f.read_bytes()
    t = pq.read_table(f)
    t = t.set_column(2, "rewards", pa.array(np.full(t.num_rows, 42.0, np.float32)))
    meta = dict(t.schema.metadata)

    def forge(pad: int, extra: int) -> bytes:  # parquet key-value padding: one byte a character
        buf = pa.BufferOutputStream()
        with pq.ParquetWriter(buf, t.schema, compression="zstd", write_page_checksum=True) as w:
            w.write_table(t)
            w.add_key_value_metadata({"pad": "x" * pad, "p2": "y" * extra})
        return buf.getvalue().to_pybytes()

    short = len(raw) - len(forge(0, 0))  # a forgery of exactly the segment's size
    assert short > 0
    forged = next(x for p in range(max(short - 4, 0), short + 1) for e in range(3)
                  if len(x := forge(p, e)) == len(raw))
    assert len(forged) == len(raw) and forged != raw
    with open(f, "r+b") as fh:  # in place: the same inode
        fh.write(forged)
    os.utime(f, ns=(st0.st_atime_ns, st0.st_mtime_ns))
    st1 = os.stat(f)
    assert (st1.st_ino, st1.st_size, st1.st_mtime_ns) == (st0.st_ino, st0.st_size, st0.st_mtime_ns)
    assert pq.read_table(f).column("rewards").to_pylist()[:4] == [42.0] * 4  # a valid segment, false values
    with caplog.at_level(logging.WARNING, "trajstore.reader"), _Spy() as spy:
        got = trajstore.Reader(tmp_path).column("rewards")
    assert spy.steps == [0, 1, 2] and "SHA-256" in caplog.text and f.name in caplog.text
    for s in range(3):
        _same(got[s], _batch(s)["rewards"], f"step {s}")


def test_forged_segment_with_its_checksum_is_trusted_and_verify_ignores_it(tmp_path):
    """A forger who also rewrites the segment's checksum is trusted, as with step files and their
    checksums (docs/RELIABILITY.md); ``verify=True`` reads the (checked) step files instead."""
    _write(tmp_path, range(3))
    f = _idx(tmp_path) / _segments(tmp_path)[0]
    t = pq.read_table(f)
    t = t.set_column(2, "rewards", pa.array(np.full(t.num_rows, 42.0, np.float32)))
    f.unlink()
    pq.write_table(t, f)
    _rehash(f)
    assert torch.equal(trajstore.Reader(tmp_path).column("rewards")[1], torch.full((4,), 42.0))
    got = trajstore.Reader(tmp_path, verify=True).column("rewards")
    for s in range(3):
        _same(got[s], _batch(s)["rewards"], f"step {s}")


def test_killed_writer_leaves_no_segment_and_steps_mix(tmp_path):
    _write(tmp_path, range(3))  # indexed
    code = f"""
import os, signal, time, torch, trajstore
w = trajstore.Writer({str(tmp_path)!r})
for s in range(3, 6):
    g = torch.Generator().manual_seed(s * 10)
    w.append(s, {{"input_ids": torch.randint(0, 100, (4, 5), generator=g),
                 "attention_mask": torch.ones(4, 5, dtype=torch.bool),
                 "rewards": torch.randn(4, generator=g), "seq_len": torch.full((4,), 5 + s)}})
while w.stats["written"] < 3:
    time.sleep(0.01)
os.kill(os.getpid(), signal.SIGKILL)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert len(_segments(tmp_path)) == 1
    r = trajstore.Reader(tmp_path)
    assert r.steps == list(range(6))
    with _Spy() as spy:
        got = r.column("rewards", [5, 0, 3, 1, 4, 2])
    assert spy.steps == [5, 3, 4] and list(got) == [5, 0, 3, 1, 4, 2]
    for s in range(6):
        _same(got[s], _batch(s)["rewards"], f"step {s}")
    with _Spy() as spy:
        got = r.column("rewards", [5, 0, 3, 1, 4, 2], workers=2)
    assert sorted(spy.steps) == [3, 4, 5] and list(got) == [5, 0, 3, 1, 4, 2]


def test_missing_and_deleted_steps_still_raise(tmp_path):
    _write(tmp_path, range(3))
    (tmp_path / "train" / paths.step_name(1)).unlink()
    r = trajstore.Reader(tmp_path)
    with pytest.raises(trajstore.StepNotFoundError, match="step 1"):
        r.column("rewards", [0, 1])
    with pytest.raises(trajstore.StepNotFoundError, match="step 9"):
        r.column("rewards", [9])
    assert list(r.column("rewards", [2, 0])) == [2, 0]


@pytest.mark.parametrize("point", ["data", "open", "fsync", "link"])
def test_index_errors_never_fail_append(tmp_path, caplog, point, monkeypatch):
    monkeypatch.setattr(index, "INDEX_EVERY", 2)
    trajstore.Writer(tmp_path).close()  # the dump exists: its index folder is known
    idx = _idx(tmp_path)
    assert idx == tmp_path / "_trajstore" / "train" / "index"
    with caplog.at_level(logging.WARNING, "trajstore.writer"):
        with inject(idx, point, errno.ENOSPC, persist=True) as fault:
            with trajstore.Writer(tmp_path) as w:
                for s in range(5):
                    w.append(s, _batch(s))
                w.flush()
    assert fault.fired
    assert "index segment" in caplog.text and "No space left" in caplog.text
    assert _segments(tmp_path) == [] and not [n for n in os.listdir(idx) if n.startswith(".")]
    got = trajstore.Reader(tmp_path).column("rewards")
    for s in range(5):
        _same(got[s], _batch(s)["rewards"], f"step {s}")


def test_failing_index_code_never_fails_append(tmp_path, caplog, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("index bug")

    monkeypatch.setattr(index, "fields", boom)
    with caplog.at_level(logging.WARNING, "trajstore.writer"):
        _write(tmp_path, range(3))
    assert "left out of the index" in caplog.text and _segments(tmp_path) == []
    monkeypatch.undo()
    monkeypatch.setattr(index.Collector, "_write", boom)  # raising where it must not: still contained
    with caplog.at_level(logging.WARNING, "trajstore.writer"):
        _write(tmp_path, range(3, 5))
    assert trajstore.Reader(tmp_path).steps == list(range(5))


def test_index_values_are_copies(tmp_path):
    """Rows are copied at write time (the caller may change its tensors once the step is written)
    and each result owns its memory (changing it leaves the next call's result alone)."""
    rewards = torch.arange(4, dtype=torch.float32)
    with trajstore.Writer(tmp_path) as w:
        w.append(0, {"rewards": rewards})
        w.append(1, {"rewards": np.arange(3, dtype=np.int16)})
        while w.stats["written"] < 2:
            pass
        rewards += 100  # allowed now: the step is on disk, its segment is not written yet
    r = trajstore.Reader(tmp_path)
    got = r.column("rewards")
    assert torch.equal(got[0], torch.arange(4, dtype=torch.float32))
    got[0] += 1
    assert torch.equal(r.column("rewards")[0], torch.arange(4, dtype=torch.float32))
    assert not got[1].flags.writeable  # as from the step file
    _same(got[1], r._column(1, "rewards"), "step 1")


def test_field_named_row_is_read_from_files(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, {"row": torch.arange(3), "rewards": torch.ones(3)})
    meta = json.loads(pq.read_schema(_idx(tmp_path) / _segments(tmp_path)[0]).metadata[index.KEY])
    assert [k for k, _ in meta["fields"]] == ["rewards"]
    assert torch.equal(trajstore.Reader(tmp_path).column("row")[0], torch.arange(3))


def test_other_readers_ignore_the_index(tmp_path):
    _write(tmp_path, range(3))
    dead = 2**22 + 12345
    (_idx(tmp_path) / f".steps_00000000-00000001.0badc0de.parquet.tmp-{dead}-ab").write_text("x")
    r = trajstore.Reader(tmp_path)
    assert r.steps == [0, 1, 2] and trajstore.verify(tmp_path).ok and trajstore.verify(tmp_path, deep=True).ok
    d = _info.describe(tmp_path)
    assert d["splits"]["train"]["steps"]["count"] == 3 and list(d["splits"]) == ["train"]
    assert len(r.to_pandas()) == 12
    trajstore.Writer(tmp_path).close()  # reopening cleans the dead writer's temporary
    assert sorted(os.listdir(_idx(tmp_path))) == sorted(_segments(tmp_path) + [
        n[: -len("index")] + "sha256" for n in _segments(tmp_path)])


def test_sql_view_ignores_the_index(tmp_path):
    pytest.importorskip("duckdb")
    _write(tmp_path, range(3))
    assert _segments(tmp_path)
    assert trajstore.Reader(tmp_path).duckdb().execute("SELECT count(*) FROM train").fetchone()[0] == 12


def test_rotation_deletes_segments_whose_steps_are_gone(tmp_path, monkeypatch):
    monkeypatch.setattr(index, "INDEX_EVERY", 2)
    with Recorder(DumpReplayConfig(dump=True, path=str(tmp_path), max_keep=2, pin_steps=(1,))) as rec:
        for s in range(9):
            rec.record(s, _batch(s))
            rec._writer.flush()
    segs = _segments(tmp_path)
    ranges = [(int(n[6:14]), int(n[15:23])) for n in segs]
    kept = trajstore.Reader(tmp_path).steps
    assert kept == [1, 7, 8]
    assert all(any(lo <= s <= hi for s in kept) for lo, hi in ranges), ranges  # no segment of only deleted steps
    assert any(lo <= 1 <= hi for lo, hi in ranges)  # the pinned step's segment stays
    r = trajstore.Reader(tmp_path)
    with _Spy() as spy:
        got = r.column("rewards")
    assert spy.steps == []
    for s in kept:
        _same(got[s], _batch(s)["rewards"], f"step {s}")


def test_failing_digests_leave_the_fields_indexed(tmp_path, caplog, monkeypatch):
    from trajstore.store import digest

    def boom(*a, **k):
        raise RuntimeError("digest bug")

    monkeypatch.setattr(digest, "derive", boom)
    with caplog.at_level(logging.WARNING, "trajstore.writer"):
        _write(tmp_path, range(2))
    assert "no run-page digests" in caplog.text
    meta = json.loads(pq.read_schema(_idx(tmp_path) / _segments(tmp_path)[0]).metadata[index.KEY])
    assert [k for k, _ in meta["fields"]] == ["rewards", "seq_len"] and "derived" not in meta
    with _Spy() as spy:
        got = trajstore.Reader(tmp_path).column("rewards")
    assert spy.steps == [] and torch.equal(got[1], _batch(1)["rewards"])
