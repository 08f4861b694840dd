"""The CLI and ``diff`` read step ranges with the one parser (``trajstore.base.text``) and print byte
sizes with the one formatter; a bad range is a usage error naming the option."""

import json

import pytest
import torch
from _dumps import write

import trajstore
from trajstore import ConfigError
from trajstore.base.text import human_bytes
from trajstore.cli import run


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    d = tmp_path_factory.mktemp("steps") / "d"
    write(d, {s: {"x": torch.full((2,), float(s)), "uid": [f"{s}a", f"{s}b"]} for s in (0, 1, 2, 5)})
    return d


def _steps(report) -> list[int]:
    return sorted({e.step for e in report.entries})


def test_diff_reads_ranges_like_lists(dump):
    assert _steps(trajstore.diff(dump, dump, steps="0-1, 5")) == [0, 1, 5]
    assert _steps(trajstore.diff(dump, dump, steps=[5, 1, 0, 1])) == [0, 1, 5]
    assert _steps(trajstore.diff(dump, dump, steps="all")) == [0, 1, 2, 5]
    with pytest.raises(ConfigError, match="steps: cannot read 'x'"):
        trajstore.diff(dump, dump, steps="0,x")


@pytest.mark.parametrize("cmd", ["diff", "export"])
def test_bad_steps_option_is_a_usage_error(dump, cmd, capsys):
    argv = [cmd, str(dump)] + ([str(dump)] if cmd == "diff" else []) + ["--steps", "1-b"]
    assert run(argv) == 2
    assert "--steps: cannot read '1-b' in '1-b'" in capsys.readouterr().err


def test_export_steps_and_info_bytes(dump, capsys):
    assert run(["export", str(dump), "--steps", "1:2,9"]) == 0
    assert [json.loads(line)["step"] for line in capsys.readouterr().out.splitlines()] == [1, 1, 2, 2]
    assert run(["info", str(dump)]) == 0
    size = sum(f.stat().st_size for f in (dump / "train").glob("*.parquet"))
    assert f"bytes {human_bytes(size)}" in capsys.readouterr().out
