"""Dumps written before the package was restructured still read bit for bit (tests/_legacy.py)."""

import shutil
from pathlib import Path

import pytest

import trajstore
from trajstore.format import containers as adapters
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
