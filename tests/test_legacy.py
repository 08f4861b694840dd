"""Dumps written before the package was restructured still read bit for bit (tests/_legacy.py)."""

import shutil
from pathlib import Path

import pytest

import trajstore
from trajstore.format.batch import containers as adapters
from trajstore.testing import assert_batch_equal

from _legacy import batches

DUMP = Path(__file__).parent / "data" / "v1_dump"
CASES = [(split, step, batch, meta) for split, steps in batches().items() for step, batch, meta in steps]


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """A copy: reading must not need to write, but a test must never change the fixture either."""
    out = tmp_path_factory.mktemp("legacy") / "v1_dump"
    shutil.copytree(DUMP, out)
    return out


@pytest.mark.parametrize("split,step,batch,meta", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_v1_dump_reads_bit_for_bit(dump, split, step, batch, meta):
    r = trajstore.Reader(dump, split, verify=True)
    got = r[step]
    assert type(got) is type(batch)
    if split == "containers":  # compared through their plain form (adapters.unwrap), the container tag too
        (got, got_tag), (batch, tag) = adapters.unwrap(got), adapters.unwrap(batch)
        assert got_tag == tag
    assert_batch_equal(got, batch)
    assert r.meta(step) == meta


def test_v1_dump_forms_and_checks(dump):
    r = trajstore.Reader(dump)
    assert r.steps == [0, 1, 2, 3, 4]
    forms = [r.info(s)["batch"].get("form", r.info(s)["batch"]["t"]) for s in r.steps]
    assert forms == ["padded", "padded", "packed", "plain", "seq"]
    assert trajstore.verify(dump, deep=True).ok
    # the index segments written then still serve Reader.column
    assert sorted(r.column("rewards", [0, 1, 2, 3])) == [0, 1, 2, 3]


def test_cli_names_the_versions_and_upgrades_the_layout(tmp_path, int64_tokens):
    """info and verify say which layout and step formats a dump uses; `trajstore upgrade` moves a
    layout-1 dump to the current layout, after which every step still reads bit for bit."""
    import json

    from trajstore.cli import main
    from trajstore.format.spec import MANIFEST_VERSION

    p = tmp_path / "v1"
    shutil.copytree(DUMP, p)
    rep = trajstore.verify(p)
    assert rep.layout == 1 and rep.formats == {1: 7} and "trajstore upgrade" in rep.summary()
    from trajstore.inspection.describe import describe

    d = describe(p)
    assert d["format_version"] == 1 and {sp["formats"][0] for sp in d["splits"].values()} == {1}
    assert main(["upgrade", str(p)]) == 0
    assert json.loads((p / "trajstore.json").read_text())["format_version"] == MANIFEST_VERSION
    rep = trajstore.verify(p, deep=True)
    assert rep.ok and rep.layout == MANIFEST_VERSION and "upgrade" not in rep.summary()
    for split, step, batch, meta in CASES:
        r = trajstore.Reader(p, split, verify=True)
        got, want = (adapters.unwrap(r[step])[0], adapters.unwrap(batch)[0]) if split == "containers" else (r[step], batch)
        assert_batch_equal(got, want)
    with trajstore.Writer(tmp_path / "new") as w:  # a new dump: current layout, nothing to upgrade
        w.append(0, CASES[0][2])
    assert trajstore.verify(tmp_path / "new").formats == {3: 1}  # its bf16 / fp16 fields: version 3
    assert main(["upgrade", "--json", str(tmp_path / "new")]) == 0
