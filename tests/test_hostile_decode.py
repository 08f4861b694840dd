"""Hostile dumps (issue 17): every allocation a decode makes is bounded before it is made, the
writer refuses what its reader would refuse, and whatever pyarrow, the OS or the JSON parser
raise on a damaged dump reaches the user as a TrajstoreError naming the file.

The memory cases are files of a few KB that decode to GBs. Each is read in a child process
under ``resource.setrlimit(RLIMIT_AS)``: it must raise a FormatError naming the file and the
knob (``TRAJSTORE_MAX_DECODED_BYTES``) with its peak RSS barely above what the imports take (the
process stays alive: no MemoryError, no ArrowMemoryError). docs/RELIABILITY.md ("Memory and
decoding") quotes these figures.
"""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trajstore
from trajstore import cli
from trajstore.errors import BatchError, FormatError, TrajstoreError
from trajstore.format import limits
from trajstore.inspection.describe import describe
from trajstore.store import checksums, paths
from trajstore.testing import assert_batch_equal

CAP = 4 << 30  # the child's address space
GROWTH = 96 << 20  # what a refused read may add to the child's peak RSS

_CHILD = textwrap.dedent("""
    import json, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
    import pandas, torch  # loaded before the first peak: the package root loads them lazily
    import trajstore
    import trajstore.read.reader
    from trajstore.format import limits
    from trajstore.inspection.describe import describe

    def peak():
        return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024

    for dump, limit, what in json.loads(sys.argv[1]):
        limits.MAX_DECODED_BYTES = limit
        base, out = peak(), {{}}
        try:
            if what == "info":
                describe(dump)
            else:
                trajstore.Reader(dump).read(0)
            out["result"] = "decoded"
        except trajstore.TrajstoreError as e:
            out["result"], out["error"] = type(e).__name__, str(e)
        except BaseException as e:  # MemoryError, ArrowMemoryError...: what must not happen
            out["result"], out["error"] = "raw " + type(e).__name__, str(e)[:300]
        out["base"], out["peak"] = base, peak()
        print(json.dumps(out), flush=True)
""")


def _children(cases: list) -> list[dict]:
    """Read each ``(dump, limit, "read" | "info")`` in one child process capped at ``CAP`` bytes."""
    p = subprocess.run([sys.executable, "-c", _CHILD.format(cap=CAP), json.dumps([[str(d), n, w] for d, n, w in cases])],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return [json.loads(line) for line in p.stdout.strip().splitlines()[-len(cases):]]


def _assert_refused(got: dict, f: Path) -> None:
    assert got["result"] == "FormatError", got
    assert str(f) in got["error"] and limits.KNOB in got["error"], got["error"]
    assert got["peak"] - got["base"] < GROWTH, f"peak RSS grew by {(got['peak'] - got['base']) >> 20} MiB"


def _doc(f: Path) -> dict:
    return json.loads(pq.ParquetFile(f).schema_arrow.metadata[b"trajstore"])


def _write(f: Path, doc: dict, tables, **kw) -> None:
    """Write ``tables`` (one row group each) as step file ``f`` described by ``doc``, and sign it."""
    schema = tables[0].schema.with_metadata({b"trajstore": json.dumps(doc).encode()})
    with pq.ParquetWriter(f, schema, compression="zstd", **kw) as w:
        for t in tables:
            w.write_table(t.cast(schema))
    checksums.sum_path(f).write_text(checksums.sum_line(checksums.file_sha256(f), f.name))


def _one_step(root: Path, batch) -> Path:
    with trajstore.Writer(root) as w:
        w.append(0, batch)
    return root / "train" / paths.step_name(0)


# ----------------------------------------------------------------------------- memory
def _zero_width(root: Path) -> Path:
    """A [B, T, 0] token field with T = 10**9: no values, but a [B, T] mask (and arange(T))."""
    f = _one_step(root, {"input_ids": torch.ones(2, 4, dtype=torch.int64),
                                   "attention_mask": torch.ones(2, 4, dtype=torch.int64), "z": torch.ones(2, 4, 0)})
    doc = _doc(f)
    doc["batch"]["T"] = 10**9
    doc["batch"]["keys"] = [kv for kv in doc["batch"]["keys"] if kv[0] == "z"]
    _write(f, doc, [pq.read_table(f)])
    assert f.stat().st_size < 8 << 10
    return f


def test_sample_field_counts_its_values(tmp_path, monkeypatch):
    """A sample field's values can compress to nothing (zstd over dictionary indices: 24 rows of
    64 Mi zero int8s are a few KB); the spec says how many there are, so they are counted before
    pyarrow reads the column."""
    f = _one_step(tmp_path / "d", {"x": torch.zeros(24, 4, dtype=torch.int8)})
    doc = _doc(f)
    dict(doc["batch"]["keys"])["x"]["trail"] = [64 << 20]
    _write(f, doc, [pq.read_table(f)])
    monkeypatch.setattr(limits, "MAX_DECODED_BYTES", 1 << 30)
    for call in (lambda: trajstore.Reader(tmp_path / "d").read(0), lambda: describe(tmp_path / "d")):
        with pytest.raises(FormatError, match=f"{f.name}.*'x' of 24 rows of \\[67108864\\].*{limits.KNOB}"):
            call()


def _string_bomb(root: Path) -> Path:
    """A string field whose rows hold 32 MiB of NULs each, stored PLAIN: 4 rows are 128 MiB once
    decompressed, a few KB of zstd; the row groups' uncompressed sizes are summed before pyarrow
    decompresses (the spec cannot tell a string's length)."""
    f = _one_step(root, {"rewards": torch.zeros(1), "uid": ["a"]})
    doc, schema = _doc(f), pq.read_schema(f)
    doc["num_rows"] = doc["batch"]["B"] = 4
    t = pa.table({"step": pa.array([0], pa.int64()), "rewards": pa.array([0.0], pa.float32()),
                  "uid": pa.array(["\0" * (32 << 20)])})
    _write(f, doc, [t.select(schema.names)] * 4, use_dictionary=False)
    assert f.stat().st_size < 256 << 10
    return f


def _many_rows(root: Path) -> Path:
    """2 * 10**6 rows of a list batch compress to almost nothing; each decodes to a dict (and a value)."""
    n = 2 * 10**6
    f = _one_step(root, [{"ids": torch.arange(2), "a": 1}])
    doc = _doc(f)
    doc["num_rows"] = n
    doc["batch"]["elem"]["keys"] = [kv for kv in doc["batch"]["elem"]["keys"] if kv[0] == "a"]
    t = pa.table({"step": pa.array(np.zeros(n, np.int64)), "a": pa.array(np.zeros(n))})
    _write(f, doc, [t])
    assert f.stat().st_size < 1 << 20
    return f


def test_memory_bombs_are_refused_before_they_allocate(tmp_path):
    """Each file, read (and described, as `trajstore info` does) under a 4 GiB address space:
    FormatError naming the file and the knob, the peak RSS barely moved. The limits are set so
    that only the bound under test can refuse the file (the others let it through)."""
    cases = {  # name: (file, limit, what, words of the error)
        "zero_width": (_zero_width(tmp_path / "zw"), 1 << 20, "read", "padded to \\[2, 1000000000\\]"),
        "zero_width_info": (tmp_path / "zw/train" / paths.step_name(0), 1 << 20, "info", "padded to"),
        "string_bomb": (_string_bomb(tmp_path / "sb"), 16 << 20, "read", "row group"),
        "many_rows": (_many_rows(tmp_path / "mr"), 256 << 20, "read", "rows of a per-trajectory"),
    }
    got = _children([(c[0].parent.parent, c[1], c[2]) for c in cases.values()])
    for (name, (f, _, _, words)), g in zip(cases.items(), got):
        _assert_refused(g, f)
        assert re.search(words, g["error"]), (name, g["error"])


def test_layout_conversion_counts_its_padded_outputs(tmp_path, monkeypatch):
    """A packed step of 2,000 rows, one of 1,000 tokens, read padded: 2000 x 1000 per field."""
    lens = [1000] + [0] * 1999
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, {"input_ids": torch.arange(1000), "cu_seqlens": cu})
    r = trajstore.Reader(tmp_path / "d")
    monkeypatch.setattr(limits, "MAX_DECODED_BYTES", 4 << 20)
    r.read(0)  # as stored: within the limit
    with pytest.raises(FormatError, match=f"{r.file(0).name}.*padded to \\[2000, 1000\\].*{limits.KNOB}"):
        r.read(0, layout="padded")


def test_description_size_is_bounded(tmp_path, monkeypatch):
    f = _one_step(tmp_path / "d", {"rewards": torch.ones(3)})
    doc = _doc(f)
    doc["meta"] = {"pad": "x" * (200 << 10)}
    _write(f, doc, [pq.read_table(f)])
    monkeypatch.setattr(limits, "MAX_DECODED_BYTES", 1 << 20)
    with pytest.raises(FormatError, match=f"{f.name}.*description.*{limits.KNOB}"):
        trajstore.Reader(tmp_path / "d").read(0)
    monkeypatch.setattr(limits, "MAX_DECODED_BYTES", 16 << 20)
    assert trajstore.Reader(tmp_path / "d").meta(0)["pad"] == "x" * (200 << 10)


def test_grouped_rows_count_their_masks(tmp_path, monkeypatch):
    """A list batch's [g, T, 0] token cell stored by runs: nothing to store, a [g, T] mask to build."""
    am = torch.ones(2, 6, dtype=torch.bool)
    am[1, 3:] = False
    b = [{"input_ids": torch.ones(2, 6, dtype=torch.int64), "attention_mask": am, "z": torch.ones(2, 6, 0)}]
    f = _one_step(tmp_path / "d", b)
    assert_same = trajstore.Reader(tmp_path / "d")[0][0]["z"].shape == (2, 6, 0)
    doc, t = _doc(f), pq.read_table(f)
    z = dict(doc["batch"]["elem"]["keys"])["z"]
    if "runs" not in z:
        pytest.skip("this batch form is not stored by runs")
    i = t.schema.get_field_index(z["shape_col"])
    t = t.set_column(i, t.schema.field(i), pa.array([[2, 10**9, 0]], t.schema.field(i).type))
    _write(f, doc, [t])
    monkeypatch.setattr(limits, "MAX_DECODED_BYTES", 1 << 20)
    assert assert_same
    with pytest.raises(FormatError, match=f"{f.name}.*{limits.KNOB}"):
        trajstore.Reader(tmp_path / "d").read(0)


# ----------------------------------------------------------------------------- one set of limits
def _nest(depth: int, v=None):
    v = torch.ones(2) if v is None else v
    for _ in range(depth - 1):
        v = {"k": v}
    return v


@pytest.mark.parametrize("form", ["dict", "list"])
def test_depth_limit_is_the_same_for_writer_and_reader(tmp_path, form):
    """The deepest field the writer accepts reads back; one level more is refused at append,
    naming the field and the limit (it used to be committed, then refused as damaged)."""
    deepest = limits.MAX_SPEC_DEPTH - (1 if form == "list" else 0)  # a list batch's row is a level

    def batch(d):
        return {"x": _nest(d)} if form == "dict" else [{"ids": torch.ones(2), "x": _nest(d)}, None]

    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, batch(deepest))
        with pytest.raises(BatchError, match=f"field 'x(\\.k)+' nests {limits.MAX_SPEC_DEPTH + 1} levels.*"
                                             f"limit of {limits.MAX_SPEC_DEPTH}"):
            w.append(1, batch(deepest + 1))
    got = trajstore.Reader(tmp_path / "d")
    assert got.steps == [0]
    x = got[0]["x"] if form == "dict" else got[0][0]["x"]
    for _ in range(deepest - 1):
        x = x["k"]
    assert torch.equal(x, torch.ones(2))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(limits.MAX_SPEC_DEPTH - 2, limits.MAX_SPEC_DEPTH + 2) | st.integers(1, limits.MAX_SPEC_DEPTH),
       dims=st.integers(limits.MAX_DIMS - 1, limits.MAX_DIMS + 2) | st.integers(1, limits.MAX_DIMS),
       form=st.sampled_from(["dict", "list"]))
def test_what_append_accepts_reads_back(tmp_path_factory, depth, dims, form):
    """Fields at any depth, tensors of any rank: append refuses (BatchError) or the step reads back."""
    leaf = torch.arange(2.0).reshape([2] + [1] * (dims - 1))
    batch = {"x": _nest(depth, leaf)} if form == "dict" else [{"ids": torch.ones(2), "x": _nest(depth, leaf)}]
    d = tmp_path_factory.mktemp("any")
    with trajstore.Writer(d) as w:
        try:
            w.append(0, batch)
        except BatchError as e:
            assert "over the limit" in str(e)
            return
    got = trajstore.Reader(d)[0]
    assert_batch_equal(got, batch)


def test_dimension_limit_is_the_same_for_writer_and_reader(tmp_path):
    """A field of 32 dimensions reads back; 33 are refused at append (a sample field's shape past its
    first dimension used to be committed at 33, then refused by the reader)."""
    x = torch.arange(6.0).reshape([2, 3] + [1] * (limits.MAX_DIMS - 2))
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, {"x": x})
        with pytest.raises(BatchError, match=f"'x' has {limits.MAX_DIMS + 1} dimensions.*limit of {limits.MAX_DIMS}"):
            w.append(1, {"x": x[..., None]})
    assert torch.equal(trajstore.Reader(tmp_path / "d")[0]["x"], x)


# ----------------------------------------------------------------------------- foreign errors
@pytest.fixture
def small_dump(tmp_path):
    b = {"input_ids": torch.arange(12).reshape(3, 4), "attention_mask": torch.ones(3, 4, dtype=torch.int64),
         "rewards": torch.randn(3)}
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, b)
        w.append(1, b)
    return tmp_path / "d"


def _cli(capsys, *args) -> tuple[int, str]:
    """``trajstore ARGS`` run in this process: its exit status and what it wrote to stderr."""
    capsys.readouterr()
    rc = cli.main([str(a) for a in args])
    return rc, capsys.readouterr().err


def test_environment_that_is_not_an_object(small_dump, capsys):
    m = small_dump / "trajstore.json"
    doc = json.loads(m.read_text())
    doc["environment"] = [1, 2]
    m.write_text(json.dumps(doc))
    for call in (lambda: trajstore.Reader(small_dump),
                 lambda: trajstore.Recorder(trajstore.DumpReplayConfig(replay=True, path=str(small_dump))),
                 lambda: trajstore.verify(small_dump)):
        with pytest.raises(FormatError, match="trajstore.json.*environment"):
            call()
    rc, err = _cli(capsys, "info", small_dump)
    assert rc == 2 and "Traceback" not in err and "environment" in err, err


def test_zeroed_footer_bytes_every_entry_point(small_dump, capsys):
    """Zeroed bytes in the footer (the thrift the Parquet parser reads): every entry point raises a
    TrajstoreError naming the file; the CLI exits 2 without a traceback."""
    f = small_dump / "train" / paths.step_name(0)
    data = bytearray(f.read_bytes())
    end = len(data) - 8 - int.from_bytes(data[-8:-4], "little")  # where the footer starts
    data[end + 8:end + 24] = bytes(16)
    f.write_bytes(bytes(data))
    r = trajstore.Reader(small_dump)
    for call in (lambda: r.read(0), lambda: r.meta(0), lambda: r.info(0), lambda: r.column("rewards"),
                 lambda: list(r.iter()), lambda: describe(small_dump),
                 lambda: trajstore.Recorder(trajstore.DumpReplayConfig(replay=True, path=str(small_dump))).load(0)):
        with pytest.raises(TrajstoreError, match=f.name):
            call()
    assert trajstore.verify(small_dump, deep=True).damaged
    for args in (("info", small_dump), ("export", small_dump)):
        rc, err = _cli(capsys, *args)
        assert rc == 2 and "Traceback" not in err and f.name in err, (args, err)
