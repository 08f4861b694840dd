"""A logical step written by N ranks (one shard file each) and its replay on M ranks, in one process:
``Writer(rank=r, world_size=n)`` in a loop writes the shards (docs/FORMAT.md section 1). The
processes of torch.distributed are in tests/test_ranks_dist.py."""

import json

import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore import cli
from trajstore.errors import ConfigError, FormatError, StepExistsError, StepNotFoundError
from trajstore.store import columns, commit, paths
from trajstore.testing import (
    assert_batch_equal,
    padded_batches,
    prompt_completion_batches,
    trajectory_lists,
    two_sided_batches,
)

SIZES = (3, 9, 5, 7)  # uneven shards, B = 24


def cut(batch, rows):
    """Rows ``rows`` of a batch (every value of these dict batches has B first; a list batch: its elements)."""
    if isinstance(batch, list):
        return [batch[i] for i in rows]
    return {k: v[list(rows)] if getattr(v, "ndim", 0) else v for k, v in batch.items()}  # scalars: batch-wide


def rows_of(batch):
    return len(batch) if isinstance(batch, list) else len(next(v for v in batch.values() if v.ndim))


def shard_batch(step: int, rank: int, n: int) -> dict:
    """Rank ``rank``'s shard of ``step``: ``n`` rows padded to its own width, lengths 1..7."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    lens = torch.randint(1, 8, (n,), generator=g)
    T = int(lens.max())
    mask = torch.arange(T)[None, :] < lens[:, None]
    return {"input_ids": torch.randint(0, 50_000, (n, T), generator=g).masked_fill(~mask, 0),
            "attention_mask": mask.to(torch.int64),
            "logprobs": torch.randn(n, T, generator=g).to(torch.bfloat16).masked_fill(~mask, 0),
            "rewards": torch.randn(n, generator=g) + 10 * rank}


def write_shards(path, steps=(0, 1), sizes=SIZES, skip=()):
    for r, n in enumerate(sizes):
        with trajstore.Writer(path, rank=r, world_size=len(sizes)) as w:
            for s in steps:
                if (s, r) not in skip:
                    w.append(s, shard_batch(s, r, n), meta={"rank_meta": r})
    return path


def trajectories(batch: dict) -> list[dict]:
    """Each trajectory's valid tokens and values: what a slice must hold whatever its padded width."""
    m = batch["attention_mask"].bool()
    return [{k: (v[i][m[i]] if v.dim() == 2 else v[i]) for k, v in batch.items() if k != "attention_mask"}
            for i in range(len(m))]


def same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and torch.equal(x[k].view(torch.uint8) if x[k].dtype == torch.bfloat16
                                                            else x[k], y[k].view(torch.uint8)
                                                            if y[k].dtype == torch.bfloat16 else y[k]), k


def logical_trajectories(step: int, sizes=SIZES) -> list[dict]:
    return [t for r, n in enumerate(sizes) for t in trajectories(shard_batch(step, r, n))]


def token_partition(counts: list[int], m: int) -> list[list[int]]:
    """Decision 3 of issue 14, written out independently: descending tokens (ties: lower index), each to
    the rank with the smallest total among those holding fewer than B/M (ties: lower rank)."""
    k = len(counts) // m
    parts, tot = [[] for _ in range(m)], [0] * m
    for i in sorted(range(len(counts)), key=lambda i: (-counts[i], i)):
        r = min((r for r in range(m) if len(parts[r]) < k), key=lambda r: (tot[r], r))
        parts[r].append(i)
        tot[r] += counts[i]
    return [sorted(p) for p in parts]


def test_shard_files_and_logical_step(tmp_path):
    d = write_shards(tmp_path / "d")
    names = sorted(f.name for f in (d / "train").iterdir())
    assert names[:4] == [f"step_00000000.rank{r:05d}-of-00004.parquet" for r in range(4)]
    r = trajstore.Reader(d)
    assert r.steps == [0, 1] and len(r) == 2 and 0 in r
    same(trajectories(r[0]), logical_trajectories(0))
    assert [f.name for f in r.files(1)] == [paths.shard_name(1, k, 4) for k in range(4)]
    for k, n in enumerate(SIZES):  # each dumped shard exactly
        assert_batch_equal(r.shard(1, k), shard_batch(1, k, n))
    assert r.meta(0) == {"rank_meta": [0, 1, 2, 3]}  # each rank's own value, in rank order (FORMAT 3.12)
    assert trajstore.Reader(d, rank=2, world_size=4).meta(0) == {"rank_meta": 2}  # the shard as dumped
    assert trajstore.Reader(d, rank=1, world_size=2).meta(0) == {"rank_meta": [0, 1, 2, 3]}
    assert r.info(0)["meta"] == {"rank_meta": [0, 1, 2, 3]} and r.info(0)["num_rows"] == 24
    with pytest.raises(StepNotFoundError, match="rank 4"):
        r.shard(0, 4)
    doc = json.loads(pq.read_metadata(r.files(0)[2]).metadata[b"trajstore"])
    assert doc["shard"] == {"rank": 2, "world_size": 4} and doc["format_version"] == 6  # a shard: 3; int32 ids: 6
    col = r.column("rewards")
    assert torch.equal(col[1], r[1]["rewards"])
    assert set(columns.read(d / "train")) == {"__len__attention_mask", "input_ids", "attention_mask", "logprobs",
                                               "rewards", "rank"}  # the record N writers share (FORMAT 3.11)
    df = r.to_pandas(0)
    assert df["rank"].tolist() == [k for k, n in enumerate(SIZES) for _ in range(n)]


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_slices_contiguous_and_tokens(tmp_path, m):
    d = write_shards(tmp_path / "d", steps=(0,))
    logical = logical_trajectories(0)
    counts = [int(t["input_ids"].numel()) for t in logical]
    for balance in ("contiguous", "tokens"):
        got, seen = [], []
        want = token_partition(counts, m) if balance == "tokens" else [list(range(k * 24 // m, (k + 1) * 24 // m))
                                                                        for k in range(m)]
        for k in range(m):
            part = trajstore.Reader(d, rank=k, world_size=m, balance=balance)[0]
            if m == 4 and balance == "contiguous":  # M == N: exactly the shard rank k dumped
                assert_batch_equal(part, shard_batch(0, k, SIZES[k]))
            else:
                same(trajectories(part), [logical[i] for i in want[k]])
            got += trajectories(part)
            seen += want[k]
        assert sorted(seen) == list(range(24))
        if balance == "contiguous":
            same(got, logical)  # the slices joined in rank order are the logical batch


def test_world_size_that_cannot_split(tmp_path):
    d = write_shards(tmp_path / "d", steps=(0,))
    for balance in ("contiguous", "tokens"):
        with pytest.raises(ConfigError, match=r"step 0 .* 24 trajectories, which 5 ranks cannot share"):
            trajstore.Reader(d, rank=0, world_size=5, balance=balance)[0]
    for bad in [dict(rank=2, world_size=2), dict(rank=0), dict(rank=-1, world_size=2), dict(rank=True, world_size=2)]:
        with pytest.raises(ConfigError, match="give both"):
            trajstore.Reader(d, **bad)
    with pytest.raises(ConfigError, match="balance"):
        trajstore.Reader(d, rank=0, world_size=2, balance="rows")


def test_incomplete_step_is_not_listed_and_says_why(tmp_path, capsys):
    d = write_shards(tmp_path / "d", steps=(0, 1, 2), skip={(1, 2), (2, 0), (2, 3)})
    r = trajstore.Reader(d)
    assert r.steps == [0] and 1 not in r
    with pytest.raises(StepNotFoundError, match=r"written by 4 ranks and the shard\(s\) of rank\(s\) 2 are not"):
        r[1]
    with pytest.raises(StepNotFoundError, match=r"rank\(s\) 0, 3 are not"):
        r.read(2)
    rep = trajstore.verify(d)
    assert rep.ok and sorted(rep.incomplete) == [("train", 1), ("train", 2)]
    assert cli.run(["info", str(d)]) == 0
    assert "INCOMPLETE step 1: 4 ranks, rank(s) 2 not committed" in capsys.readouterr().out
    duckdb = pytest.importorskip("duckdb")
    con = r.duckdb()
    assert con.execute("SELECT DISTINCT step FROM train").fetchall() == [(0,)]
    # a glob sees the committed shards of incomplete steps; docs/RELIABILITY.md's filter keeps complete steps
    glob = f"{d}/train/*.parquet"
    assert sorted(duckdb.sql(f"SELECT DISTINCT step FROM '{glob}'").fetchall()) == [(0,), (1,), (2,)]
    q = (f"WITH t AS (SELECT *, regexp_extract(filename, '-of-(\\d+)\\.parquet$', 1) AS n FROM read_parquet('{glob}', "
         "filename = true, union_by_name = true)) SELECT DISTINCT step FROM t WHERE n = '' OR step IN (SELECT step "
         "FROM t WHERE n <> '' GROUP BY step HAVING count(DISTINCT rank) = max(CAST(n AS INTEGER)))")
    assert duckdb.sql(q).fetchall() == [(0,)]
    with trajstore.Writer(d, rank=2, world_size=4) as w:  # the late rank commits: the step appears
        w.append(1, shard_batch(1, 2, SIZES[2]))
    r.refresh()
    assert r.steps == [0, 1]
    same(trajectories(r[1]), logical_trajectories(1))


def test_ambiguous_step_and_refusals(tmp_path):
    d = write_shards(tmp_path / "d", steps=(0,))
    with trajstore.Writer(d, rank=1, world_size=4) as w:
        with pytest.raises(StepExistsError, match="rank00001-of-00004"):
            w.append(0, shard_batch(0, 1, 9))  # a committed shard is never overwritten by accident
        with pytest.raises(trajstore.BatchError, match="field named 'rank'"):
            w.append(1, {"rank": torch.zeros(2), "rewards": torch.zeros(2)})
    with trajstore.Writer(d, rank=0, world_size=2) as w:
        w.append(0, shard_batch(0, 0, 3))  # shards of another world size: the step is ambiguous
    r = trajstore.Reader(d)
    assert r.steps == [0]
    with pytest.raises(FormatError, match=r"step 0 is ambiguous: .*rank00000-of-00002.*rank00003-of-00004"):
        r[0]
    rep = trajstore.verify(d)
    assert not rep.ok and "ambiguous" in rep.damaged[("train", 0)]
    assert cli.run(["info", str(d)]) == 0  # info lists it apart
    with trajstore.Writer(d) as w:
        w.append(5, shard_batch(5, 0, 2))
    with trajstore.Writer(d, rank=0, world_size=2) as w:
        with pytest.raises(StepExistsError, match="whole step file"):
            w.append(5, shard_batch(5, 0, 2))


def test_skipped_shard_skips_the_step(tmp_path):
    d = tmp_path / "d"
    with trajstore.Writer(d, rank=1, world_size=2) as w:
        w.append(3, {"ok": torch.zeros(2)})
    with trajstore.Writer(d, rank=0, world_size=2) as w:
        w.append(3, {"ok": torch.zeros(2)})
    (d / "train" / paths.shard_name(3, 1, 2)).unlink()  # rank 1's write of step 3 failed (e.g. disk full)
    assert commit.record_skipped(d / "train", 3, "disk full", paths.shard_name(3, 1, 2))
    r = trajstore.Reader(d)
    assert r.skipped == {3: "rank 1 of 2: disk full"}
    with pytest.raises(StepNotFoundError, match="rank 1 of 2: disk full"):
        r.wait_for(3, timeout=5)


def cut_points(draw, n_rows: int, n: int) -> list[list[int]]:
    cuts = sorted(draw(st.lists(st.integers(0, n_rows), min_size=n - 1, max_size=n - 1)))
    bounds = [0, *cuts, n_rows]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=30, deadline=None)
@given(batch=st.one_of(padded_batches(max_batch=8), trajectory_lists(max_batch=8), two_sided_batches(),
                               prompt_completion_batches()), n=st.integers(1, 4),
       data=st.data())
def test_round_trip_of_shards_and_slices(tmp_path_factory, batch, n, data):
    """A batch cut into n shards (as a dispatch cuts it) reads back as the batch; any M dividing B gives
    slices that, written as the shards of M ranks, read back as the batch too."""
    d = tmp_path_factory.mktemp("r")
    b = rows_of(batch)
    parts = cut_points(data.draw, b, n)
    for r, rows in enumerate(parts):
        with trajstore.Writer(d, rank=r, world_size=n) as w:
            w.append(0, cut(batch, rows))
    rd = trajstore.Reader(d)
    assert_batch_equal(rd[0], batch)
    for r, rows in enumerate(parts):
        assert_batch_equal(trajstore.Reader(d, rank=r, world_size=n)[0], cut(batch, rows))
    m = data.draw(st.sampled_from([k for k in range(1, 7) if b % k == 0] if b else [1, 2]))
    for balance in ("contiguous", "tokens"):
        out = tmp_path_factory.mktemp("s")
        for k in range(m):
            part = trajstore.Reader(d, rank=k, world_size=m, balance=balance)[0]
            exact = m == n and balance == "contiguous"  # M == N: the shard rank k dumped
            assert rows_of(part) == (len(parts[k]) if exact else b // m)
            with trajstore.Writer(out, rank=k, world_size=m) as w:
                w.append(0, part)
        if balance == "contiguous":
            assert_batch_equal(trajstore.Reader(out)[0], batch)


def test_column_index_of_shards(tmp_path, monkeypatch):
    """Each rank's writer indexes its own shards (segments of their own, never replacing another's); a
    logical step's value comes from the index only when every shard is indexed and current."""
    d = write_shards(tmp_path / "d", steps=(0, 1, 2))
    segs = sorted((d / "_trajstore" / "train" / "index").glob("*.index"))
    assert len(segs) == 4 and len({s.name for s in segs}) == 4  # one per rank
    r = trajstore.Reader(d)
    want = {s: r.read(s, columns=["rewards"])["rewards"] for s in r.steps}
    got = r._index.values("rewards", r.steps, r._listing.shards)
    assert sorted(got) == [0, 1, 2] and all(torch.equal(got[s], want[s]) for s in got)
    col = r.column("rewards")
    assert all(torch.equal(col[s], want[s]) for s in want)
    with trajstore.Writer(d, rank=3, world_size=4, overwrite=True) as w:  # rank 3 rewrites step 1: not indexed
        w.append(1, shard_batch(1, 3, SIZES[3]) | {"rewards": torch.zeros(SIZES[3])})
    for seg in (d / "_trajstore" / "train" / "index").glob("*.index"):
        if seg not in segs:
            seg.unlink()  # the new segment of step 1 gone: its value must come from the files
    r = trajstore.Reader(d)
    assert sorted(r._index.values("rewards", r.steps, r._listing.shards)) == [0, 2]
    assert torch.equal(r.column("rewards", [1])[1][-7:], torch.zeros(7))


def test_older_readers_refuse_a_shard_file(tmp_path):
    """A shard file is format version 3 with a ``shard`` key validate.py checks: a reader of version 2
    refuses it by its version, and a file claiming less, or a shard without its rank column, is damaged."""
    from trajstore.errors import FormatVersionError
    from trajstore.format.file import validate
    from trajstore.format.spec import check_version
    d = write_shards(tmp_path / "d", steps=(0,), sizes=(2, 3))
    f = d / "train" / paths.shard_name(0, 1, 2)
    md = pq.read_metadata(f)
    doc, schema = json.loads(md.metadata[b"trajstore"]), pq.read_schema(f)
    with pytest.raises(FormatVersionError, match="reads up to 2"):
        check_version(doc["format_version"], str(f), "the step", newest=2)
    validate.check(doc, schema, md.num_rows, str(f))
    with pytest.raises(FormatError, match="it needs 3"):
        validate.check({**doc, "format_version": 2}, schema, md.num_rows, str(f))
    with pytest.raises(FormatError, match="without its int32 'rank' column"):
        validate.check(doc, schema.remove(schema.get_field_index("rank")), md.num_rows, str(f))
    with pytest.raises(FormatError, match="is not"):
        validate.check({**doc, "shard": {"rank": 2, "world_size": 2}}, schema, md.num_rows, str(f))
    lone = trajstore.Reader(f)  # a shard file copied out alone: that rank's rows
    assert lone.steps == [0]
    assert_batch_equal(lone[0], shard_batch(0, 1, 3))


def test_recorder_ranks_in_one_process(tmp_path, monkeypatch):
    """RANK/WORLD_SIZE: each rank's Recorder dumps its shards of the one split, rotates its own files
    (max_keep) and replays its slice; a replay on one process reads the logical steps."""
    path = str(tmp_path / "d")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        with trajstore.Recorder(dump=True, path=path, max_keep=2) as rec:
            for s in range(4):
                rec.batch(s, lambda s=s: shard_batch(s, rank, 3 + rank))
            assert rec.steps == [2, 3]
        assert rec.info()["steps"] == [2, 3]
    assert sorted(f.name for f in (tmp_path / "d" / "train").iterdir()) == [
        paths.shard_name(s, r, 2) for s in (2, 3) for r in (0, 1)]
    monkeypatch.setenv("RANK", "1")
    rec = trajstore.Recorder(replay=True, path=path)
    assert rec.steps == [2, 3]
    assert_batch_equal(rec.batch(3, lambda: pytest.fail("fn called")), shard_batch(3, 1, 4))  # M == N
    assert rec.meta(3) == {}
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    whole = trajstore.Recorder(replay=True, path=path).batch(2, lambda: None)
    same(trajectories(whole), [t for r in (0, 1) for t in trajectories(shard_batch(2, r, 3 + r))])


def test_a_rank_cleans_only_its_own_temporaries(tmp_path):
    """Ranks may run on other hosts, where a pid means nothing: a writer removes stale temporaries of
    its own rank's files (and a whole-step writer those of whole steps) only."""
    d = write_shards(tmp_path / "d", steps=(0,), sizes=(2, 2))
    side = d / "_trajstore" / "train"
    dead = 2**22 + 12345
    names = [f".step_00000001.rank00000-of-00002.parquet.tmp-{dead}-ab",
             f".step_00000001.rank00001-of-00002.parquet.tmp-{dead}-cd",
             f".step_00000001.parquet.tmp-{dead}-ef", f".columns.json.tmp-{dead}-01"]
    for n in names:
        (side / n).write_text("x")
    trajstore.Writer(d, rank=1, world_size=2).close()
    assert sorted(n for n in names if (side / n).exists()) == sorted([names[0], names[2], names[3]])
    trajstore.Writer(d).close()
    assert [n for n in names if (side / n).exists()] == [names[0]]


def test_columns_and_layouts_of_a_logical_step(tmp_path):
    """``columns`` reads each shard's own columns of those fields (docs/FORMAT.md 3.12) and decodes
    what the whole logical step decodes; layouts convert the joined step."""
    d = write_shards(tmp_path / "d", steps=(0,))
    r = trajstore.Reader(d)
    full = r[0]
    for cols in (["rewards"], ["logprobs"], ["input_ids", "rewards"]):
        got = r.read(0, columns=cols)
        assert list(got) == cols
        for c in cols:
            assert_batch_equal(got[c], full[c])
    for layout in ("packed", "padded"):
        assert_batch_equal(r.read(0, columns=["logprobs"], layout=layout)["logprobs"],
                           r.read(0, layout=layout)["logprobs"])
    for k in range(3):  # a slice's columns are the slice's rows of them
        s = trajstore.Reader(d, rank=k, world_size=3)
        assert torch.equal(s.read(0, columns=["rewards"])["rewards"], full["rewards"][8 * k:8 * (k + 1)])
        assert torch.equal(s.column("rewards")[0], full["rewards"][8 * k:8 * (k + 1)])


def test_a_step_completed_after_the_listing_is_read(tmp_path):
    """A reader tailing a run: a step whose last shard is committed after the reader listed the split
    is read (joined) when asked for, as a whole step committed since would be."""
    d = write_shards(tmp_path / "d", steps=(0, 1), skip={(1, 3)})
    r = trajstore.Reader(d)
    assert r.steps == [0]
    with trajstore.Writer(d, rank=3, world_size=4) as w:
        w.append(1, shard_batch(1, 3, SIZES[3]))
    same(trajectories(r[1]), logical_trajectories(1))
    assert r.steps == [0, 1]
    r2 = trajstore.Reader(d)
    with trajstore.Writer(d, rank=0, world_size=1) as w:
        w.append(2, shard_batch(2, 0, 2))
    r2.wait_for(2, timeout=10)
    assert_batch_equal(r2[2], shard_batch(2, 0, 2))
