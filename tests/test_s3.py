"""Dumps on object storage (issue 14), against a real S3 server on 127.0.0.1 (moto's server mode,
tests/_s3server.py), with both pyarrow's S3 file system and fsspec/s3fs (the ``s3_dump`` fixture runs
each test with both): bit-exact round trips, every read path, the CLI, verify, a writer killed with
SIGKILL mid-upload, two writers racing for one step, and a listing of 10,000 objects."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
from hypothesis import given, settings

import trajstore
from trajstore.cli import main
from trajstore.errors import ChecksumError, ConfigError, StepExistsError, WriterError
from trajstore.store import fs, remote
from trajstore.testing import assert_batch_equal, batches

ROOT = Path(__file__).resolve().parents[1]


def _batch(i: int, n: int = 4) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"input_ids": torch.randint(0, 100, (n, 6), generator=g), "rewards": torch.rand(n, generator=g),
            "attention_mask": torch.ones(n, 6, dtype=torch.long)}


def _bucket_key(url: str) -> tuple[str, str]:
    b, k = url[len("s3://"):].split("/", 1)
    return b, k


def test_round_trip_bit_exact_on_every_read_path(s3_dump):
    steps = itertools.count()
    written = {}

    @settings(max_examples=6)
    @given(batch=batches())
    def check(batch):
        s = next(steps)
        with trajstore.Writer(s3_dump) as w:
            w.append(s, batch, meta={"n": s})
        written[s] = batch
        r = trajstore.Reader(s3_dump, verify=True)
        assert_batch_equal(batch, r[s])
        assert r.meta(s) == {"n": s}

    check()
    r = trajstore.Reader(s3_dump)
    assert r.steps == sorted(written)
    for s, got in r.iter(prefetch=2):
        assert_batch_equal(written[s], got)
    assert trajstore.verify(s3_dump).ok


def test_column_pandas_sql_and_the_cli(s3_dump, capsys):
    with trajstore.Writer(s3_dump) as w:
        for s in range(3):
            w.append(s, _batch(s), meta={"lr": s})
    r = trajstore.Reader(s3_dump)
    col = r.column("rewards")
    assert list(col) == [0, 1, 2] and all(torch.equal(col[s], _batch(s)["rewards"]) for s in range(3))
    assert r.to_pandas().shape[0] == 12
    assert r.duckdb().execute("SELECT count(*), count(DISTINCT step) FROM train").fetchone() == (12, 3)
    assert main(["info", s3_dump]) == 0
    out = capsys.readouterr().out
    assert f"dump {s3_dump}" in out and "count 3" in out, out
    assert main(["verify", s3_dump]) == 0
    assert "3 step(s) checked" in capsys.readouterr().out
    assert main(["sql", s3_dump, "SELECT step, count(*) AS n FROM train GROUP BY step ORDER BY step",
                 "--format", "csv"]) == 0
    assert capsys.readouterr().out.split() == ["step,n", "0,4", "1,4", "2,4"]
    assert main(["diff", s3_dump, s3_dump]) == 0
    assert main(["info", s3_dump + "-none"]) != 0
    assert "no trajstore dump at s3://" in capsys.readouterr().err


def test_verify_finds_a_corrupted_object(s3_dump, s3_server, capsys):
    with trajstore.Writer(s3_dump) as w:
        for s in range(2):
            w.append(s, _batch(s))
    bucket, key = _bucket_key(s3_dump)
    k = f"{key}/train/step_00000001.parquet"
    c = s3_server.client()
    data = bytearray(c.get_object(Bucket=bucket, Key=k)["Body"].read())
    data[len(data) // 2] ^= 1
    c.put_object(Bucket=bucket, Key=k, Body=bytes(data))
    rep = trajstore.verify(s3_dump)
    assert not rep.ok and list(rep.damaged) == [("train", 1)], rep.summary()
    assert "damaged" in rep.damaged[("train", 1)]
    with pytest.raises(ChecksumError, match="step 1 is damaged"):
        trajstore.Reader(s3_dump, verify=True)[1]
    assert_batch_equal(_batch(0), trajstore.Reader(s3_dump, verify=True)[0])
    assert main(["verify", s3_dump]) == 1
    assert "DAMAGED train/1" in capsys.readouterr().out


_KILLED = r"""
import sys, torch, trajstore
url = sys.argv[1]
w = trajstore.Writer(url)
w.append(0, {"x": torch.arange(8)})
w.flush()
g = torch.Generator().manual_seed(0)
w.append(1, {"x": torch.rand(4, 4_000_000, generator=g)})  # 64 MB, incompressible: a long upload
w.flush()
print("committed", flush=True)
"""


def test_a_writer_killed_mid_upload_leaves_no_partial_step(s3_dump, s3_server):
    bucket, key = _bucket_key(s3_dump)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-c", _KILLED, s3_dump], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    pending = f"{key}/_trajstore/train/.pending/step_00000001.parquet/"
    try:
        while p.poll() is None and not s3_server.keys(bucket, pending):
            time.sleep(0.005)
        # the pending checksum is PUT just before the step: the step's upload is starting now
        time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
    finally:
        out, err = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL, (p.returncode, out, err[-2000:])
    assert "committed" not in out
    keys = s3_server.keys(bucket, f"{key}/train/")
    assert keys == [f"{key}/train/step_00000000.parquet"], keys  # no step 1, not even in part
    r = trajstore.Reader(s3_dump, verify=True)
    assert r.steps == [0] and torch.equal(r[0]["x"], torch.arange(8))
    assert trajstore.verify(s3_dump).ok
    # a new writer on this host: the dead writer's pending checksum is removed, step 1 can be written
    with trajstore.Writer(s3_dump) as w:
        w.append(1, {"x": torch.arange(3)})
    assert [k for k in s3_server.keys(bucket, pending) if not k.endswith("/")] == []
    assert torch.equal(trajstore.Reader(s3_dump, verify=True)[1]["x"], torch.arange(3))


def test_two_writers_race_for_one_step(s3_dump, s3_server, monkeypatch):
    """Both writers reach the commit of step 5 together (a barrier): with a conditional PUT (s3fs)
    exactly one wins; without one (pyarrow) never both, and each loser gets StepExistsError. The
    winner's bytes are intact and match their checksum."""
    barrier = threading.Barrier(2, timeout=60)
    commit = remote.commit

    def together(final, data, overwrite):
        barrier.wait()
        commit(final, data, overwrite)

    monkeypatch.setattr(remote, "commit", together)
    results: dict[int, BaseException | None] = {}

    def write(i: int) -> None:
        try:
            with trajstore.Writer(s3_dump) as w:
                w.append(5, _batch(100 + i))
            results[i] = None
        except WriterError as e:
            results[i] = e

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [i for i, e in results.items() if e is None]
    lost = [e for e in results.values() if e is not None]
    assert len(results) == 2 and len(won) <= 1, results
    for e in lost:
        assert isinstance(e.__cause__, StepExistsError) or "another writer" in str(e), repr(e)
    if os.environ["TRAJSTORE_FS"] == "fsspec":
        assert len(won) == 1, results  # If-None-Match: * decides
    bucket, key = _bucket_key(s3_dump)
    steps = s3_server.keys(bucket, f"{key}/train/")
    if won:
        assert steps == [f"{key}/train/step_00000005.parquet"]
        assert_batch_equal(_batch(100 + won[0]), trajstore.Reader(s3_dump, verify=True)[5])
    else:  # both saw the other's claim and gave up (pyarrow only): nothing written, nothing overwritten
        assert steps == []
    # a later writer of the same step is refused at append, the committed bytes stay
    monkeypatch.setattr(remote, "commit", commit)
    if won:
        with trajstore.Writer(s3_dump) as w, pytest.raises(StepExistsError):
            w.append(5, _batch(7))
        assert_batch_equal(_batch(100 + won[0]), trajstore.Reader(s3_dump, verify=True)[5])


def test_listing_pages_through_several_pages_of_objects(s3_server, monkeypatch):
    """2,001 step objects (three pages of at most 1,000 keys, the last of one) are all listed, by both
    libraries (the 10,000-step listing's time is benchmarks/scale.py's)."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    bucket = s3_server.bucket()
    url = f"s3://{bucket}/run"
    with trajstore.Writer(url) as w:
        w.append(0, {"x": torch.arange(3)})
    c = s3_server.client()
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda s: c.put_object(Bucket=bucket, Key=f"run/train/step_{s:08d}.parquet", Body=b"x"),
                    range(1, 2_001)))
    for lib in ("pyarrow", "fsspec"):
        monkeypatch.setenv("TRAJSTORE_FS", lib)
        r = trajstore.Reader(url)
        assert r.steps == list(range(2_001)), lib
        assert torch.equal(r[0]["x"], torch.arange(3))


def test_recorder_dumps_and_replays_on_s3(s3_dump):
    with trajstore.Recorder(dump=True, path=s3_dump, max_keep=2) as rec:
        for s in range(4):
            rec.batch(s, lambda s=s: _batch(s))
    r = trajstore.Reader(s3_dump)
    assert r.steps == [2, 3]  # max_keep rotation deletes objects too
    with trajstore.Recorder(replay=True, path=s3_dump) as rec:
        got = rec.batch(3, lambda: pytest.fail("replay must not compute the batch"))
    assert_batch_equal(_batch(3), got)


def test_the_manifest_holds_no_credentials(s3_dump, s3_server, monkeypatch):
    secret = "s3cr3t-" + os.urandom(8).hex()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_SESSION_TOKEN", "tok-" + secret)
    with trajstore.Writer(s3_dump) as w:
        w.append(0, _batch(0))
    bucket, key = _bucket_key(s3_dump)
    c = s3_server.client()
    for k in s3_server.keys(bucket):
        body = c.get_object(Bucket=bucket, Key=k)["Body"].read()
        assert secret.encode() not in body, k
    manifest = json.loads(c.get_object(Bucket=bucket, Key=f"{key}/trajstore.json")["Body"].read())
    assert "AWS" not in json.dumps(manifest["environment"]["env"])


def test_a_bad_url_is_a_config_error_and_creates_nothing(s3_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    for url, why in [("s3://", "names no bucket"), ("s3:///run", "names no bucket"),
                     ("nosuchproto://x/y", "not a URL fsspec knows|nosuchproto"),
                     (f"s3://no-such-bucket-{os.getpid()}/run", "cannot create the dump.*bucket exists")]:
        with pytest.raises(ConfigError, match=why):
            trajstore.Writer(url)
    monkeypatch.setenv("TRAJSTORE_FS", "pyarrow")
    with pytest.raises(ConfigError, match="pyarrow has no memory:// file system"):
        trajstore.Reader("memory://x")
    monkeypatch.setenv("TRAJSTORE_FS", "neither")
    with pytest.raises(ConfigError, match="TRAJSTORE_FS='neither'"):
        trajstore.Reader("s3://b/x")
    monkeypatch.setenv("TRAJSTORE_FS", "fsspec")
    registry = sys.modules["fsspec.registry"]._registry  # the classes fsspec has loaded
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if s3fs were not installed
    for proto in ("s3", "s3a"):
        if proto in registry:
            monkeypatch.delitem(registry, proto)
    with pytest.raises(ConfigError, match="pip install s3fs"):
        trajstore.Writer("s3://b/run")
    assert os.listdir(tmp_path) == []


def test_any_fsspec_url_and_a_given_file_system(tmp_path):
    """The generic path: fsspec's in-memory file system (no conditional writes: the claim protocol),
    and a pyarrow LocalFileSystem passed as ``fs`` (the remote code path on a local folder)."""
    url = f"memory://trajstore-test-{os.getpid()}/run"
    with trajstore.Writer(url) as w:
        w.append(0, _batch(0))
    with trajstore.Writer(url) as w, pytest.raises(StepExistsError):
        w.append(0, _batch(1))
    assert_batch_equal(_batch(0), trajstore.Reader(url, verify=True)[0])
    assert trajstore.verify(url).ok
    with trajstore.Writer(str(tmp_path / "d"), fs=pafs.LocalFileSystem()) as w:
        w.append(3, _batch(3))
    assert (tmp_path / "d" / "train" / "step_00000003.parquet").is_file()
    assert_batch_equal(_batch(3), trajstore.Reader(tmp_path / "d", verify=True)[3])  # the local reader


def test_a_reader_sees_steps_committed_after_it_opened(s3_dump):
    """No listing cache between a Reader and the store (s3fs caches listings by default, and only a
    write through the same file system object clears it): the writer here has its own."""
    if os.environ["TRAJSTORE_FS"] == "fsspec":
        import s3fs

        other = s3fs.S3FileSystem(skip_instance_cache=True)
    else:
        other = pafs.FileSystem.from_uri(s3_dump)[0]  # its own, endpoint and credentials from the environment
    with trajstore.Writer(s3_dump, fs=other) as w:
        w.append(0, _batch(0))
        w.flush()
        r = trajstore.Reader(s3_dump)
        assert r.steps == [0]
        assert 1 not in r  # looked up (and listed) before step 1 exists
        w.append(1, _batch(1))
        w.flush()
        assert 1 not in r.steps and 1 in r
        assert r.refresh() == [0, 1]
        r.wait_for(1, timeout=10)
        assert_batch_equal(_batch(1), r[1])


def test_show_and_export_read_the_url_as_they_read_a_local_copy(s3_dump, tmp_path, capsys):
    """Every reading command gives on the URL what it gives on the same dump on a local disk."""
    pytest.importorskip("tokenizers")
    from _dumps import make_tokenizer, padded_dump

    tok = str(make_tokenizer(tmp_path))
    padded_dump(s3_dump, tok)
    padded_dump(tmp_path / "local", tok)
    for args in (["show", "{}", "--step", "1", "--sample", "0", "--tokenizer", tok, "--logprobs"],
                 ["show", "{}", "--step", "2", "--json"],
                 ["export", "{}", "--format", "jsonl", "--tokenizer", tok],
                 ["sql", "{}", "SELECT step, count(*) AS n FROM train GROUP BY step ORDER BY step", "--format", "csv"],
                 ["diff", "{}", str(tmp_path / "local")]):
        outs = []
        for where in (s3_dump, str(tmp_path / "local")):
            assert main([a.format(where) if a == "{}" else a for a in args]) == 0, args
            outs.append(capsys.readouterr().out.replace(where, "<dump>").replace(str(tmp_path / "local"), "<dump>"))
        assert outs[0] == outs[1] and outs[0].strip(), (args, outs)


def test_a_step_whose_checksum_put_failed_is_verified_by_its_pending_checksum(s3_dump, s3_server, monkeypatch):
    """Killed (here: failing) between the step's PUT and its checksum's: the step is visible, readers
    verify it by the pending checksum, and the next writer promotes that to step_N.sha256."""
    put = fs.Store.put

    def no_sum(self, key, data, create):
        if key.endswith("/step_00000001.sha256"):
            raise OSError("injected: the checksum PUT fails")
        put(self, key, data, create)

    with trajstore.Writer(s3_dump) as w:
        w.append(0, _batch(0))
        w.flush()
        monkeypatch.setattr(fs.Store, "put", no_sum)
        w.append(1, _batch(1))
    monkeypatch.setattr(fs.Store, "put", put)
    bucket, key = _bucket_key(s3_dump)
    side = f"{key}/_trajstore/train/"
    assert f"{side}step_00000001.sha256" not in s3_server.keys(bucket, side)
    assert len(s3_server.keys(bucket, f"{side}.pending/step_00000001.parquet/")) == 1
    assert_batch_equal(_batch(1), trajstore.Reader(s3_dump, verify=True)[1])
    assert trajstore.verify(s3_dump).ok
    trajstore.Writer(s3_dump).close()  # opening the split cleans up
    assert [k for k in s3_server.keys(bucket, f"{side}.pending/") if not k.endswith("/")] == []  # pyarrow: a marker
    assert f"{side}step_00000001.sha256" in s3_server.keys(bucket, side)
    assert_batch_equal(_batch(1), trajstore.Reader(s3_dump, verify=True)[1])


def test_shards_of_n_ranks_on_object_storage(s3_dump):
    """N ranks' shard files on object storage: a step is listed once all N are there, joined in rank
    order; a replaying rank's slice and one rank's shard as dumped (FORMAT 1.2, RELIABILITY "Object storage")."""
    parts = [_batch(10 + r, n) for r, n in enumerate((3, 1, 4))]
    writers = [trajstore.Writer(s3_dump, rank=r, world_size=3) for r in range(3)]
    for r in (0, 2):
        writers[r].append(0, parts[r])
        writers[r].flush()
    assert trajstore.Reader(s3_dump).steps == []  # rank 1's shard is missing: no half step
    writers[1].append(0, parts[1])
    for w in writers:
        w.close()
    whole = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    r = trajstore.Reader(s3_dump, verify=True)
    assert r.steps == [0]
    assert_batch_equal(whole, r[0])
    assert_batch_equal(parts[2], r.shard(0, 2))
    halves = [trajstore.Reader(s3_dump, rank=k, world_size=2)[0] for k in range(2)]
    assert_batch_equal(whole, {k: torch.cat([h[k] for h in halves]) for k in whole})
    assert [len(h["rewards"]) for h in halves] == [4, 4]
    assert trajstore.verify(s3_dump).ok
