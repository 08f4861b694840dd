"""``python -m benchmarks.replay_cpu`` (the replay probe of benchmarks/RESULTS.md) runs end to end on a small
step: every row it promises is printed with a rate, a CPU time, the cores kept busy, the page faults and the GIL wait, the stages included. No time is
asserted; the rate keeps three significant figures, so a small step on a busy machine never reads 0.00."""

import os
import re

import torch

import trajstore

from benchmarks import replay_cpu


def test_the_probe_prints_every_row_with_its_figures(capsys):
    assert replay_cpu.main(["--device", "cpu", "--batch", "16", "--max-len", "64", "--steps", "2",
                            "--prefetch", "1,4", "--stages"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split("  ")[0].strip(): line for line in lines[1:]}
    assert list(rows) == ["decoder ceiling: read_table, 8 at a time", "trajstore scan alone, 8 serial threads",
                          "decode alone (tables read before), 8 serial threads",
                          "scan + decode (Reader._read), 8 serial threads", "Reader.iter(prefetch=1, packed) to cpu",
                          "Reader.iter(prefetch=4, packed) to cpu"]
    for line in rows.values():
        m = re.search(r"([\d.e+-]+) GB/s\s+CPU\s+([\d.]+) ms a step \(\s*([\d.e+-]+) of (\d+) cores busy\)", line)
        assert m and float(m.group(1)) > 0 and float(m.group(3)) > 0 and int(m.group(4)) == os.cpu_count(), line
        assert re.search(r"system\s+[\d.]+,\s+\d+ page faults", line), line
        g = re.search(r"GIL wait mean ([\d.]+) ms, p90 ([\d.]+)$", line)
        assert g and float(g.group(2)) >= 0, line


def test_the_ceiling_runs_on_arrows_pool_as_found(tmp_path, monkeypatch):
    """A deep prefetch leaves Arrow's pool at three quarters of the budget for ``LINGER``; the decoder ceiling
    measured right after it gives the pool back first, so it is never judged on the replay's smaller pool."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    import trajstore
    from trajstore.base import arrow_pool

    from _dumps import many_row_groups

    many_row_groups(monkeypatch)  # every read a large one, on Arrow's pool
    monkeypatch.setattr(arrow_pool, "LINGER", 3600)
    was = pa.cpu_count()
    try:
        pa.set_cpu_count(8)
        with trajstore.Writer(tmp_path / "d", threads=1) as w:
            for s in range(4):
                w.append(s, {"input_ids": torch.arange(16 * 64).reshape(16, 64) + s})
        r = trajstore.Reader(tmp_path / "d", threads=8)
        assert [s for s, _ in r.iter(prefetch=4)] == [0, 1, 2, 3]
        assert pa.cpu_count() == 6  # lingering at the deep prefetch's share
        seen, real = [], pq.read_table
        monkeypatch.setattr(pq, "read_table", lambda *a, **k: seen.append(pa.cpu_count()) or real(*a, **k))
        replay_cpu.ceiling([r.file(s) for s in r.steps])
        assert seen == [8] * 4
    finally:
        arrow_pool.settle()
        pa.set_cpu_count(was)


def test_a_ratio_to_its_baseline_is_timed_in_turn(monkeypatch):
    """``benchmarks.__main__.paired``: the figure and its baseline alternate (figure first, then baseline first),
    each called ``repeat`` times, and each median is of its own calls' times (a fake clock: the figure's calls
    take 3, 5, 4 units, the baseline's 2, 2, 9)."""
    from benchmarks import __main__ as bench

    clock, order = [0.0], []
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    took = {"a": iter([3, 5, 4]), "b": iter([2, 2, 9])}

    def call(name):
        def f():
            order.append(name)
            clock[0] += next(took[name])
        return f

    assert bench.paired(call("a"), call("b"), 3) == (4, 2)
    assert order == ["a", "b", "b", "a", "a", "b"]


def test_the_ceilings_rate_is_the_steps_bytes_over_one_pass(monkeypatch):
    """``replay_cpu.ceiling_gbps``: one pass of ``ceiling`` over the files, timed (a fake clock: 2 units), the
    files' tensor bytes over it (3 steps of 1e9 bytes: 1.5 GB/s); ``python -m benchmarks`` and
    benchmarks/padded.py both measure the ceiling so, the latter also with page checksums verified."""
    clock, seen = [0.0], []
    monkeypatch.setattr(replay_cpu.time, "perf_counter", lambda: clock[0])

    def one_pass(files, checks):
        seen.append((list(files), checks))
        clock[0] += 2

    monkeypatch.setattr(replay_cpu, "ceiling", one_pass)
    assert replay_cpu.ceiling_gbps(["a", "b", "c"], 10 ** 9) == 1.5 and seen == [(["a", "b", "c"], False)]
    assert replay_cpu.ceiling_gbps(["a"], 10 ** 9, checks=True) == 0.5 and seen[1] == (["a"], True)


def test_the_checked_ceiling_verifies_each_page(tmp_path, monkeypatch):
    """``ceiling(checks=True)`` reads every file with pyarrow's page checksum verification (what every trajstore
    read does), the plain ceiling without it; both read the columns a packed replay reads."""
    import pyarrow.parquet as pq

    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, {"input_ids": torch.ones(2, 3, dtype=torch.int64),
                     "attention_mask": torch.ones(2, 3, dtype=torch.bool)})
    f = trajstore.Reader(tmp_path / "d").file(0)
    calls, real = [], pq.read_table
    monkeypatch.setattr(pq, "read_table", lambda src, **kw: calls.append(kw) or real(src, **kw))
    replay_cpu.ceiling([f, f])
    replay_cpu.ceiling([f], checks=True)
    assert [c["page_checksum_verification"] for c in calls] == [False, False, True]
    assert all("attention_mask" not in c["columns"] and "input_ids" in c["columns"] for c in calls)


def test_the_reports_rows_are_json_whatever_numbers_a_figure_gives(capsys):
    """``python -m benchmarks --json`` writes every row and the baselines: figures computed with numpy (a
    numpy bool for "met", numpy ints and floats for values) are stored as plain numbers, and the baselines'
    path of the flat file is left out (``json`` refuses both)."""
    import json

    import numpy as np

    from pathlib import Path

    from benchmarks.__main__ import Report, as_json

    rep = Report()
    rep.add("a ratio", np.float32(0.5), "x", np.int64(2), "base", "<= 1", np.float64(0.25) <= 1.0)
    rep.add("a count", np.int64(3), "n", ok=np.bool_(False))
    out = json.loads(as_json({"host": "h"}, rep, [], {"load_flat": 0.01, "flat_file": Path("flat.pt")}))
    assert [(r["value"], r["baseline_value"], r["ratio"], r["met"]) for r in out["figures"]] == [
        (0.5, 2.0, 0.25, True), (3.0, None, None, False)]
    assert out["baselines"] == {"load_flat": 0.01}  # the flat file the paired read loads is a path, left out
