"""Arrow's CPU pool raised to a read's thread budget while the read is in flight and restored after
(``trajstore/base/arrow_pool.py``; README, Threads): under torchrun's ``OMP_NUM_THREADS=1`` a Reader's
reads decode on a pool of its budget, not of one thread; a larger pool is never lowered; concurrent
reads share one raise and leave the pool as they found it; back-to-back reads share it too (it is
restored once idle for ``LINGER``); a failing ``set_cpu_count`` fails no read."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from _dumps import in_forked_child, many_row_groups, write
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore.base import arrow_pool as pool
from trajstore.base import threads as _threads
from trajstore.format.file import parquet

CHILD = r"""
import json, sys, time
import pyarrow as pa, torch
import trajstore
from trajstore.format.file import parquet
from _dumps import many_row_groups
from pytest import MonkeyPatch

mp = MonkeyPatch()
many_row_groups(mp)  # every step of several row groups, every read a large one (Arrow's dataset reader)
seen, real = [], parquet._scan
mp.setattr(parquet, "_scan", lambda *a: seen.append(pa.cpu_count()) or real(*a))  # the pool as it decodes
d, out = sys.argv[1], {"before": pa.cpu_count()}

def settled():  # Arrow's pool once the reads are over (restored when idle for arrow_pool.LINGER)
    end = time.monotonic() + 60
    while pa.cpu_count() != 1 and time.monotonic() < end:
        time.sleep(0.01)
    return pa.cpu_count()

g = torch.Generator().manual_seed(0)
steps = {s: {"input_ids": torch.randint(0, 9, (12, 40), generator=g), "rewards": torch.rand(12, generator=g)}
         for s in range(4)}
for rank in range(2):  # a step of two shards
    with trajstore.Writer(d, rank=rank, world_size=2) as w:
        for s, b in steps.items():
            w.append(s, {k: v[rank * 6:(rank + 1) * 6] for k, v in b.items()})
exact = lambda got, want: all(torch.equal(got[k], v) for k, v in want.items())
r = trajstore.Reader(d)
ok = all(exact(r.read(s), b) for s, b in steps.items())
out.update(read=seen[:], after_read=settled(), threads=r.threads)
seen.clear()
for prefetch in (2, 4):  # 4: each step decoded on its own prefetch thread, several at once
    ok &= all(exact(x, steps[s]) for s, x in r.iter(prefetch=prefetch))
    out[f"iter{prefetch}"] = seen[:]
    seen.clear()
out.update(after_iter=settled())
for k in range(3):  # three ranks replaying the two-rank dump: each cuts a shard
    x = trajstore.Reader(d, rank=k, world_size=3).read(0)
    ok &= exact(x, {n: v[k * 4:(k + 1) * 4] for n, v in steps[0].items()})
out.update(cut=seen[:], after_cut=settled(), exact=ok)
print(json.dumps(out))
"""


@pytest.mark.parametrize("budget", [None, "4"])
def test_a_rank_under_torchrun_decodes_on_arrows_pool_of_its_budget(tmp_path, budget):
    """A child with torchrun's variables (OMP_NUM_THREADS=1, two ranks on this host) and this machine's
    cores: Arrow's pool is the rank's budget (``TRAJSTORE_THREADS=4``, or this machine's cores halved)
    whenever a step's row groups decode -- whole reads, replay with read-ahead and a slice cut from the
    shards -- three quarters of it where replay decodes one step per thread (3 of 4), and one thread
    again once the reads and the replay are over."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1])])}
    env.pop(_threads.ENV, None)
    if budget:
        env[_threads.ENV] = budget
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    n = int(budget) if budget else max(1, min(_threads.MAX_DEFAULT, _threads.cores() // 2))
    assert got["before"] == 1 and got["threads"] == n and got["exact"]
    assert got["read"] and got["iter2"] and got["iter4"] and len(got["cut"]) >= 3
    assert set(got["read"]) == set(got["iter2"]) == set(got["cut"]) == {n}
    assert set(got["iter4"]) == {n - n // 4}
    assert got["after_read"] == got["after_iter"] == got["after_cut"] == 1


@pytest.fixture
def one(monkeypatch):
    """Arrow's pool of one thread, as torchrun leaves it (given back as it was after the test), restored
    as soon as no read is in flight (``LINGER`` 0); every step written of several row groups and every
    read a large one; ``seen``: (budget, pool) per decode."""
    monkeypatch.setattr(pool, "LINGER", 0)
    was, resize = pa.cpu_count(), pa.set_cpu_count  # (a test may replace pa.set_cpu_count)
    resize(1)
    many_row_groups(monkeypatch)
    seen: list[tuple[int, int]] = []
    real = parquet._scan
    monkeypatch.setattr(parquet, "_scan", lambda *a: seen.append((_threads.threads(), pa.cpu_count())) or real(*a))
    yield seen
    resize(was)


def batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 99, (8, 16), generator=g), "rewards": torch.rand(8, generator=g)}


def test_a_read_raises_the_pool_to_its_budget_and_gives_it_back(tmp_path, one):
    r = write(tmp_path, {0: batch(0)})
    got = trajstore.Reader(tmp_path, threads=3).read(0)
    assert one == [(3, 3)] and pa.cpu_count() == 1
    assert torch.equal(got["input_ids"], batch(0)["input_ids"])
    assert torch.equal(r.read(0)["rewards"], batch(0)["rewards"])


def test_a_larger_pool_is_never_lowered(tmp_path, one):
    write(tmp_path, {0: batch(0)})
    pa.set_cpu_count(6)
    trajstore.Reader(tmp_path, threads=4).read(0)
    assert one == [(4, 6)] and pa.cpu_count() == 6
    with pool.arrow_pool(2):
        assert pa.cpu_count() == 6
    with pool.arrow_pool(8):
        assert pa.cpu_count() == 8
    assert pa.cpu_count() == 6


def test_a_deep_prefetch_decodes_on_three_quarters_of_the_budget(tmp_path, one):
    """Replay decoding one step a thread (prefetch 4) sets the pool to three quarters of the budget, from
    below (torchrun's one thread) or from above (a pool of the host's cores), and gives back the size found;
    a plain read keeps its whole budget; every value exact."""
    steps = {s: batch(s) for s in range(4)}
    write(tmp_path, steps)
    r = trajstore.Reader(tmp_path, threads=8)
    for found in (1, 8, 16):
        pa.set_cpu_count(found)
        one.clear()
        assert all(torch.equal(x["input_ids"], steps[s]["input_ids"]) for s, x in r.iter(prefetch=4))
        assert one == [(8, 6)] * 4 and pa.cpu_count() == found
        assert torch.equal(r.read(1)["rewards"], steps[1]["rewards"])
        assert one[4:] == [(8, max(8, found))] and pa.cpu_count() == found
    assert _threads.arrow_share(1) == 1 and _threads.arrow_share(2) == 2 and _threads.arrow_share(3) == 3
    assert _threads.arrow_share(16) == 12 and _threads.arrow_share(64) == 48
    assert [_threads.arrow_share(n, direct=True) for n in (1, 6, 7, 8, 16, 64)] == [1, 5, 6, 7, 13, 52]


def test_a_deep_prefetch_decoding_into_pinned_memory_takes_thirteen_sixteenths(tmp_path, one):
    """A step of a deep prefetch decoded into the pinned pool (``device/decode_pool.py``; here its CPU twin) sets
    Arrow's pool to thirteen sixteenths of the budget, the same read into Arrow's own memory to three quarters; both
    read the same values."""
    from trajstore.device import decode_pool
    if decode_pool.compiler() is None:
        pytest.skip("needs a C++ compiler to build the pool")
    into = decode_pool.plain(dest=tmp_path / "cache")
    r = write(tmp_path / "d", {0: batch(0)})
    from trajstore.store.stepfile import open_step
    got = []
    for mp in (into.pool, None):
        sf = open_step(r.file(0), 0)
        with _threads.using(16):
            _threads.serial()
            try:
                got.append(parquet.read_columns(sf.pf, sf.src, None, pool=mp))
            finally:
                _threads.serial(False)
    assert one == [(16, 13), (16, 12)]
    assert got[0].equals(got[1])


def test_an_exact_size_is_not_lowered_under_another_read(one):
    """A deep prefetch's size is the pool's where no other read is in flight; beside a plain read, or a
    read of a larger size, the pool is not lowered, and a plain read raises it back over the size found."""
    pa.set_cpu_count(8)
    with pool.arrow_pool(6, exact=True):
        assert pa.cpu_count() == 6
        with pool.arrow_pool(4):  # a plain read: at least the size found
            assert pa.cpu_count() == 8
            with pool.arrow_pool(6, exact=True):
                assert pa.cpu_count() == 8
        assert pa.cpu_count() == 8  # not lowered while a read is in flight
    assert pa.cpu_count() == 8
    with pool.arrow_pool(4):
        with pool.arrow_pool(6, exact=True):  # beside a plain read of a pool it left untouched
            assert pa.cpu_count() == 8
    with pool.arrow_pool(3, exact=True):
        with pool.arrow_pool(5, exact=True):
            assert pa.cpu_count() == 5
        pa.set_cpu_count(2)  # someone resizes it meanwhile: theirs stays
    assert pa.cpu_count() == 2


def test_overlapping_reads_share_one_raise(one):
    """Raised to the largest budget in flight, never lowered while one runs, restored by the last; a size
    someone else set meanwhile is kept."""
    a, b = pool.arrow_pool(3), pool.arrow_pool(5)
    a.__enter__()
    assert pa.cpu_count() == 3
    b.__enter__()
    assert pa.cpu_count() == 5
    a.__exit__(None, None, None)
    assert pa.cpu_count() == 5
    b.__exit__(None, None, None)
    assert pa.cpu_count() == 1
    with pool.arrow_pool(4):
        pa.set_cpu_count(7)  # the user resizes it while a read is in flight
    assert pa.cpu_count() == 7


@settings(max_examples=8)
@given(budgets=st.lists(st.integers(1, 6), min_size=2, max_size=5))
def test_concurrent_reads_are_exact_and_leave_the_pool_restored(tmp_path_factory, one, budgets):
    """Readers of several budgets reading on several threads at once (and replaying with read-ahead):
    every value exact, every decode on a pool of at least its budget, the pool of one thread at the end."""
    one.clear()
    d = tmp_path_factory.mktemp("conc")
    steps = {s: batch(s) for s in range(3)}
    write(d, steps)
    go = threading.Barrier(len(budgets), timeout=60)

    def work(n: int) -> bool:
        r = trajstore.Reader(d, threads=n)
        go.wait()
        ok = all(torch.equal(r.read(s)["input_ids"], b["input_ids"]) for s, b in steps.items())
        return ok and all(torch.equal(x["rewards"], steps[s]["rewards"]) for s, x in r.iter(prefetch=2))

    with ThreadPoolExecutor(len(budgets)) as ex:
        assert all(ex.map(work, budgets))
    assert len(one) == 6 * len(budgets) and all(p >= n for n, p in one)
    assert pa.cpu_count() == 1


def test_back_to_back_reads_share_one_raise(tmp_path, one, monkeypatch):
    """The pool stays raised for ``LINGER`` after the last read (a replay loop's next read finds the
    same threads), then goes back by itself; ``settle`` gives it back at once (not while a read holds it,
    and says which it found)."""
    write(tmp_path, {s: batch(s) for s in range(3)})
    resized, real = [], pa.set_cpu_count
    monkeypatch.setattr(pa, "set_cpu_count", lambda n: resized.append(n) or real(n))
    monkeypatch.setattr(pool, "LINGER", 3600)
    r = trajstore.Reader(tmp_path, threads=3)
    got = [r.read(s) for s in range(3)] + [x for _, x in r.iter(prefetch=2)]
    assert all(torch.equal(g["input_ids"], batch(k % 3)["input_ids"]) for k, g in enumerate(got))
    assert resized == [3] and pa.cpu_count() == 3 and [n for n, _ in one] == [3] * 6
    with pool.arrow_pool(3):  # a read in flight: settle leaves the pool raised and says so
        assert pool.settle() is False and pa.cpu_count() == 3
    assert pool.settle() is True
    assert resized == [3, 1] and pa.cpu_count() == 1
    monkeypatch.setattr(pool, "LINGER", 0.01)
    r.read(0)
    for _ in range(6000):  # the timer restores it (a minute at most on a loaded machine)
        if pa.cpu_count() == 1:
            break
        threading.Event().wait(0.01)
    assert resized == [3, 1, 3, 1] and pa.cpu_count() == 1


def test_a_size_set_while_the_raise_lingers_is_respected(tmp_path, one, monkeypatch):
    """Resized by someone else while the pool lingers raised: the next read raises it again where that
    size is below its budget (then restores that size), and keeps a larger one."""
    write(tmp_path, {0: batch(0)})
    monkeypatch.setattr(pool, "LINGER", 3600)
    r = trajstore.Reader(tmp_path, threads=3)
    r.read(0)
    pa.set_cpu_count(1)  # lowered while the raise lingers
    r.read(0)
    assert [p for _, p in one] == [3, 3] and pa.cpu_count() == 3
    pool.settle()
    assert pa.cpu_count() == 1
    r.read(0)
    pa.set_cpu_count(5)  # raised by the user while it lingers
    r.read(0)
    pool.settle()
    assert [p for _, p in one] == [3, 3, 3, 5] and pa.cpu_count() == 5


def _in_child(path, q):
    before = pa.cpu_count()
    x = trajstore.Reader(path, threads=2).read(0)["input_ids"]
    q.put((before, x.tolist()))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_the_pool_back(tmp_path, one, monkeypatch):
    """A DataLoader-style worker forked while the parent's pool is raised starts with the size the
    parent found, and reads on its own raise."""
    write(tmp_path, {0: batch(0)})
    monkeypatch.setattr(pool, "LINGER", 3600)
    trajstore.Reader(tmp_path, threads=3).read(0)
    assert pa.cpu_count() == 3
    assert in_forked_child(_in_child, str(tmp_path), what="reading") == (1, batch(0)["input_ids"].tolist())
    assert pa.cpu_count() == 3  # the parent's raise lingers until settled
    pool.settle()
    assert pa.cpu_count() == 1


def test_a_failing_resize_fails_no_read(tmp_path, one, monkeypatch, caplog):
    write(tmp_path, {0: batch(0), 1: batch(1)})

    def refuse(n):
        raise RuntimeError("no threads here")

    monkeypatch.setattr(pa, "set_cpu_count", refuse)
    monkeypatch.setattr(pool, "_warned", False)
    r = trajstore.Reader(tmp_path, threads=4)
    with caplog.at_level(logging.WARNING, "trajstore.reader"):
        got = [r.read(s) for s in (0, 1)]
    assert all(torch.equal(g["input_ids"], batch(s)["input_ids"]) for s, g in enumerate(got))
    assert one == [(4, 1), (4, 1)] and pa.cpu_count() == 1
    warned = [m for m in caplog.messages if "Arrow's CPU pool" in m]
    assert len(warned) == 1 and "no threads here" in warned[0] and "4 threads" in warned[0]
