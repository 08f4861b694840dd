"""``python -m benchmarks.replay_cpu`` (the replay probe of benchmarks/RESULTS.md) runs end to end on a small
step: every row it promises is printed with a rate, a CPU time, the cores kept busy, the page faults and the GIL wait, the stages included. No time is
asserted; the rate keeps three significant figures, so a small step on a busy machine never reads 0.00."""

import os
import re

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
