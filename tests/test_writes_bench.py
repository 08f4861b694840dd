"""``benchmarks/writes.py`` ``sustained``: the main row times a pass of ``PER_WORKER`` steps a worker (in a pass of
two a worker the workers wait for a step a sixth of their time, at its start and end: benchmarks/RESULTS.md,
sixteenth round), the shorter pass it timed before stays an extra line, and each pass is appended twice by one writer,
every step committed. No time is asserted."""

from benchmarks import writes, workload
from benchmarks.__main__ import Report


def test_the_sustained_row_times_a_pass_of_eight_steps_a_worker(tmp_path, monkeypatch):
    passes = []
    real = writes.append_loop

    def spy(d, batches, n, **kw):
        passes.append((d.name, n, kw["workers"], kw["warm"]))
        return real(d, batches, n, **kw)

    monkeypatch.setattr(writes, "append_loop", spy)
    batches = [workload.padded_batch(B=4, max_len=32, seed=i) for i in range(3)]
    rep = Report()
    gbs = writes.sustained(rep, tmp_path, batches, workload.raw_bytes(batches[0]), steps=3, workers=2)
    assert sorted(n for _, n, _, _ in passes) == [3, 16] and all(w == 2 and warm for _, _, w, warm in passes)
    main, extra = rep.rows
    assert "second pass of 16 steps" in main["figure"] and main["value"] == gbs > 0
    assert "a pass of 3 steps (1.5 a worker" in extra["figure"] and extra["value"] > 0
    import trajstore
    for name, n, _, _ in passes:  # both passes' steps, the warm one and the timed one, committed
        assert trajstore.Reader(tmp_path / name).steps == list(range(2 * n))


def test_a_long_pass_is_not_timed_twice(tmp_path):
    assert writes.passes(200, 16) == 200 and writes.passes(32, 16) == 128 and writes.passes(3, 2) == 16
    batches = [workload.padded_batch(B=4, max_len=32, seed=0)]
    rep = Report()
    writes.sustained(rep, tmp_path, batches, workload.raw_bytes(batches[0]), steps=16, workers=2)
    assert len(rep.rows) == 1 and "second pass of 16 steps" in rep.rows[0]["figure"]
