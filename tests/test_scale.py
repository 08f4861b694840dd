"""A split of thousands of steps (issue 14, "scale of a long run"), built cheaply by cloning one
written step (benchmarks/scale.py ``clone``): listing, ``info``, ``Reader.column``, verify and
``max_keep`` rotation see every step, in numeric order across the 8-digit boundary of file names.
No test here asserts a time; benchmarks/scale.py measures them."""

import json
import shutil

import pytest
import torch

import trajstore
from benchmarks.scale import clone, small_batch
from trajstore import cli
from trajstore.store import listing

N = 2000
# 8-digit names (step_99999999.parquet) and longer ones (step_100000000.parquet) side by side: a
# sort of the names would put 100000000 before 99999998
STEPS = list(range(N - 6)) + [99_999_998, 99_999_999, 100_000_000, 100_000_001, 1_000_000_000, 10**12]


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    d = tmp_path_factory.mktemp("scale") / "dump"
    clone(d, reversed(STEPS))
    return d


def test_listing_is_numeric_across_the_8_digit_boundary(dump):
    names = sorted((dump / "train").iterdir())
    assert names[0].name == "step_00000000.parquet" and names[1].name == "step_00000001.parquet"
    assert "step_100000000.parquet" in {n.name for n in names} and len(names) == N
    r = trajstore.Reader(dump)
    assert r.steps == STEPS == sorted(STEPS)
    assert len(r) == N and 99_999_999 in r and 100_000_000 in r and 10**12 in r and 5000 not in r
    assert listing.list_steps(dump / "train") == STEPS
    assert r.skipped == {}


def test_column_returns_every_step(dump):
    r = trajstore.Reader(dump)
    col = r.column("rewards")
    assert list(col) == STEPS
    want = small_batch()["rewards"]
    assert all(torch.equal(v, want) for v in col.values())
    assert torch.equal(r[100_000_000]["rewards"], want) and torch.equal(r[10**12]["input_ids"],
                                                                         small_batch()["input_ids"])


def test_info_counts_every_step(dump, capsys):
    assert cli.run(["info", str(dump), "--json"]) == 0
    sp = json.loads(capsys.readouterr().out)["splits"]["train"]
    assert sp["steps"]["count"] == N and sp["steps"]["first"] == 0 and sp["steps"]["last"] == 10**12
    assert sp["rows"] == 8 * N and sp["tokens"] == 8 * 16 * N
    assert [p["step"] for p in sp["per_step"]] == STEPS
    assert sp["steps"]["gaps"][0] == [N - 6, 99_999_997]


def test_verify_and_max_keep_rotation(dump, tmp_path):
    assert cli.run(["verify", str(dump)]) == 0  # every clone is a valid committed step
    d = tmp_path / "copy"
    shutil.copytree(dump, d)  # the rotation deletes steps: not in the module's dump
    pins = (3, 99_999_999)
    cfg = trajstore.DumpReplayConfig(dump=True, path=str(d), max_keep=10, pin_steps=pins, resume=True)
    with trajstore.Recorder(cfg) as rec:
        rec.record(10**12 + 1, small_batch())
    unpinned = [s for s in STEPS + [10**12 + 1] if s not in pins]
    assert trajstore.Reader(d).steps == sorted([*pins, *unpinned[-10:]])
    assert unpinned[-10:][:5] == [1990, 1991, 1992, 1993, 99_999_998]  # the oldest go, by number
    assert cli.run(["verify", str(d)]) == 0
