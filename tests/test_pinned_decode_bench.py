"""``benchmarks/pinned_decode.py``: the Arrow memory pool of ``trajstore/device/decode_pool.cc``, compiled against the
installed pyarrow, hands Arrow's Parquet decoder its large buffers (plain cached memory here, pinned on a GPU host),
a step read into it is the default read bit for bit, freed buffers are reused, and the module's call prints that
check. No time is asserted."""

import numpy as np
import pytest

import trajstore
from benchmarks import least, pinned_decode as P, workload

pytestmark = pytest.mark.skipif(P.compiler() is None, reason="needs a C++ compiler to build the pool")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return P.build(tmp_path_factory.mktemp("pool"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("dump") / "d"
    with trajstore.Writer(d) as w:
        for s in range(2):
            w.append(s, workload.padded_batch(B=48, max_len=4096, seed=s))
    r = trajstore.Reader(d)
    return [r.file(s) for s in r.steps]


def test_a_step_read_into_the_pool_is_the_default_read_and_its_buffers_are_reused(lib, files):
    pool = P.Pool(lib, None, threshold=1 << 12)
    assert pool.pool.backend_name == "cached" and pool.made() == 0
    cols = least.columns(files[0])
    t = least.read(files[0], cols, pool.pool)
    assert t.equals(least.read(files[0], cols, None)) and t.num_rows == 48
    made, reserved = pool.made(), pool.reserved()
    assert made > 0 and reserved >= sum(b.size for c in t.columns for ch in c.chunks for b in ch.buffers() if b) // 2
    del t
    for _ in range(3):  # the same step again: every large buffer comes from those freed
        assert least.read(files[0], cols, pool.pool).equals(least.read(files[0], cols, None))
    assert pool.made() == made and pool.reserved() == reserved


def test_a_step_sent_from_the_pool_is_its_values_as_least_stages_them(lib, files):
    pool = P.Pool(lib, None, threshold=1 << 12)
    cols = least.columns(files[1])
    want = np.concatenate([b for _, b in least.values(least.read(files[1], cols, None))])
    got = P.sent(files[1], cols, pool.pool)
    assert got.dtype == np.uint8 and len(got) > 4096 and np.array_equal(got, want)
    bufs = {}
    least.stage(files[1], cols, lambda n: bufs.setdefault("b", np.empty(n, np.uint8)))
    assert np.array_equal(bufs["b"], want)


def test_the_call_checks_the_pool_then_times_every_row(capsys):
    assert P.main(["--steps", "2", "--batch", "16", "--max-len", "512", "--rounds", "1", "--prefetch", "2"]) == 0
    out = capsys.readouterr().out
    assert "a step sent from the pinned pool equals the default read: True" in out
    labels = [ln.split("  ")[1].strip() for ln in out.splitlines() if ln.startswith("round 0")]
    assert labels == ["decoder ceiling: read_table, 8 at a time", "least replay, 2 at a time",
                      "staged through cached plain memory, 2 at a time", "pinned decode, 2 at a time",
                      "Reader.iter(prefetch=2, packed), staged", "Reader.iter(prefetch=2, packed), decoding into pinned memory"]
    assert "buffers made" in out
