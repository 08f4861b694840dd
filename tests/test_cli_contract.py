"""What docs/CLI.md promises of every command: errors as one line on stderr (exit 2, no traceback unless
--debug), CTRL-C as exit 130 with one line, `export -o` never leaving a partial file under its name, a
split folder or step file understood as PATH, `--help` / info / sql / verify without torch, and
--tokenizer finding a model of the local Hugging Face cache, each command in its group's module of
trajstore/cli/. Subprocesses where the process matters (imports, tracebacks, signals); the rest through
``trajstore.cli.run``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _dumps import CONVERSATIONS, list_dump, make_tokenizer, padded_dump, run

from trajstore import cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("contract")
    tok = make_tokenizer(d)
    padded_dump(d / "a", tok, steps=(0, 1, 12))
    list_dump(d / "a", tok, steps=(0, 3), split="val")
    return d, tok


def python(code: str, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, the repository first on its path."""
    env = {**os.environ, "NO_COLOR": "1", **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=300)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# ----------------------------------------------------------------------------- start-up without torch
def test_help_info_sql_verify_do_not_import_torch(data):
    d, _ = data
    code = """
import json, sys
import trajstore.cli as c
for argv in json.loads(sys.argv[1]):
    try:
        rc = c.run(argv)
    except SystemExit as e:  # --help
        rc = e.code
    assert rc == 0, (argv, rc)
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""
    a = str(d / "a")
    argvs = [["--help"], ["info", "--help"], ["info", a], ["info", a, "--json", "--split", "val"],
             ["sql", a, "SELECT step, count(*) FROM train GROUP BY step"], ["verify", a], ["verify", a + "/train"]]
    p = python(code, json.dumps(argvs))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == []
    # the package root loads its names on first use, and they are all there
    p = python("import sys, trajstore; from trajstore import ConfigError, verify; "
               "print(set(trajstore.__all__) <= set(dir(trajstore)), verify.__module__, 'torch' in sys.modules)")
    assert p.stdout.split() == ["True", "trajstore.inspection.verify", "False"], p.stderr


# ----------------------------------------------------------------------------- one-line errors
def test_sql_errors_are_one_line_naming_the_dumps_views(data, capsys):
    d, _ = data
    p = run("sql", d / "a", "", check_rc=2)  # was an AttributeError traceback
    assert "query is empty" in one_line(p.stderr)
    a = str(d / "a")
    assert cli.run(["sql", a, "select * from trian"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "did you mean train?" in line and "views of dump" in line and "val" in line
    assert cli.run(["sql", a, "select * from nope_view"]) == 2
    assert "pg_" not in one_line(capsys.readouterr().err)  # DuckDB's own catalog is not suggested
    assert cli.run(["sql", a, "select rewrds from train"]) == 2
    assert '"rewards"' in one_line(capsys.readouterr().err)  # DuckDB's candidates are the dump's columns: kept
    assert cli.run(["sql", a, "-- a comment only"]) == 0 and capsys.readouterr().out == ""


def test_unexpected_errors_are_one_line_and_debug_shows_the_traceback(data, monkeypatch, capsys):
    from trajstore.inspection import describe

    def boom(*a, **k):
        raise RuntimeError("first line\nsecond line")

    monkeypatch.setattr(describe, "describe", boom)
    d, _ = data
    assert cli.run(["info", str(d / "a")]) == 2
    err = capsys.readouterr().err
    assert one_line(err) == "trajstore info: error: RuntimeError: first line; second line (run with --debug for the traceback)"
    assert cli.run(["info", str(d / "a"), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().endswith("trajstore info: error: RuntimeError: first line; second line")
    assert cli.run(["--debug", "info", str(d / "a")]) == 2 and "Traceback" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a usage error: argparse's two lines made one
        cli.run(["show", str(d / "a"), "--sample", "x"])
    assert e.value.code == 2
    assert one_line(capsys.readouterr().err) == ("trajstore show: error: argument --sample: invalid int value: 'x'; "
                                                 "see trajstore show --help")


# ----------------------------------------------------------------------------- CTRL-C
INTERRUPT_AT_IMPORT = """
import os, signal, sys

TARGET = sys.argv[1]

class Hook:  # a real SIGINT while module TARGET is being imported
    def find_spec(self, name, path=None, target=None):
        if name == TARGET:
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Hook())
from trajstore.cli import main
sys.argv = ["trajstore", "info", sys.argv[2]]
main()
"""


@pytest.mark.parametrize("module, line", [
    ("trajstore.errors", "trajstore: interrupted"),  # importing the command itself
    ("trajstore.inspection.describe", "trajstore info: interrupted"),  # loading what the command needs
])
def test_ctrl_c_during_start_up(data, module, line):
    d, _ = data
    p = python(INTERRUPT_AT_IMPORT, module, d / "a")
    assert p.returncode == 130 and one_line(p.stderr) == line and p.stdout == ""


INTERRUPT_EXPORT = """
import os, signal, sys
import trajstore.inspection.traces as T
from trajstore import cli

real, calls = T.traces, []

def traces(*a, **k):  # a real SIGINT as the second step is exported, the first already written
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGINT)
    return real(*a, **k)

T.traces = traces
sys.exit(cli.run(["export", sys.argv[1], "-o", sys.argv[2]]))
"""


def test_ctrl_c_during_export_leaves_no_partial_file(data, tmp_path, capsys):
    d, _ = data
    out = tmp_path / "t.jsonl"
    out.write_text("older\n")
    p = python(INTERRUPT_EXPORT, d / "a", out)
    assert p.returncode == 130 and one_line(p.stderr) == "trajstore export: interrupted"
    assert list(tmp_path.iterdir()) == [out] and out.read_text() == "older\n"  # no partial file, no temporary
    assert cli.run(["export", str(d / "a"), "-o", str(out)]) == 0  # complete: renamed into place
    assert len(out.read_text().splitlines()) == 9 and list(tmp_path.iterdir()) == [out]
    capsys.readouterr()
    assert cli.run(["export", str(d / "a"), "-o", str(tmp_path / "no" / "t.jsonl")]) == 2
    assert "check the folder exists" in one_line(capsys.readouterr().err)


# ----------------------------------------------------------------------------- PATH: a split folder or a step file
def test_split_folder_and_step_file_as_path(data, capsys):
    d, _ = data
    a, step12 = d / "a", d / "a" / "train" / "step_00000012.parquet"
    assert cli.run(["info", str(a / "val"), "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)["splits"]) == ["val"]
    assert cli.run(["show", str(step12), "--json"]) == 0  # --step from the file
    shown = json.loads(capsys.readouterr().out)
    assert (shown["step"], shown["index"]) == (12, 0)
    assert cli.run(["show", str(step12), "--step", "1", "--json"]) == 0  # an explicit --step wins
    assert json.loads(capsys.readouterr().out)["step"] == 1
    assert cli.run(["export", str(step12)]) == 0  # that step only
    assert {json.loads(x)["step"] for x in capsys.readouterr().out.splitlines()} == {12}
    assert cli.run(["verify", str(a / "train"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checked"] == {"train": 3}
    assert cli.run(["sql", str(a / "train"), "SELECT count(*) AS n FROM val", "--format", "csv"]) == 0
    assert capsys.readouterr().out.split() == ["n", "6"]
    assert cli.run(["diff", str(a / "val"), str(a / "val")]) == 0
    assert capsys.readouterr().out.rstrip().endswith("identical")
    assert cli.run(["show", str(step12), "--split", "val"]) == 2
    assert "is in split 'train'" in one_line(capsys.readouterr().err)
    assert cli.run(["show", str(a)]) == 2 and "--step" in one_line(capsys.readouterr().err)


# ----------------------------------------------------------------------------- tokenizer from the HF cache
def test_tokenizer_name_found_in_the_local_hugging_face_cache(data, tmp_path):
    d, tok = data
    model = tmp_path / "hub" / "models--Org--tiny-model"
    (model / "snapshots" / "0123abcd").mkdir(parents=True)
    (model / "refs").mkdir()
    (model / "refs" / "main").write_text("0123abcd")
    (model / "snapshots" / "0123abcd" / "tokenizer.json").write_bytes(Path(tok).read_bytes())
    code = ("import sys; from trajstore import cli; "
            "print(cli.run(['show', sys.argv[1], '--step', '1', '--tokenizer', 'Org/tiny-model']), "
            "cli.run(['show', sys.argv[1], '--step', '1', '--tokenizer', 'Org/other-model']))")
    p = python(code, d / "a", env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    assert CONVERSATIONS[0][0][1] in p.stdout and p.stdout.splitlines()[-1] == "0 2"
    assert "Hugging Face cache" in one_line(p.stderr)


# ----------------------------------------------------------------------------- one module per command group
def test_each_command_is_in_its_group_module_which_names_it():
    """``--help`` lists the commands in their order (the command modules' import order in ``cli.main``), and
    each command lives in a module of its group, not in ``cli.main``, whose docstring names it."""
    from trajstore.cli import registry

    assert [c[0] for c in registry.COMMANDS] == ["info", "show", "diff", "sql", "export", "view", "verify",
                                                 "upgrade", "import"]
    for name, _, _, fn in registry.COMMANDS:
        mod = sys.modules[fn.__module__]
        assert mod.__name__ != "trajstore.cli.main" and f"``trajstore {name}``" in mod.__doc__, (name, mod.__name__)
    assert len({fn.__module__ for *_, fn in registry.COMMANDS}) == 6
