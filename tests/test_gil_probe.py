"""``python -m benchmarks.gil`` (the GIL probe of benchmarks/RESULTS.md) runs end to end on a small step:
every stage it promises is printed with its times, hand-offs and longest hold, and the process's switch
interval, torch thread count, Arrow's pool and the calling thread's serial budget are left as they were.
No time is asserted."""

import re
import sys

import pyarrow as pa
import torch

from benchmarks import gil


def test_the_probe_prints_every_stage_and_restores_the_interpreter(capsys):
    from trajstore.base import threads as _threads

    interval, threads, arrow = sys.getswitchinterval(), torch.get_num_threads(), pa.cpu_count()
    assert gil.main(["--batch", "8", "--max-len", "48", "--repeat", "1"]) == 0
    assert sys.getswitchinterval() == interval and torch.get_num_threads() == threads and pa.cpu_count() == arrow
    assert not _threads.is_serial()  # this thread's reads use the pool again (tests after it read with it)
    lines = capsys.readouterr().out.splitlines()
    rows = {line[:38].strip(): line[38:] for line in lines[2:]}
    assert list(rows) == ["encode (schema.encode_plain)", "Parquet write (pq.write_table)",
                          "index digests (digest.derive)", "fsync and hash (commit.prepare)",
                          "serial read (Reader._read, packed)"]
    for label, rest in rows.items():
        m = re.fullmatch(r"\s+([\d.]+) ms\s+([\d.]+) ms\s+(\d+)\s+([\d.]+) ms", rest)
        assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, (label, rest)

