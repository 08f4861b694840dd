"""Rank dumps (one split per rank, ``train-rank0``...) in the CLI and SQL: the default split, the
message when a command cannot choose one, SQL views that need no quotes and one logical view
joining the rank splits with their ``rank``."""

import json
import tempfile
from pathlib import Path

import pytest
import torch
from _dumps import run as run_script
from _dumps import write
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore import cli
from trajstore.record.config import DumpReplayConfig, location
from trajstore.errors import ConfigError, DumpNotFoundError

duckdb = pytest.importorskip("duckdb")


def _batch(n: int, value: float) -> dict:
    return {"input_ids": torch.arange(n * 3).reshape(n, 3), "attention_mask": torch.ones(n, 3, dtype=torch.bool),
            "rewards": torch.full((n,), value, dtype=torch.float64)}


def _ranks(path, rows=(2, 3), steps=(0, 1), name="train"):
    """A dump of ``len(rows)`` ranks as trajstore before 0.2 made it (one split per rank), rank k writing
    ``rows[k]`` rows per step, rewards 100 k + step."""
    path = Path(path)
    for k, n in enumerate(rows):
        split = f"{name}-rank{k}"
        if k == 0:
            (path / split).mkdir(parents=True)  # replayed, each rank still reads its own split
            cfg = DumpReplayConfig(replay=True, path=str(path), split=name)
            assert location(cfg, len(rows), k)[1] == split and location(cfg, 1, 0)[1] == name
        write(path, {s: _batch(n, 100.0 * k + s) for s in steps}, split=split)
    return path


def cli_run(capsys, *argv):
    rc = cli.run([str(a) for a in argv])
    o = capsys.readouterr()
    return rc, o.out, o.err


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _ranks(tmp_path_factory.mktemp("ranks") / "d")


def test_one_split_commands_name_the_rank_splits(ranks, capsys):
    for argv in (["show", ranks, "--step", 0], ["export", ranks], ["diff", ranks, ranks]):
        rc, out, err = cli_run(capsys, *argv)
        assert rc == 2 and out == ""
        assert "train-rank0, train-rank1" in err and "no split 'train'" in err, err
        assert "--split train-rank0" in err and "cannot pick a rank by itself" in err, err
    with pytest.raises(ConfigError, match="split='train-rank0'"):
        trajstore.Reader(ranks)
    p = run_script("show", ranks, "--step", 1, check_rc=2)  # the installed script: one line on stderr
    assert p.stderr.startswith("trajstore show: error: dump ") and len(p.stderr.splitlines()) == 1


def test_commands_with_a_rank_split_named(ranks, capsys):
    rc, out, _ = cli_run(capsys, "show", ranks, "--step", 1, "--sample", 2, "--split", "train-rank1", "--json")
    assert rc == 0 and json.loads(out)["index"] == 2
    rc, out, _ = cli_run(capsys, "export", ranks, "--split", "train-rank1")
    assert rc == 0 and len(out.splitlines()) == 6
    rc, out, _ = cli_run(capsys, "info", ranks, "--json")  # info reads every split without --split
    info = json.loads(out)
    assert rc == 0 and set(info["splits"]) == {"train-rank0", "train-rank1"}
    assert [info["splits"][s]["rows"] for s in ("train-rank0", "train-rank1")] == [4, 6]
    rc, out, _ = cli_run(capsys, "diff", ranks, ranks, "--split", "train-rank0", "--json")
    assert rc == 0 and json.loads(out)["identical"]


def test_sql_views_need_no_quotes_and_train_joins_the_ranks(ranks, capsys):
    con = trajstore.read.tables.duckdb_connect(ranks)
    assert con.execute("SELECT count(*) FROM train_rank0").fetchone()[0] == 4
    assert con.execute('SELECT count(*) FROM "train-rank1"').fetchone()[0] == 6  # the exact name stays
    got = con.execute("SELECT rank, step, count(*), min(rewards), max(rewards) FROM train "
                      "GROUP BY rank, step ORDER BY rank, step").fetchall()
    assert got == [(0, 0, 2, 0.0, 0.0), (0, 1, 2, 1.0, 1.0), (1, 0, 3, 100.0, 100.0), (1, 1, 3, 101.0, 101.0)]
    assert con.execute("SELECT typeof(rank) FROM train LIMIT 1").fetchone()[0] == "INTEGER"
    rc, out, _ = cli_run(capsys, "sql", ranks, "SELECT rank, count(*) AS n FROM train GROUP BY rank ORDER BY rank",
                         "--format", "csv")
    assert rc == 0 and out.splitlines() == ["rank,n", "0,4", "1,6"]


@settings(max_examples=8, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=2, max_size=4), st.sampled_from(["train", "eval.long", "1st"]))
def test_logical_view_rows(rows, name):
    with tempfile.TemporaryDirectory() as d:
        _ranks(d, rows=rows, steps=(3,), name=name)
        con = trajstore.read.tables.duckdb_connect(d)
        view = {"train": "train", "eval.long": "eval_long", "1st": "_1st"}[name]
        got = con.execute(f"SELECT rank, count(*), min(rewards) FROM {view} GROUP BY rank ORDER BY rank").fetchall()
        assert got == [(k, n, 100.0 * k + 3) for k, n in enumerate(rows)]
        assert con.execute(f"SELECT count(*) FROM {view}_rank0").fetchone()[0] == rows[0]


def test_only_val_defaults_to_val(tmp_path, capsys):
    write(tmp_path, {0: _batch(2, 1.5), 4: _batch(1, 2.5)}, split="val")
    assert trajstore.Reader(tmp_path).split == "val"
    rc, out, _ = cli_run(capsys, "show", tmp_path, "--step", 4, "--json")
    assert rc == 0 and json.loads(out)["step"] == 4
    rc, out, _ = cli_run(capsys, "export", tmp_path)
    assert rc == 0 and [json.loads(x)["step"] for x in out.splitlines()] == [0, 0, 4]
    rc, _, err = cli_run(capsys, "export", tmp_path, "--steps", "7")
    assert rc == 2 and "split 'val'" in err


def test_train_wins_and_several_plain_splits(tmp_path, capsys):
    _ranks(tmp_path)
    write(tmp_path, {0: _batch(1, 7.0)}, split="train")
    assert trajstore.Reader(tmp_path).split == "train"
    con = trajstore.read.tables.duckdb_connect(tmp_path)  # a plain split named train keeps its view
    assert con.execute("SELECT count(*), min(rewards) FROM train").fetchone() == (1, 7.0)
    rc, out, _ = cli_run(capsys, "export", tmp_path)
    assert rc == 0 and len(out.splitlines()) == 1
    other = tmp_path / "other"
    write(other, {0: _batch(1, 1.0)}, split="val")
    write(other, {0: _batch(1, 1.0)}, split="eval")
    rc, _, err = cli_run(capsys, "show", other, "--step", 0)
    assert rc == 2 and "2 splits: eval, val" in err and "rank" not in err


def test_a_folder_that_is_no_dump(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(DumpNotFoundError, match="no trajstore dump"):
        trajstore.Reader(tmp_path)
    rc, _, err = cli_run(capsys, "show", tmp_path, "--step", 0)
    assert rc == 2 and "no trajstore dump" in err


def test_view_names_clash_keyword_and_stored_rank(tmp_path):
    for split in ("a-b", "a_b", "a.b", "order", "x-rank0", "x-rank1"):
        extra = {"rank": torch.tensor([5])} if split == "x-rank1" else {}
        write(tmp_path, {0: {**_batch(1, float(len(split))), **extra}}, split=split)
    con = trajstore.read.tables.duckdb_connect(tmp_path)
    views = {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
    assert views == {"a-b", "a_b", "a.b", "order", "x-rank0", "x-rank1",  # the exact names
                     "a_b_2", "a_b_3", "order_", "x_rank0", "x_rank1"}  # a field named rank: no logical x
    assert con.execute("SELECT step FROM a_b_2").fetchall() == con.execute('SELECT step FROM "a-b"').fetchall()
    assert con.execute("SELECT count(*) FROM order_").fetchone()[0] == 1
    assert con.execute("SELECT rank FROM x_rank1").fetchone()[0] == 5
