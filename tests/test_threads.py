"""The thread budget of a Writer / Reader (README, Threads): from the cores this process may use shared
among the ranks of this host, never from OMP_NUM_THREADS; overridable; reported; and a step's row groups
decoded on Arrow's pool raised to that many threads while the read is in flight (Arrow sizes it from
OMP_NUM_THREADS; tests/test_arrow_pool.py tests the raise). And the decode-cost option of the writer,
``compression=`` (docs/FORMAT.md 3.5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from _dumps import many_row_groups, small_batch, write
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore.base import threads as _threads
from trajstore.format.file import parquet
from trajstore.store import stepfile
from trajstore.testing import assert_batch_equal, padded_batches


@pytest.fixture
def host(monkeypatch):
    """A host of 8 cores for this process, no budget variables set."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    for v in ("LOCAL_WORLD_SIZE", _threads.ENV):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return monkeypatch


def test_budget_is_the_cores_shared_among_the_local_ranks(host):
    assert _threads.budget() == 8  # OMP_NUM_THREADS=1 is not the budget
    host.setenv("LOCAL_WORLD_SIZE", "2")
    assert _threads.budget() == 4
    host.setenv("LOCAL_WORLD_SIZE", "16")
    assert _threads.budget() == 1  # never below one
    host.setenv("LOCAL_WORLD_SIZE", "four")
    assert _threads.budget() == 8  # not a count of ranks: one
    host.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    host.setenv("LOCAL_WORLD_SIZE", "1")
    assert _threads.budget() == _threads.MAX_DEFAULT


def test_threads_argument_and_variable_override_the_budget(host, tmp_path):
    host.setenv("LOCAL_WORLD_SIZE", "2")
    host.setenv(_threads.ENV, "3")
    assert _threads.budget() == 3 and _threads.budget(5) == 5
    r = write(tmp_path, {0: small_batch()}, threads=6)
    assert r.threads == 3 and trajstore.Reader(tmp_path, threads=2).threads == 2
    with trajstore.Writer(tmp_path / "b", threads=6, workers=1) as w:
        assert w.stats["threads"] == 6 and w.stats["workers"] == 1
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(trajstore.ConfigError, match=r"Reader\(.*threads=.*int >= 1"):
            trajstore.Reader(tmp_path, threads=bad)
    host.setenv(_threads.ENV, "many")
    with pytest.raises(trajstore.ConfigError, match=r"\$TRAJSTORE_THREADS='many'.*int >= 1"):
        trajstore.Writer(tmp_path / "c")
    assert trajstore.DumpReplayConfig.from_env(environ={"TRAJSTORE_THREADS": "3"}).threads == 3
    with pytest.raises(trajstore.ConfigError, match="DumpReplayConfig.threads"):
        trajstore.DumpReplayConfig(threads=0)


def test_recorder_passes_its_threads_to_the_writer_and_the_reader(tmp_path):
    cfg = {"path": str(tmp_path), "threads": 3}
    with trajstore.Recorder(trajstore.DumpReplayConfig(dump=True, **cfg)) as rec:
        rec.record(0, small_batch())
        assert rec._writer.stats["threads"] == 3
    with trajstore.Recorder(trajstore.DumpReplayConfig(replay=True, **cfg)) as rec:
        rec.load(0)
        assert rec._reader.threads == 3


@settings(max_examples=20)
@given(budget=st.integers(1, 5), cols=st.sampled_from([None, ["input_ids"], ["rewards", "input_ids"]]),
       cut=st.tuples(st.integers(0, 40), st.integers(0, 40)), small=st.booleans())
def test_reads_through_arrows_pool_are_the_file(tmp_path_factory, budget, cols, cut, small):
    """The table ``read_columns`` reads (a large read: Arrow's dataset reader on Arrow's pool; a small one:
    on the calling thread), of every row or of the rows ``rows=`` of the row groups holding them, is the
    one ``pyarrow.parquet.read_table`` reads (sliced), schema metadata included."""
    d = tmp_path_factory.mktemp("rg")
    rows = None if cut[0] == cut[1] else (min(cut), max(cut))
    with pytest.MonkeyPatch.context() as mp:
        many_row_groups(mp)
        mp.setattr(parquet, "ROW_GROUP_BYTES", 2048)
        mp.setattr(parquet, "PARALLEL_READ_BYTES", 1 << 30 if small else 0)
        g = torch.Generator().manual_seed(budget)
        b = {"input_ids": torch.randint(0, 9, (40, 30), generator=g), "rewards": torch.rand(40, generator=g)}
        r = write(d, {0: b}, threads=budget)
        sf = stepfile.open_step(r.file(0), 0)
        with _threads.using(budget):
            got = parquet.read_columns(sf.pf, sf.src, cols, rows)
        want = pq.read_table(r.file(0), columns=cols)
        want = want if rows is None else want.slice(rows[0], rows[1] - rows[0])
        assert pq.ParquetFile(r.file(0)).metadata.num_row_groups > 1
        assert got.equals(want) and got.schema.metadata == want.schema.metadata
        assert torch.equal(r[0]["input_ids"], b["input_ids"])


CHILD = r"""
import json, os, sys
import pyarrow as pa, torch
import trajstore, trajstore.base.arrow_pool
from trajstore.format import parquet
from _dumps import many_row_groups, small_batch
from pytest import MonkeyPatch

out = {"arrow_cpus": pa.cpu_count(), "cores": len(os.sched_getaffinity(0))}
d = sys.argv[1]
with trajstore.Writer(d + "/real") as w:
    out["real_writer"] = w.stats["threads"]
out["real_reader"] = trajstore.Reader(d + "/real").threads

mp = MonkeyPatch()
mp.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))  # this rank on a host of 8 cores
many_row_groups(mp)
mp.setattr(parquet, "ROW_GROUP_BYTES", 4096)
mp.setattr(trajstore.base.threads, "PARALLEL_BYTES", 0)
mp.setattr(trajstore.base.arrow_pool, "LINGER", 0)  # the pool given back as soon as the read ends
seen, real = [], parquet._scan
mp.setattr(parquet, "_scan", lambda *a: seen.append(pa.cpu_count()) or real(*a))  # Arrow's pool as it decodes
b = {"input_ids": torch.arange(64 * 200, dtype=torch.int32).reshape(64, 200), "rewards": torch.rand(64)}
with trajstore.Writer(d + "/fake") as w:
    w.append(0, b)
    out["writer"], out["workers"] = w.stats["threads"], w.stats["workers"]
r = trajstore.Reader(d + "/fake")
got = r[0]
out.update(reader=r.threads, exact=torch.equal(got["input_ids"], b["input_ids"]), seen=seen,
           after=pa.cpu_count())
print(json.dumps(out))
"""


def test_a_rank_under_torchrun_uses_its_budget_not_one_thread(tmp_path):
    """A child process with torchrun's variables (OMP_NUM_THREADS=1, two ranks on this host): its
    Writer and Reader report the documented budget (this machine's cores halved; then, with the
    affinity of an 8-core host, 4), and a step's row groups are decoded on Arrow's pool raised from the
    one thread it has to that budget, 4, and given back its one thread once the read is done."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1])])}
    env.pop(_threads.ENV, None)
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["arrow_cpus"] == 1  # what Arrow's pool would have used
    assert got["real_writer"] == got["real_reader"] == max(1, min(_threads.MAX_DEFAULT, got["cores"] // 2))
    assert (got["writer"], got["workers"], got["reader"]) == (4, 4, 4)
    assert got["seen"] == [4] and got["after"] == 1 and got["exact"]


@settings(max_examples=10)
@given(b=padded_batches(), c=st.sampled_from([("zstd", "ZSTD"), ("zstd:-3", "ZSTD"), ("zstd:9", "ZSTD"),
                                              ("lz4_raw", "LZ4")]))
def test_compression_option(tmp_path_factory, b, c):
    """``Writer(compression=)``: the codec of every column chunk; the step reads back exactly."""
    r = write(tmp_path_factory.mktemp("c"), {0: b}, compression=c[0])
    md = pq.ParquetFile(r.file(0)).metadata
    assert {md.row_group(0).column(j).compression for j in range(md.num_columns)} == {c[1]}
    assert_batch_equal(r[0], b)


def test_bad_compression_names_the_choices(tmp_path):
    for bad in ("gzip", "zstd:99", "zstd:x", None):
        with pytest.raises(trajstore.ConfigError, match="compression=.*zstd:<level>, lz4_raw"):
            trajstore.Writer(tmp_path / "bad", compression=bad)
