"""A newcomer's first hour (issue 26): the demo's options, a file given as a dump, the read-only SQL,
an import that stops half way, `diff` of a damaged copy, `view`'s port and second dump, and the CLI's
messages (where a path is a file or a folder of dumps, "did you mean", the subcommand's usage)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _dumps import run, small_batch, write

import trajstore
from trajstore import cli
from trajstore.errors import ConfigError, WriterError

ROOT = Path(__file__).resolve().parents[1]


def py(*args, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout, **kw)


@pytest.fixture(scope="module")
def dump(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("newcomer") / "run"
    write(d, {s: small_batch(seed=s) for s in range(3)})
    return d


def cli_run(capsys, *argv) -> tuple[int, str, str]:
    try:
        rc = cli.run([str(a) for a in argv])
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    o = capsys.readouterr()
    return rc, o.out, o.err


# ----------------------------------------------------------------------------- defect 1: demo --help
def test_demo_help_and_bad_options_leave_the_dump_and_claim_nothing(dump, tmp_path):
    """`demo.py --help` (or a mistyped option, or --steps 0) ends before the dump is removed, and never
    prints a success line."""
    out = tmp_path / "demo"
    write(out, {0: small_batch()})
    for args, rc in ((["--help"], 0), (["--stepz", "2"], 2), (["--steps", "0"], 2)):
        p = py(ROOT / "examples" / "demo.py", *args, "--out", out)
        assert p.returncode == rc, p.stderr
        assert "bit-identical" not in p.stdout and trajstore.Reader(out).steps == [0], (args, p.stdout)
        if args == ["--help"]:
            assert "--out DIR" in p.stdout and "--steps" in p.stdout and "rl_loop.py" in p.stdout


# ----------------------------------------------------------------------------- defect 4: a file as a dump
def test_a_file_given_as_the_dump_is_named_as_a_file(tmp_path, capsys):
    f = tmp_path / "README.md"
    f.write_text("# notes\n")
    with pytest.raises(WriterError, match="is a file, not a dump") as e:
        trajstore.Writer(f)
    assert "permission" not in str(e.value) and "read-only" not in str(e.value)
    with pytest.raises(ConfigError, match="README.md is a file, not a dump"):
        trajstore.Recorder(trajstore.DumpReplayConfig(dump=True, path=str(f)))
    p = py(ROOT / "examples" / "rl_loop.py", "--dump", f, "--steps", "1")
    assert p.returncode == 1 and "Traceback" not in p.stderr and "is a file, not a dump" in p.stderr, p.stderr
    assert f.read_text() == "# notes\n"
    rc, _, err = cli_run(capsys, "info", f)
    assert rc == 2 and "is a file, not a dump" in err and "Errno" not in err, err


def test_info_of_a_folder_of_dumps_and_of_a_missing_step_file(dump, capsys):
    rc, _, err = cli_run(capsys, "info", dump.parent)
    assert rc == 2 and f"it is a folder of dumps: {dump}" in err, err
    rc, _, err = cli_run(capsys, "info", dump / "train" / "step_00000099.parquet")
    assert rc == 2 and "step 99" in err and "no trajstore dump" not in err and "0-2" in err, err


# ----------------------------------------------------------------------------- defect 5: sql reads only
def test_sql_neither_writes_nor_reads_outside_the_dump(dump, tmp_path, capsys):
    for q in (f"COPY (SELECT 1) TO '{tmp_path / 'x.csv'}'", f"COPY (SELECT 1) TO '{dump / 'x.csv'}'",
              "DROP VIEW train", "CREATE TABLE t AS SELECT 1", "SET enable_external_access = true",
              f"ATTACH '{tmp_path / 'x.db'}'", "SELECT 1; DROP VIEW train"):
        rc, out, err = cli_run(capsys, "sql", dump, q)
        assert rc == 2 and "queries only" in err and not out, (q, err)
    assert not (tmp_path / "x.csv").exists() and not (dump / "x.csv").exists() and not (tmp_path / "x.db").exists()
    outside = tmp_path / "outside.csv"
    outside.write_text("a\n1\n")
    rc, out, err = cli_run(capsys, "sql", dump, f"SELECT * FROM read_csv('{outside}')")
    assert rc == 2 and "Permission" in err and not out, err
    rc, out, _ = cli_run(capsys, "sql", dump, "SELECT count(*) AS n FROM train", "--format", "csv")
    assert rc == 0 and out.split() == ["n", "9"]
    rc, out, _ = cli_run(capsys, "sql", dump, f"SELECT count(*) AS n FROM read_parquet('{dump}/train/*.parquet')",
                         "--format", "csv")
    assert rc == 0 and out.split() == ["n", "9"]


# ----------------------------------------------------------------------------- defect 6: diff of a damaged copy
def test_diff_says_how_each_step_was_compared_and_a_damaged_copy_is_never_identical(dump, tmp_path, capsys):
    import json
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(dump, copy)
    rc, out, _ = cli_run(capsys, "diff", dump, copy)
    assert rc == 0 and "steps 0-2: the same bytes" in out and out.strip().endswith("identical"), out
    rc, out, _ = cli_run(capsys, "diff", dump, copy, "--deep")
    assert rc == 0 and "steps 0-2: compared value by value" in out, out
    f = copy / "train" / "step_00000001.parquet"
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 1  # one bit, the recorded checksum copied along unchanged
    f.write_bytes(bytes(b))
    for deep in ([], ["--deep"]):
        rc, out, _ = cli_run(capsys, "diff", dump, copy, *deep)
        assert rc == 1 and "step 1: a step file does not match its recorded SHA-256" in out, out
        assert "identical\n" not in out.splitlines()[-1] and "step 1" in out.splitlines()[-1], out
    rc, out, _ = cli_run(capsys, "diff", dump, copy, "--json")
    rep = json.loads(out)
    assert rc == 1 and not rep["identical"] and rep["compared"] == {"bytes": [0, 2], "damaged": [1]}
    rep = trajstore.diff(dump, copy)
    assert not rep.ok and rep.compared == {0: "bytes", 1: "damaged", 2: "bytes"}


# ----------------------------------------------------------------------------- defect 2: view's port and second dump
def test_view_refuses_a_bad_port_a_busy_port_and_a_missing_second_dump_before_it_says_it_serves(dump):
    import socket

    pytest.importorskip("uvicorn")
    p = py("-m", "trajstore.cli", "view", dump, "--port", "99999", timeout=60)
    assert p.returncode == 2 and not p.stdout, p.stdout
    assert "99999" in p.stderr and "1-65535" in p.stderr and "trajstore view --help" in p.stderr, p.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = py("-m", "trajstore.cli", "view", dump, "--port", port, timeout=60)  # it never serves: it ends
    assert p.returncode == 2 and not p.stdout, p.stdout
    assert p.stderr.startswith(f"trajstore view: error: cannot listen on 127.0.0.1:{port}") and "--port" in p.stderr
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    p = py("-m", "trajstore.cli", "view", dump, dump.parent / "nosuch", "--port", port, timeout=60)
    assert p.returncode == 2 and not p.stdout and "nosuch" in p.stderr, p.stderr


# ----------------------------------------------------------------------------- defect 3: an import that stops
def test_an_import_that_stops_says_what_it_wrote_and_the_same_command_goes_on(tmp_path, capsys):
    import datetime

    import torch

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    for i in range(5):
        torch.save({"input_ids": torch.arange(6).reshape(2, 3) + i, "rewards": torch.ones(2) * i}, src / f"step_{i}.pt")
    torch.save({"input_ids": torch.zeros(2, 3), "when": datetime.date(2020, 1, 1)}, src / "step_3.pt")  # needs trust
    rc, out, err = cli_run(capsys, "import", src, dst)
    assert rc == 2 and "--trust-pickle" in err and "split train: steps 0-2" in err, err
    assert "run the same command again" in err and trajstore.Reader(dst).steps == [0, 1, 2]
    before = {p.name: p.stat().st_mtime_ns for p in (dst / "train").iterdir()}
    torch.save({"input_ids": torch.arange(6).reshape(2, 3) + 3, "rewards": torch.ones(2) * 3}, src / "step_3.pt")
    rc, out, err = cli_run(capsys, "import", src, dst)
    assert rc == 0 and "imported 5 step(s)" in out and "3 of them by an earlier run" in out, out + err
    r = trajstore.Reader(dst)
    assert r.steps == [0, 1, 2, 3, 4] and [float(r[s]["rewards"][0]) for s in r.steps] == [0, 1, 2, 3, 4]
    assert all((dst / "train" / n).stat().st_mtime_ns == t for n, t in before.items())  # kept, not rewritten
    other = tmp_path / "other"
    other.mkdir()
    torch.save({"input_ids": torch.ones(2, 3)}, other / "rollout_data_1.pt")
    rc, out, err = cli_run(capsys, "import", other, dst)
    assert rc == 2 and "already in" in out and "--overwrite" in out and "overwrite=True to" not in err, out + err
    assert float(trajstore.Reader(dst)[1]["rewards"][0]) == 1


# ----------------------------------------------------------------------------- messages
def test_messages_a_newcomer_meets(dump, tmp_path, capsys):
    rc, _, err = cli_run(capsys, "inof", dump)
    assert rc == 2 and "did you mean info" in err, err
    rc, _, err = cli_run(capsys, "info", dump, "--bogus")
    assert rc == 2 and err.startswith("trajstore info: error: unrecognized arguments: --bogus") and \
        "see trajstore info --help" in err, err
    rc, _, err = cli_run(capsys, "diff", dump)
    assert rc == 2 and "--pair FIELD_A FIELD_B" in err and "pair=(" not in err, err
    rc, _, err = cli_run(capsys, "diff", dump, "--pair", "logprobs", "logprobs", "--mask", "atention_mask")
    assert rc == 2 and "did you mean attention_mask?" in err and "input_ids" in err, err
    pytest.importorskip("starlette")
    rc, _, err = cli_run(capsys, "view", dump, "--export", tmp_path / "nosuch" / "x.html")
    assert rc == 2 and "--export" in err and "FileNotFoundError" not in err, err


def test_float32_values_print_at_float32_precision(tmp_path, capsys):
    import json

    import torch

    b = {"input_ids": torch.tensor([[5, 6]]), "rewards": torch.tensor([0.2], dtype=torch.float32),
         "score": torch.tensor([0.1], dtype=torch.float64)}
    write(tmp_path / "d", {0: b}, meta={"lr": __import__("numpy").float32(0.3)})
    rc, out, _ = cli_run(capsys, "show", tmp_path / "d", "--step", "0")
    assert rc == 0 and "reward 0.2 " in out and "0.2000000" not in out and '"lr":0.3' in out, out
    rc, out, _ = cli_run(capsys, "show", tmp_path / "d", "--step", "0", "--json")
    t = json.loads(out)
    assert t["reward"] == 0.2 and t["fields"]["score"] == 0.1 and t["meta"] == {"lr": 0.3}, t
    rc, out, _ = cli_run(capsys, "sql", tmp_path / "d", "SELECT rewards, score FROM train", "--format", "json")
    assert json.loads(out) == {"rewards": 0.2, "score": 0.1}, out


def test_config_warning_lists_only_the_variables_a_user_sets():
    from trajstore.record.config import TEST_VARIABLES
    from trajstore.errors import ConfigWarning

    with pytest.warns(ConfigWarning) as rec:
        trajstore.DumpReplayConfig.from_env(environ={"TRAJSTORE_DUMPP": "1", "TRAJSTORE_EXAMPLES": "5"})
    assert len(rec) == 1 and "did you mean TRAJSTORE_DUMP?" in str(rec[0].message)
    assert "TRAJSTORE_PATH" in str(rec[0].message) and not any(v in str(rec[0].message) for v in TEST_VARIABLES)


def test_ray_stats_takes_the_response_mask_by_default(dump, tmp_path):
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("ray_stats_example", ROOT / "examples" / "ray_stats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    b = small_batch()
    write(tmp_path / "r", {0: {**b, "response_mask": b["attention_mask"] & (torch.arange(5) >= 2)}})
    assert mod.default_mask(str(tmp_path / "r")) == "response_mask" and mod.default_mask(str(dump)) is None


def test_a_wide_table_on_a_narrow_terminal_keeps_every_column(monkeypatch):
    import io

    from trajstore.cli import console as out

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    pytest.importorskip("rich")
    monkeypatch.setenv("COLUMNS", "100")
    heads = ["field", "status", "steps", "values", "beyond tol", "max abs", "max rel", "mean abs", "rmse",
             "p50 abs", "p90 abs", "p99 abs", "corr"]
    s = Tty()
    out.table(heads, [["logprobs vs old_logprobs", "close", 20, 7531, 0, 0.0154743, 0.00388366, 0.00234484,
                       0.0033262, 0.00158203, 0.0058856, 0.0110562, 0.999996]], title="a vs b", stream=s)
    text = s.getvalue()
    assert all(h in text for h in heads) and "0.999996" in text and "0.0110562" in text, text
    assert max(len(line) for line in text.splitlines()) <= 100 + 20  # escape codes aside
