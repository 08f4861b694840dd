"""A URL is never taken for a local path (issue 14): ``Writer("s3://bucket/run")`` used to create a
local folder named ``s3:`` and fail at exit. Object-storage URLs are dumps now (tests/test_s3.py);
a URL that names no bucket, an unknown protocol, or a command that works on local dumps only is a
ConfigError at once that says what to do, and creates nothing; ``file://`` URLs name local paths."""

import os

import pytest
import torch

import trajstore
from trajstore.cli import main
from trajstore.errors import ConfigError

BAD = ["s3://", "s3:///run1", "gs://", "S3:///run", "nosuchprotocol://host/x"]


@pytest.mark.parametrize("url", BAD)
def test_writer_reader_recorder_and_tools_refuse_a_bad_url_and_create_nothing(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    for make in (lambda: trajstore.Writer(url), lambda: trajstore.Reader(url),
                 lambda: trajstore.verify(url),
                 lambda: trajstore.Recorder(dump=True, path=url)):
        with pytest.raises(ConfigError, match=r"names no bucket|not a URL fsspec knows"):
            make()
    assert os.listdir(tmp_path) == []  # no folder named "s3:" (or anything else)
    assert isinstance(ConfigError("x"), ValueError)


@pytest.mark.parametrize("cmd", [["info"], ["verify"], ["sql", "--format", "csv"]])
def test_cli_says_why_a_url_cannot_be_read(tmp_path, monkeypatch, capsys, cmd):
    monkeypatch.chdir(tmp_path)
    args = cmd[:1] + ["s3:///run1"] + (["SELECT 1"] if cmd[0] == "sql" else []) + cmd[1:]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "names no bucket" in err and "s3://<bucket>/" in err, err
    assert os.listdir(tmp_path) == []


def test_local_only_commands_refuse_a_url(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["upgrade", "s3://bucket/run1"]) == 2
    err = capsys.readouterr().err
    assert "s3:// URL" in err and "local" in err and "mount" in err, err
    assert os.listdir(tmp_path) == []


def test_a_file_url_is_a_local_path(tmp_path):
    with trajstore.Writer(f"file://{tmp_path}/d") as w:
        w.append(0, {"x": torch.arange(3)})
    assert torch.equal(trajstore.Reader(f"file://{tmp_path}/d")[0]["x"], torch.arange(3))
    assert torch.equal(trajstore.Reader(tmp_path / "d")[0]["x"], torch.arange(3))
