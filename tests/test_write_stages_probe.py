"""``python -m benchmarks.write_stages`` (the write probe of benchmarks/RESULTS.md) runs end to end on a small
step: every stage of every timed job is counted once (``fit`` and ``commit`` each take their turn, so the turn
waits are two a job), the figures are printed, and the writer it wraps wrote every step. No time is asserted."""

import re

from benchmarks import write_stages


def test_the_probe_times_every_stage_of_every_job(capsys, tmp_path):
    batches = [write_stages.W.padded_batch(B=6, max_len=40, seed=i) for i in range(3)]
    r = write_stages.run(tmp_path / "dump", batches, steps=5, workers=2)
    assert {k: len(v) for k, v in r["calls"].items()} == {"encode": 5, "fit": 5, "write": 5, "commit": 5,
                                                           "turn waits": 10}
    assert r["workers"] == 2 and r["wall"] > 0
    import trajstore
    assert trajstore.Reader(tmp_path / "dump").steps == list(range(10))

    assert write_stages.main(["--batch", "6", "--max-len", "40", "--workers", "2", "--steps", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.match(r"# \d+ cores, 2 workers, 3 steps a pass: sustained [\d.]+ GB/s", out[0])
    rows = {line.split()[0]: line for line in out[2:-1]}
    assert list(rows) == ["encode", "fit", "write", "commit", "turn"]
    assert out[-1].startswith("worker-seconds offered ")
