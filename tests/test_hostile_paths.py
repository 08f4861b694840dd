"""Paths taken literally, SQL views of exactly the Reader's steps, and a bound on shard names (issue 27,
items 1-3; docs/RELIABILITY.md, threat model).

1. A dump path with glob or URI characters (``[ ] * ?``, ``#``) names that dump alone: s3fs deleted the
   steps of ``s3://b/exp1`` for ``max_keep`` of ``s3://b/exp[1]``, pyarrow's S3 wrote ``s3://b/exp#lr1/run``
   into ``s3://b/exp/``, and DuckDB summed ``runs/run1`` into ``runs/run[1]``'s view. S3 cases run against
   the local moto server with both clients (the ``s3_dump`` fixture).
2. A planted copy of a step under another number, or a step number of 2**63 or more, is not in the SQL
   views (the Reader refuses both), and not counted twice.
3. An empty file named ``...rank00000-of-1000000000000.parquet`` is refused by a bound, in a child process
   under ``RLIMIT_AS`` (it made every tool build ``set(range(10**12))``), and 2000 empty shard names of
   99999 ranks list 16 missing ranks each (they made 2000 lists of 99998)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import trajstore
from trajstore.cli import main
from trajstore.errors import ConfigError, TrajstoreWarning
from trajstore.store import paths
from trajstore.testing import assert_batch_equal

from _dumps import write


def _batch(v: float, n: int = 4) -> dict:
    return {"input_ids": torch.arange(n * 3).reshape(n, 3), "rewards": torch.full((n,), v)}


def _sum(dump: str | Path) -> tuple:
    return trajstore.Reader(dump).duckdb().execute("SELECT sum(rewards), count(*) FROM train").fetchone()


# -- 1. paths taken literally ---------------------------------------------------------------------------

def test_s3_glob_characters_delete_only_their_own_run(s3_dump, s3_server):
    base = s3_dump.rsplit("/", 1)[0]
    other = write(f"{base}/exp1", {s: _batch(10.0) for s in range(3)})
    assert other.steps == [0, 1, 2]
    with trajstore.Recorder(dump=True, path=f"{base}/exp[1]", max_keep=2) as rec:
        for s in range(4):
            rec.record(s, _batch(1.0))
    assert trajstore.Reader(f"{base}/exp1").steps == [0, 1, 2]  # s3fs's rm globbed exp[1] to exp1
    assert trajstore.Reader(f"{base}/exp[1]").steps == [2, 3]
    bucket = base[len("s3://"):]
    keys = [k for k in s3_server.keys(bucket) if k.endswith(".parquet")]  # pyarrow leaves folder markers
    assert [k for k in keys if k.startswith("exp1/train/")] == [f"exp1/train/{paths.step_name(s)}" for s in range(3)]
    assert [k for k in keys if k.startswith("exp[1]/train/")] == [f"exp[1]/train/{paths.step_name(s)}" for s in (2, 3)]
    assert _sum(f"{base}/exp[1]") == (8.0, 8) and _sum(f"{base}/exp1") == (120.0, 12)


def test_s3_hash_in_a_path_is_part_of_the_key(s3_dump, s3_server):
    base = s3_dump.rsplit("/", 1)[0]
    for i, name in enumerate(("exp#lr1/run", "exp#lr2/run")):
        write(f"{base}/{name}", {0: _batch(float(i))})  # pyarrow: both into exp/, the second StepExistsError
    for i, name in enumerate(("exp#lr1/run", "exp#lr2/run")):
        assert_batch_equal(trajstore.Reader(f"{base}/{name}")[0], _batch(float(i)))
    keys = s3_server.keys(base[len("s3://"):])
    assert not [k for k in keys if k.startswith("exp/")], keys
    assert {k.split("/run/")[0] for k in keys} == {"exp#lr1", "exp#lr2"}


def test_s3_hash_without_s3fs_falls_back_to_pyarrow_literally(s3_server, monkeypatch):
    """TRAJSTORE_FS=auto where s3fs is not installed: pyarrow's S3, the key still taken literally."""
    from trajstore.store import fs

    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TRAJSTORE_FS", raising=False)
    monkeypatch.setattr(fs, "_has", lambda pkg: False)
    b = s3_server.bucket()
    p = fs.resolve(f"s3://{b}/exp#lr1/run [a]%20", "test")
    assert p.store.library == "pyarrow" and p.key == f"{b}/exp#lr1/run [a]%20"
    write(f"s3://{b}/exp#lr1/run", {0: _batch(1.0)})
    assert [k for k in s3_server.keys(b) if k.endswith(".parquet")] == ["exp#lr1/run/train/step_00000000.parquet"]


def test_s3_question_mark_is_refused_naming_it(s3_dump):
    with pytest.raises(ConfigError, match="'\\?'"):
        trajstore.Writer(s3_dump + "?versionId=1")
    assert main(["info", s3_dump.replace("/run", "/a?b")]) == 2


@pytest.mark.parametrize("name, sibling", [("run[1]", "run1"), ("c[!x]d", "cyd"), ("run?", "runs"),
                                           ("r*", "rr"), ("lr=0.1", "lr=0.2")])
def test_local_sql_reads_only_the_named_dump(tmp_path, capsys, name, sibling):
    write(tmp_path / sibling, {s: _batch(10.0) for s in range(2)})
    r = write(tmp_path / name, {s: _batch(1.0) for s in range(2)})
    assert _sum(tmp_path / name) == (8.0, 8)  # DuckDB globbed run[1] to run1, c[!x]d to cyd...
    assert _sum(tmp_path / sibling) == (80.0, 8)
    cols = [d[0] for d in r.duckdb().execute("SELECT * FROM train").description]
    assert "lr" not in cols  # no hive partition column read from the folder's name
    assert main(["sql", str(tmp_path / name), "SELECT sum(rewards) AS s FROM train", "--format", "csv"]) == 0
    assert capsys.readouterr().out.split() == ["s", "8.0"]
    one = trajstore.Reader(tmp_path / name / "train" / paths.step_name(1))  # a Reader of one step file
    assert one.duckdb().execute("SELECT count(*) FROM train").fetchone() == (4,)


# -- 2. the SQL views hold the Reader's steps ---------------------------------------------------------

def _planted(tmp_path: Path) -> Path:
    d = tmp_path / "d"
    write(d, {s: _batch(float(s + 1)) for s in range(2)})
    t = d / "train"
    shutil.copy(t / paths.step_name(0), t / "step_00000011.parquet")  # no checksum, its footer says step 0
    shutil.copy(t / paths.step_name(0), t / f"step_{2**64:08d}.parquet")
    shutil.copy(t / paths.step_name(0), t / f"step_{2**63:08d}.rank00000-of-00001.parquet")
    return d


def test_sql_views_leave_out_what_the_reader_refuses(tmp_path, capsys):
    d = _planted(tmp_path)
    r = trajstore.Reader(d)
    assert r.steps == [0, 1, 11]  # 2**63 and above are no step numbers
    with pytest.raises(trajstore.FormatError, match="holds step 0, its name says 11"):
        r[11]
    with pytest.warns(TrajstoreWarning, match="step_00000011.parquet.*left out of the SQL views"):
        got = r.duckdb().execute("SELECT step, count(*), sum(rewards) FROM train GROUP BY step ORDER BY step")
        assert got.fetchall() == [(0, 4, 4.0), (1, 4, 8.0)]  # step 0 was counted twice
    with pytest.warns(TrajstoreWarning, match="left out"):
        assert main(["sql", str(d), "SELECT count(*) AS n FROM train", "--format", "csv"]) == 0
    assert capsys.readouterr().out.split() == ["n", "8"]
    rep = trajstore.verify(d)
    assert sorted(k for _, k in rep.damaged) == [11, 2**63, 2**64], rep.summary()
    assert "2**63 or more" in rep.damaged[("train", 2**64)]


def test_the_cli_shows_a_trajstore_warning_as_one_line():
    import warnings

    from trajstore.cli.support import warnings_as_lines

    with warnings_as_lines("sql"):
        assert warnings.formatwarning("f: no\nstep", TrajstoreWarning, "x.py", 1) == "trajstore sql: warning: f: no; step\n"
        assert "UserWarning" in warnings.formatwarning("other", UserWarning, "x.py", 1)
    assert "TrajstoreWarning" in warnings.formatwarning("f", TrajstoreWarning, "x.py", 1)  # restored


def test_s3_sql_views_leave_out_a_planted_step(s3_dump, s3_server):
    write(s3_dump, {s: _batch(float(s + 1)) for s in range(2)})
    bucket, key = s3_dump[len("s3://"):].split("/", 1)
    c = s3_server.client()
    for name in ("step_00000011.parquet", f"step_{2**64:08d}.parquet"):
        c.copy_object(Bucket=bucket, Key=f"{key}/train/{name}",
                      CopySource={"Bucket": bucket, "Key": f"{key}/train/{paths.step_name(0)}"})
    with pytest.warns(TrajstoreWarning, match="left out of the SQL views"):
        assert _sum(s3_dump) == (12.0, 8)
    assert trajstore.Reader(s3_dump).steps == [0, 1, 11]


# -- 3. a bound on shard names ------------------------------------------------------------------------

CAP = 3 << 30  # the child's address space: set(range(10**12)) runs out of it at once

_CHILD = textwrap.dedent("""
    import json, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
    import torch, trajstore
    from trajstore.cli import main
    dump, out = sys.argv[1], {{}}

    def cell(name, fn):
        try:
            out[name] = ["ok", fn()]
        except trajstore.TrajstoreError as e:
            out[name] = [type(e).__name__, str(e)[:300]]
        except BaseException as e:  # MemoryError: what must not happen
            out[name] = ["raw " + type(e).__name__, str(e)[:300]]

    cell("steps", lambda: trajstore.Reader(dump).steps)
    def incomplete():
        from trajstore.store.listing import ranks_text
        inc = trajstore.Reader(dump)._listing.incomplete
        return [len(inc), ranks_text(inc[100][1])]
    cell("incomplete", incomplete)
    cell("read", lambda: trajstore.Reader(dump)[0]["rewards"].tolist())
    cell("read5", lambda: trajstore.Reader(dump)[5])
    for cmd in ("info", "verify", "show", "sql"):
        args = {{"show": [dump, "--step", "0"], "sql": [dump, "SELECT count(*) FROM train"]}}.get(cmd, [dump])
        cell(cmd, lambda: main([cmd, *args]))
    def append():
        with trajstore.Writer(dump) as w:
            w.append(7, {{"rewards": torch.ones(2)}})
        return trajstore.Reader(dump).steps
    cell("writer", append)
    def replay():
        with trajstore.Recorder(replay=True, path=dump) as rec:
            return rec.load(0)["rewards"].tolist()
    cell("replay", replay)
    print(json.dumps(out), flush=True)
""")


def test_absurd_rank_count_is_refused_by_a_bound(tmp_path):
    d = tmp_path / "d"
    write(d, {0: {"rewards": torch.zeros(3)}})
    (d / "train" / "step_00000005.rank00000-of-1000000000000.parquet").touch()
    for s in range(100, 2100):  # 2000 incomplete steps of 99999 ranks: no list of their 99998 missing ranks each
        (d / "train" / f"step_{s:08d}.rank00000-of-99999.parquet").touch()
    p = subprocess.run([sys.executable, "-c", _CHILD.format(cap=CAP), str(d)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.splitlines()[-1])
    assert not [k for k, (kind, _) in got.items() if kind.startswith("raw")], got
    assert got["steps"] == ["ok", [0, 5]] and got["read"] == ["ok", [0.0, 0.0, 0.0]]
    assert got["read5"][0] == "FormatError" and "ambiguous" in got["read5"][1]
    assert got["info"] == ["ok", 0] and got["show"] == ["ok", 0] and got["sql"] == ["ok", 0]
    assert got["verify"] == ["ok", 1]  # step 5 reported, not expanded
    assert got["incomplete"] == ["ok", [2000, "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, ... (99998 in all)"]]
    assert got["writer"] == ["ok", [0, 5, 7]] and got["replay"] == ["ok", [0.0, 0.0, 0.0]]


def test_sql_views_do_not_apply_the_decode_budget(tmp_path, monkeypatch):
    """DuckDB reads the columns itself, within its own memory_limit: a step over the Reader's decode budget
    is in the views (only a footer the Reader refuses leaves a step out)."""
    from trajstore.format import limits

    write(tmp_path / "d", {s: {"tokens": torch.zeros(4, 50_000, dtype=torch.int64), "rewards": torch.ones(4)}
                           for s in range(2)})  # 1.6 MB decoded per step
    monkeypatch.setattr(limits, "MAX_DECODED_BYTES", 1 << 20)
    with pytest.raises(trajstore.FormatError, match="over the limit"):
        trajstore.Reader(tmp_path / "d")[0]
    assert _sum(tmp_path / "d") == (8.0, 8)
