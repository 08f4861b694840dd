"""trajstore.ray (issue 14): a dump as a Ray Data Dataset of trajectories, read by a local Ray
(``ray.init(num_cpus=2)``): rows equal trajstore's own reader bit for bit (bf16 as its real numbers,
each trajectory its own length, padded and packed forms), one block per step file, only the
requested columns read, and examples/ray_stats.py's statistics equal the same figures computed from
``trajstore.Reader``.

Every test that reads a dump takes ``dump``: one parameter per place a dump can be (``URLS``);
object storage is one more entry there."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore.errors import ConfigError, FormatError
from trajstore.read.tables import step_rows
from trajstore.testing import packed_batches, padded_batches, trajectory_lists

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
import trajstore.ray as tray  # noqa: E402

pytestmark = [pytest.mark.heavy_readers,  # starts a Ray cluster
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    """A local Ray for this module (reused if one is running already), shut down at its end. Its idle
    workers are kept for both kinds of test (the S3 dump's reads run in workers of their own runtime
    environment): at Ray's default of one worker per CPU, each switch between them killed the other's
    workers and started new ones, several seconds each on two cores."""
    mine = not ray.is_initialized()
    if mine:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 _system_config={"num_workers_soft_limit": 8})
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    if mine:
        ray.shutdown()


# ----------------------------------------------------------------------------- the dump
def _padded(step: int, B: int, T: int = 12) -> dict[str, Any]:
    """A right-padded batch: bf16 log-probabilities and a bf16 per-trajectory score, a response mask
    inside the attention mask, a big per-token field (``hidden``), strings."""
    g = torch.Generator().manual_seed(100 + step)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T  # one trajectory fills the width
    m = torch.arange(T)[None] < lengths[:, None]
    resp = m & (torch.arange(T)[None] >= (lengths // 2)[:, None])
    lp = (-torch.rand(B, T, generator=g)).bfloat16().masked_fill(~m, 0)
    old = (lp.float() + torch.randn(B, T, generator=g) * 0.01).bfloat16().masked_fill(~m, 0)
    return {"input_ids": torch.randint(0, 1000, (B, T), generator=g).masked_fill(~m, 0),
            "attention_mask": m, "response_mask": resp.to(torch.int32), "logprobs": lp, "old_logprobs": old,
            "hidden": torch.randn(B, T, 16, generator=g).masked_fill(~m[..., None], 0),
            "rewards": torch.randn(B, generator=g), "score": torch.randn(B, generator=g).bfloat16(),
            "uid": [f"s{step}-t{i}" for i in range(B)]}


def _packed(step: int, B: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(200 + step)
    lengths = torch.randint(0, 9, (B,), generator=g)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    N = int(cu[-1])
    lp = (-torch.rand(N, generator=g)).bfloat16()
    return {"input_ids": torch.randint(0, 1000, (N,), generator=g, dtype=torch.int64).to(torch.int32),
            "logprobs": lp, "old_logprobs": (lp.float() + 0.001 * torch.randn(N, generator=g)).bfloat16(),
            "cu_seqlens": cu, "max_seqlen": int(lengths.max()), "rewards": torch.randn(B, generator=g)}


SPLITS = {"train": {0: _padded(0, 3), 1: _padded(1, 5), 4: _padded(4, 2)},
          "packed": {0: _packed(0, 4), 3: _packed(3, 1), 9: _packed(9, 6)}}


def _write(url: str) -> str:
    for split, steps in SPLITS.items():
        with trajstore.Writer(url, split=split) as w:
            for s, b in steps.items():
                w.append(s, b)
    return url


class Dump(NamedTuple):
    """Where a test's dump is, and what ``read_dump`` needs to read it there (Ray's workers started
    before the test: the environment of a store, e.g. ``{"runtime_env": {"env_vars": {...}}}``)."""

    url: str
    args: dict


def _s3(req: Any, lib: str) -> Dump:
    """A new dump URL on the test session's S3 server (``s3_server``, tests/conftest.py) through ``lib``
    (``TRAJSTORE_FS``: pyarrow or fsspec), its environment set here and given to Ray's workers."""
    server, mp = req.getfixturevalue("s3_server"), req.getfixturevalue("monkeypatch")
    env = {**server.env, "TRAJSTORE_FS": lib}
    for k, v in env.items():
        mp.setenv(k, v)
    return Dump(f"s3://{server.bucket()}/run", {"runtime_env": {"env_vars": env}})


# where a dump can be: a name -> (request -> Dump of a new, empty place): local disk, and the session's S3
# server through s3fs (tests/test_s3.py runs trajstore itself over both pyarrow's S3 and s3fs)
URLS = {"local": lambda req: Dump(str(req.getfixturevalue("tmp_path") / "dump"), {}),
        "s3": lambda req: _s3(req, "fsspec")}


@pytest.fixture(params=list(URLS))
def dump(request) -> Dump:
    d = URLS[request.param](request)
    _write(d.url)
    return d


# ----------------------------------------------------------------------------- comparisons
def _same(got: Any, want: Any, where: str) -> None:
    """Exactly equal: arrays of one dtype and shape with the same bytes, scalars of the same value
    (Ray gives a numeric column's values as Python numbers)."""
    if isinstance(want, np.ndarray):
        got = np.asarray(got)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert got.tobytes() == want.tobytes(), where
    elif isinstance(want, np.generic):  # a Python number (a float32 NaN's payload may not survive it)
        assert np.asarray(got).astype(want.dtype).tobytes() == np.asarray(want).tobytes() or (
            np.isnan(want) and np.isnan(got)), where
    else:
        assert got == want and type(got) is type(want), where


def _by_key(rows: list[dict]) -> dict[tuple[int, int], dict]:
    out = {(r["step"], r["index"]): r for r in rows}
    assert len(out) == len(rows), "two rows of one trajectory"
    return out


def _assert_rows_equal(url: str, split: str, got: list[dict], columns: list[str] | None = None,
                       steps: list[int] | None = None) -> None:
    """``got`` (Ray's rows) are the trajectories of trajstore's own reader of the dump at ``url``,
    nothing more or less."""
    r = trajstore.Reader(url, split)
    got = _by_key(got)
    n = 0
    for s in r.steps if steps is None else steps:
        for i, want in enumerate(step_rows(r, s)):
            row = got[(s, i)]
            n += 1
            assert row["rejected"] is (want is None)
            if want is None:
                continue
            if columns is not None:
                want = {k: v for k, v in want.items() if k.split(".")[0] in columns}
            fields = {k: v for k, v in row.items() if k not in tray.BASE and v is not None}
            assert sorted(fields) == sorted(want), (s, i)
            for k, v in want.items():
                _same(fields[k], v, f"step {s} trajectory {i} field {k}")
    assert n == len(got), "rows of steps not asked for"


# ----------------------------------------------------------------------------- rows
@pytest.mark.parametrize("split", list(SPLITS))
def test_rows_equal_the_reader(dump, split):
    ds = tray.read_dump(dump.url, None if split == "train" else split, **dump.args)
    rows = ds.take_all()
    _assert_rows_equal(dump.url, split, rows)
    assert len(rows) == sum(len(b["rewards"]) for b in SPLITS[split].values())
    # per-sample shapes and real bf16 numbers, against the batches appended (not through trajstore)
    got = _by_key(rows)
    for s, b in SPLITS[split].items():
        if "attention_mask" in b:
            cuts = [b["attention_mask"][i] for i in range(len(b["rewards"]))]
            tok = [lambda f, i=i, c=c: b[f][i][c] for i, c in enumerate(cuts)]
        else:
            cu = b["cu_seqlens"].tolist()
            tok = [lambda f, i=i: b[f][cu[i]:cu[i + 1]] for i in range(len(b["rewards"]))]
        for i, cut in enumerate(tok):
            row = got[(s, i)]
            lp = row["logprobs"]
            assert lp.dtype == np.float32 and lp.shape == (len(cut("input_ids")),)
            assert np.array_equal(lp, cut("logprobs").float().numpy())
            assert np.array_equal(row["input_ids"], cut("input_ids").numpy())
            assert row["rewards"] == float(b["rewards"][i])
            if "score" in b:
                assert row["score"] == float(b["score"][i].float())  # bf16 -> its value as a float
                assert row["hidden"].shape == (len(cut("input_ids")), 16)
                assert row["uid"] == b["uid"][i]


def test_columns_and_steps(dump):
    ds = tray.read_dump(dump.url, columns=["logprobs", "rewards"], steps=[1, 4, 7], **dump.args)
    assert ds.schema().names == [*tray.BASE, "logprobs", "rewards"]
    rows = ds.take_all()
    assert {r["step"] for r in rows} == {1, 4}  # 7 is not in the split
    _assert_rows_equal(dump.url, "train", rows, ["logprobs", "rewards"], steps=[1, 4])
    rows = tray.read_dump(dump.url, "packed", columns=["old_logprobs"], steps="3-9", **dump.args).take_all()
    _assert_rows_equal(dump.url, "packed", rows, ["old_logprobs"], steps=[3, 9])
    assert not any("cu_seqlens" in r or "input_ids" in r for r in rows)


def test_one_block_per_step_file(dump):
    ds = tray.read_dump(dump.url, "train", columns=["rewards"], **dump.args).materialize()
    steps = trajstore.Reader(dump.url, "train").steps
    assert ds.num_blocks() == len(steps) == 3
    # batch_size=None: each block is one batch
    per = ds.map_batches(lambda b: {"steps": np.array([len(set(b["step"].tolist()))]), "step": b["step"][:1],
                                    "n": np.array([len(b["step"])])}, batch_size=None).take_all()
    assert {p["steps"] for p in per} == {1}  # each block: one step file's rows, all of them
    assert sorted((p["step"], p["n"]) for p in per) == [(s, len(SPLITS["train"][s]["rewards"])) for s in steps]


# ----------------------------------------------------------------------------- projection
def _damage_column(f: Path, column: str) -> None:
    """Overwrite the middle of every page of ``column`` in step file ``f`` (footer intact): a read of
    that column fails its page checksums, a read of the others does not notice."""
    md = pq.read_metadata(f)
    raw = bytearray(f.read_bytes())
    hit = 0
    for g in range(md.num_row_groups):
        for j in range(md.num_columns):
            c = md.row_group(g).column(j)
            if c.path_in_schema.split(".")[0] != column:
                continue
            lo = c.dictionary_page_offset or c.data_page_offset
            n = c.total_compressed_size
            raw[lo + n // 4: lo + 3 * n // 4] = bytes(3 * n // 4 - n // 4)
            hit += 1
    assert hit, f"{f} has no column {column}"
    f.chmod(0o644)
    f.write_bytes(bytes(raw))


def test_only_the_requested_columns_are_read(tmp_path):
    url = _write(str(tmp_path / "dump"))
    intact = shutil.copytree(url, tmp_path / "intact")
    for f in sorted((Path(url) / "train").glob("step_*.parquet")):
        _damage_column(f, "hidden")  # the big per-token field
    with pytest.raises(FormatError):  # the damage is real: reading it fails
        trajstore.Reader(url).read(0, columns=["hidden"])
    ds = tray.read_dump(url, columns=["logprobs", "rewards", "uid"])
    assert ds.schema().names == [*tray.BASE, "logprobs", "rewards", "uid"]
    _assert_rows_equal(str(intact), "train", ds.take_all(), ["logprobs", "rewards", "uid"])
    # all columns: the damaged one too
    with pytest.raises(Exception, match=r"ChecksumError: \S*step_0000000\d\.parquet: reading step \d failed"):
        tray.read_dump(url).take_all()
    # verify=True: each file is checked whole against its recorded SHA-256 first, whatever is read
    assert len(tray.read_dump(str(intact), columns=["rewards"], verify=True).take_all()) == 10
    with pytest.raises(Exception, match=r"ChecksumError: .*step_0000000\d\.parquet"):
        tray.read_dump(url, columns=["rewards"], verify=True).take_all()


def test_a_per_token_field_is_cut_by_its_mask_even_when_the_mask_is_not_asked_for(tmp_path):
    url = _write(str(tmp_path / "dump"))
    rows = _by_key(tray.read_dump(url, columns=["hidden"], steps=[1]).take_all())
    b = SPLITS["train"][1]
    for i in range(len(b["rewards"])):
        assert np.array_equal(rows[(1, i)]["hidden"], b["hidden"][i][b["attention_mask"][i]].numpy())
        assert "attention_mask" not in rows[(1, i)]


# ----------------------------------------------------------------------------- round trips
@settings(max_examples=20)
@given(st.one_of(padded_batches(max_batch=4), packed_batches(max_batch=4),
                trajectory_lists(max_batch=4).filter(lambda b: None not in b)))
def test_any_batch_reads_as_the_reader_reads_it(tmp_path_factory, batch):
    url = str(tmp_path_factory.mktemp("hyp") / "dump")
    with trajstore.Writer(url) as w:
        w.append(2, batch)
        w.append(5, batch)
    _assert_rows_equal(url, "train", tray.read_dump(url).take_all())


def test_a_step_of_shards_is_one_block_per_shard_file(tmp_path, example):
    """A step written by N ranks: one read task and block per shard file, each shard's rows with its
    ``rank``; (rank, index) orders the logical batch, whose statistics the example computes."""
    sizes = {0: [3, 1, 2], 2: [2, 2, 2]}
    for r in range(3):
        with trajstore.Writer(tmp_path, rank=r, world_size=3) as w:
            for s, n in sizes.items():
                w.append(s, _padded(10 * s + r, n[r]))
    ds = tray.read_dump(tmp_path).materialize()
    assert ds.num_blocks() == 6
    per = ds.map_batches(lambda b: {"files": np.array([len(set(zip(b["step"].tolist(), b["rank"].tolist())))]),
                                    "step": b["step"][:1], "rank": b["rank"][:1], "n": np.array([len(b["step"])])},
                         batch_size=None).take_all()
    assert {p["files"] for p in per} == {1}  # each block: one shard file's rows, all of them
    assert sorted((p["step"], p["rank"], p["n"]) for p in per) == [(s, r, n[r]) for s, n in sizes.items()
                                                                   for r in range(3)]
    rows = ds.take_all()
    r = trajstore.Reader(tmp_path)
    for s in sizes:
        order = sorted((x for x in rows if x["step"] == s), key=lambda x: (x["rank"], x["index"]))
        want = step_rows(r, s)  # the logical batch: the shards joined in rank order
        assert len(order) == len(want) == sum(sizes[s])
        for got, w in zip(order, want):
            for k, v in w.items():
                _same(got[k], v, f"step {s} rank {got['rank']} index {got['index']} field {k}")
    got = example.step_stats(str(tmp_path), mask="response_mask")
    assert got == _reference(str(tmp_path), "train", "response_mask")


def test_rejected_trajectories(tmp_path):
    """A list batch's ``None`` trajectory: a row with ``rejected`` True and no values. Ray's tensor
    columns hold no nulls, so in such a step a tensor field is a list column of the same values."""
    def traj(n, seed):
        g = torch.Generator().manual_seed(seed)
        return {"input_ids": torch.randint(0, 100, (n,), generator=g),
                "logprobs": torch.randn(n, generator=g).bfloat16(),
                "attention_mask": torch.ones(n, dtype=torch.bool), "rewards": torch.randn(1, generator=g)}
    with trajstore.Writer(tmp_path) as w:
        w.append(0, [traj(3, 0), None, traj(0, 1), traj(5, 2)])
        w.append(1, [traj(2, 3), traj(4, 4)])
    rows = _by_key(tray.read_dump(tmp_path).take_all())
    r = trajstore.Reader(tmp_path)
    assert [rows[(0, i)]["rejected"] for i in range(4)] == [False, True, False, False]
    assert rows[(0, 1)]["input_ids"] is None and rows[(0, 1)]["logprobs"] is None
    for s in r.steps:
        for i, want in enumerate(step_rows(r, s)):
            for k, v in (want or {}).items():
                got = np.asarray(rows[(s, i)][k], dtype=v.dtype)
                assert got.shape == v.shape and got.tobytes() == v.tobytes(), (s, i, k)


# ----------------------------------------------------------------------------- errors
def test_errors(dump):
    with pytest.raises(ConfigError, match="list of field names"):
        tray.read_dump(dump.url, columns="rewards")
    with pytest.raises(ConfigError, match="none of these steps"):
        tray.read_dump(dump.url, steps=[2, 3])
    # in the read task (Ray raises its own error, with trajstore's message and the step's file)
    with pytest.raises(Exception, match=r"step_00000000\.parquet: step 0 has no field 'nope'"):
        tray.read_dump(dump.url, columns=["rewards", "nope"], steps=[0], **dump.args).take_all()
    with pytest.raises(trajstore.errors.DumpNotFoundError):
        tray.read_dump(dump.url, "val")


def test_a_field_named_like_a_row_column_keeps_its_values_under_another_name(tmp_path):
    with trajstore.Writer(tmp_path) as w:  # OpenRLHF's Experience has an `index` field
        w.append(0, {"index": torch.arange(3) + 10, "rewards": torch.zeros(3)})
    rows = tray.read_dump(tmp_path).take_all()
    assert [r["index"] for r in rows] == [0, 1, 2] and [r["index_field"] for r in rows] == [10, 11, 12]
    df = trajstore.Reader(tmp_path).to_pandas()  # the same rule as to_pandas
    assert list(df["index"]) == [0, 1, 2] and list(df["index_field"]) == [10, 11, 12]
    assert [r["rewards"] for r in tray.read_dump(tmp_path, columns=["rewards"]).take_all()] == [0.0] * 3


# ----------------------------------------------------------------------------- the example
@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("ray_stats_example", ROOT / "examples" / "ray_stats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reference(url: str, split: str, mask: str | None) -> list[dict]:
    """examples/ray_stats.py's figures, from trajstore.Reader's batches, cut by their own layout."""
    out = []
    r = trajstore.Reader(url, split)
    for s in r.steps:
        b = r[s]
        B = len(b["rewards"])
        if "cu_seqlens" in b:
            cu = b["cu_seqlens"].tolist()
            cut = [slice(cu[i], cu[i + 1]) for i in range(B)]
            take = [lambda f, c=c: b[f][c] for c in cut]
        else:
            take = [lambda f, i=i: b[f][i][b["attention_mask"][i]] for i in range(B)]
        lengths, sums, maxes = [], [], []
        for t in take:
            m = torch.ones(len(t("input_ids")), dtype=torch.bool) if mask is None else t(mask) != 0
            d = (t("old_logprobs").double() - t("logprobs").double()).abs()[m].numpy()
            lengths.append(int(m.sum()))
            sums.append(float(d.sum()))
            maxes.append(float(d.max()) if d.size else 0.0)
        if not B:
            continue
        tokens = sum(lengths)
        out.append({"step": s, "trajectories": B, "reward_mean": float(np.mean(b["rewards"].double().numpy())),
                    "length_mean": float(np.mean(lengths)), "length_max": max(lengths), "tokens": tokens,
                    "mismatch_mean": float(np.sum(sums) / tokens) if tokens else math.nan,
                    "mismatch_max": max(maxes) if tokens else math.nan})
    return out


# the example's figures on the local dump; on S3 the documented command is run (test_example_command):
# each Ray Data pipeline costs several seconds on two cores
@pytest.mark.parametrize("dump", ["local"], indirect=True)
@pytest.mark.parametrize("split, mask", [("train", "response_mask"), ("train", None), ("packed", None)])
def test_example_statistics_equal_the_readers(dump, example, split, mask):
    got = example.step_stats(dump.url, split, mask=mask, **dump.args)
    want = _reference(dump.url, split, mask)
    assert [g["step"] for g in got] == [w["step"] for w in want] == sorted(SPLITS[split])
    for g, w in zip(got, want):
        assert list(g) == example.STATS
        for k in example.STATS:
            assert g[k] == w[k] or (math.isnan(g[k]) and math.isnan(w[k])), (g["step"], k, g[k], w[k])
    assert any(g["mismatch_mean"] > 0 for g in got)  # the fields differ: a mismatch of 0 would prove nothing


@pytest.mark.parametrize("dump", ["local"], indirect=True)
def test_example_without_a_mismatch_pair(dump, example):
    got = example.step_stats(dump.url, "packed", logprobs=None, **dump.args)
    assert [g["step"] for g in got] == sorted(SPLITS["packed"])
    assert all(math.isnan(g["mismatch_mean"]) for g in got)
    assert [g["tokens"] for g in got] == [int(b["cu_seqlens"][-1]) for b in SPLITS["packed"].values()]


@pytest.mark.parametrize("dump", ["s3"], indirect=True)
def test_example_command(dump, example):
    """The documented command, in a process of its own (a Ray of its own): its JSON lines are
    step_stats's figures. Run on the S3 dump (its credentials come from the environment); the
    local dump's figures are checked in this process above (a command starts a Ray of its own)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "ray_stats.py"), dump.url, "--split", "train",
                        "--mask", "response_mask", "--num-cpus", "1", "--json"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = [json.loads(line) for line in p.stdout.splitlines()]
    assert got == example.step_stats(dump.url, "train", mask="response_mask", **dump.args)
    assert [g["step"] for g in got] == sorted(SPLITS["train"])
