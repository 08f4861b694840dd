"""Corrupt and hostile step files: every case raises a TrajstoreError naming the file.

Byte-level mutations (flipped bits, truncation, garbage footers, wrong magic, inserted or deleted
bytes) and spec-level lies (a re-signed file whose description is mutated) over every batch form.
With verify=True (the default) every byte-level change is caught by the checksum; with
verify=False the decoder itself must never crash, hang or raise anything but a TrajstoreError.
"""

import copy
import faulthandler
import json
import os
import shutil

import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import trajstore
from trajstore.store import checksums, paths
from trajstore.format import limits as _limits
from trajstore.format.spec import MANIFEST_VERSION
from trajstore.errors import ChecksumError, FormatError, FormatVersionError, TrajstoreError
from trajstore.testing import assert_batch_equal, multimodal_batches

FIGURES: dict[str, int] = {}
DOCS: dict[int, dict] = {}  # each step's original description, read once
SCALE = int(os.environ.get("TRAJSTORE_FUZZ_SCALE", "1"))  # long runs: TRAJSTORE_FUZZ_SCALE=20


def _count(key: str) -> None:
    FIGURES[key] = FIGURES.get(key, 0) + 1


def _batches():
    g = torch.Generator().manual_seed(0)
    mask = torch.arange(10)[None, :] < torch.tensor([10, 3, 7, 0])[:, None]
    padded = {"input_ids": torch.randint(0, 1000, (4, 10), generator=g).masked_fill(~mask, 0),
              "attention_mask": mask.to(torch.int64),
              "logprobs": torch.randn(4, 10, generator=g).masked_fill(~mask, 0).to(torch.bfloat16),
              "topk": torch.randn(4, 10, 2, generator=g), "rewards": torch.randn(4, generator=g),
              "uid": ["a", "b", "c", "d"], "temperature": 0.7, "scalar": torch.tensor(3.0)}
    packed = {"input_ids": torch.arange(12), "cu_seqlens": torch.tensor([0, 5, 5, 12], dtype=torch.int32),
              "logprobs": torch.randn(12, generator=g), "rewards": torch.randn(3, generator=g)}
    rows = [{"input_ids": torch.arange(5), "attention_mask": torch.ones(5, dtype=torch.bool),
             "uid": "x", "info": {"k": [1, 2]}}, None,
            {"input_ids": torch.arange(2), "attention_mask": torch.ones(2, dtype=torch.bool),
             "uid": "y", "info": {"k": []}}]
    mm = multimodal_batches().example() if False else {
        "input_ids": torch.ones(2, 3, dtype=torch.int64), "attention_mask": torch.ones(2, 3, dtype=torch.bool),
        "pixel_values": [torch.randn(2, 2, generator=g).half(), torch.randn(0, 2).half()],
        "multi_modal_input": [{"pixel_values": torch.randn(1, 4, generator=g)}, {"pixel_values": torch.randn(3, 4)}]}
    import numpy as np
    nt = {"rewards": torch.randn(3, generator=g), "uid": np.array(["u0", "u1", "u2"]),
          "obj": np.array([{"a": 1}, None, [1, "x"]], dtype=object), "flag": True}
    o2 = np.empty((3, 2), dtype=object)
    o2[:] = [[np.int64(7), (1, "a")], [{3: b"x"}, None], [np.datetime64("2024-01-01"), torch.ones(2)]]
    typed = {"rewards": torch.randn(3, generator=g), "o2": o2, "when": np.array(["2024", "NaT", "1970"], dtype="M8[D]"),
             "vals": [(1, 2), {1: np.float32(0.5)}, b"raw"], "wide": {0: np.float16(1.5)}, "s": np.float32(1.25)}
    ar = torch.arange(9)
    am = (ar >= torch.tensor([2, 0, 4])[:, None]) & (ar < torch.tensor([6, 9, 4])[:, None])  # both sides
    verl = {"prompts": torch.randint(0, 99, (3, 4), generator=g),
            "responses": torch.randint(0, 99, (3, 5), generator=g),
            "attention_mask": am.to(torch.int64), "old_log_probs": torch.randn(3, 5, generator=g) * am[:, 4:]}
    cm = torch.arange(5)[None, :] < torch.tensor([5, 1, 3])[:, None]
    trl = {"prompt_ids": torch.randint(0, 99, (3, 3), generator=g), "prompt_mask": torch.ones(3, 3, dtype=torch.int64),
           "completion_ids": torch.randint(0, 99, (3, 5), generator=g), "completion_mask": cm.to(torch.int64),
           "old_per_token_logps": torch.randn(3, 5, generator=g).to(torch.bfloat16)}
    return [padded, packed, rows, mm, nt, typed, verl, trl]


BATCHES = _batches()


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    p = tmp_path_factory.mktemp("corrupt") / "d"
    with trajstore.Writer(p) as w:
        for i, b in enumerate(BATCHES):
            w.append(i, b, meta={"i": i})
    r = trajstore.Reader(p)
    for i, b in enumerate(BATCHES):
        assert_batch_equal(r[i], b)
    return p


@pytest.fixture(scope="module", autouse=True)
def _figures():
    yield
    out = os.environ.get("TRAJSTORE_FUZZ_FIGURES")  # the counts reported in docs/RELIABILITY.md
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(FIGURES) + "\n")


class _Restore:
    def __init__(self, f):
        self.f, self.orig, self.side = f, f.read_bytes(), checksums.sum_path(f).read_bytes()

    def __enter__(self):
        faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the run instead of stalling it
        return self

    def __exit__(self, *exc):
        faulthandler.cancel_dump_traceback_later()
        self.f.write_bytes(self.orig)
        checksums.sum_path(self.f).write_bytes(self.side)


# ----------------------------------------------------------------------------- byte-level
positions = st.integers(0, 2**31)
mutations = st.one_of(
    st.tuples(st.just("flip"), st.lists(st.tuples(positions, st.integers(0, 7)), min_size=1, max_size=8)),
    st.tuples(st.just("truncate"), positions),
    st.tuples(st.just("garbage_footer"), st.binary(min_size=1, max_size=80)),
    st.tuples(st.just("magic"), st.sampled_from(["head", "tail", "both"]), st.binary(min_size=4, max_size=4)),
    st.tuples(st.just("overwrite"), positions, st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("insert"), positions, st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), positions, st.integers(1, 64)),
    st.tuples(st.just("zero_tail"), st.integers(1, 4096)),
)


def mutate(data: bytes, m) -> bytes:
    b, kind = bytearray(data), m[0]
    n = len(b)
    if kind == "flip":
        for pos, bit in m[1]:
            b[pos % n] ^= 1 << bit
    elif kind == "truncate":
        del b[m[1] % n:]
    elif kind == "garbage_footer":
        b[-len(m[1]):] = m[1]
    elif kind == "magic":
        if m[1] in ("head", "both"):
            b[:4] = m[2]
        if m[1] in ("tail", "both"):
            b[-4:] = m[2]
    elif kind == "overwrite":
        p = m[1] % n
        b[p:p + len(m[2])] = m[2]
    elif kind == "insert":
        p = m[1] % n
        b[p:p] = m[2]
    elif kind == "delete":
        p = m[1] % n
        del b[p:p + m[2]]
    elif kind == "zero_tail":
        b[-m[1]:] = bytes(min(m[1], n))
    return bytes(b)


@settings(max_examples=300 * SCALE)
@given(step=st.integers(0, len(BATCHES) - 1), m=mutations)
def test_mutated_bytes_are_caught_by_the_checksum(dump, step, m):
    f = dump / "train" / paths.step_name(step)
    with _Restore(f) as r:
        new = mutate(r.orig, m)
        assume(new != r.orig)
        f.write_bytes(new)
        with pytest.raises(ChecksumError, match=f.name):
            trajstore.Reader(dump, verify=True)[step]
        _count("bytes_verified_caught")


@settings(max_examples=400 * SCALE)
@given(step=st.integers(0, len(BATCHES) - 1), m=mutations, columns=st.booleans())
def test_mutated_bytes_never_crash_the_decoder(dump, step, m, columns, monkeypatch):
    """verify=False: the decoder alone raises a TrajstoreError naming the file, or returns a batch."""
    monkeypatch.setattr(_limits, "MAX_DECODED_BYTES", 256 << 20)
    f = dump / "train" / paths.step_name(step)
    with _Restore(f) as r:
        new = mutate(r.orig, m)
        assume(new != r.orig)
        f.write_bytes(new)
        rd = trajstore.Reader(dump, verify=False)
        try:
            cols = None
            if columns and isinstance(BATCHES[step], dict):
                cols = [next(iter(BATCHES[step]))]
            got = rd.read(step, columns=cols)
            rd.meta(step)
        except TrajstoreError as e:
            assert f.name in str(e), f"error does not name the file: {e}"
            _count(f"bytes_unverified_error:{type(e).__name__}")
            return
        try:
            want = BATCHES[step] if cols is None else {cols[0]: BATCHES[step][cols[0]]}
            assert_batch_equal(got, want)
            _count("bytes_unverified_same_batch")
        except AssertionError:
            _count("bytes_unverified_wrong_batch")  # what verify=True (the default) exists for


def _entry_points(d):
    """Every way a user reaches a step: the Reader's calls, `info`, `verify`, `sql`, `export`, a
    Recorder's replay (issue 17: each raises a TrajstoreError, never a foreign exception)."""
    from trajstore.inspection.describe import describe
    from trajstore.inspection.traces import traces
    from trajstore.read.tables import duckdb_connect

    r = trajstore.Reader(d)
    rec = trajstore.Recorder(trajstore.DumpReplayConfig(replay=True, prefetch=False, path=str(d)))
    return [lambda: r.read(0), lambda: r.meta(0), lambda: r.info(0), lambda: r.column("rewards", [0]),
            lambda: next(iter(r.iter([0]))), lambda: describe(d), lambda: trajstore.verify(d, deep=True),
            lambda: duckdb_connect(d).execute("SELECT count(*) FROM train").fetchall(),
            lambda: traces(r, 0), lambda: rec.load(0)]


@settings(max_examples=25 * SCALE, deadline=None)
@given(m=mutations)
def test_mutated_bytes_every_entry_point(dump, m, monkeypatch):
    """A damaged step 0 through every entry point: a TrajstoreError (naming the file where it is
    about the file) or a result; never pyarrow's, the OS's or the JSON parser's own exception."""
    import duckdb

    monkeypatch.setattr(_limits, "MAX_DECODED_BYTES", 256 << 20)
    f = dump / "train" / paths.step_name(0)
    with _Restore(f) as r:
        new = mutate(r.orig, m)
        assume(new != r.orig)
        f.write_bytes(new)
        try:
            calls = _entry_points(dump)
        except TrajstoreError:
            return
        for i, call in enumerate(calls):
            try:
                call()
            except duckdb.Error:
                _count("entry_points:duckdb_query")  # the CLI reports a failed query as a TrajstoreError
            except TrajstoreError as e:
                assert i == 7 or f.name in str(e), f"error does not name the file: {e}"  # 7: the dump's SQL views
                _count("entry_points:error")
            else:
                _count("entry_points:result")


# ----------------------------------------------------------------------------- spec-level lies
def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, path + (i,))


def _get(doc, path):
    for p in path:
        doc = doc[p]
    return doc


lies = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([-1, 2**31, 2**40, 2**62, 2**63, -2**63]),
    st.floats(allow_nan=True), st.text(max_size=6),
    st.sampled_from(["input_ids", "logprobs", "__shape__pixel_values", "step", "float32", "bfloat16",
                     "uint64", "int8", "torch", "numpy", "np_scalar", "token", "sample", "cell", "value",
                     "struct", "tensor", "gtensor", "seq", "group", "json", "empty", "padded", "packed",
                     "left", "right", "span", "masked", "__start__attention_mask", "ndarray", "<U999999999",
                     "|O", "V8", "AAAA", "!!!!"]),
    st.lists(st.integers(-2, 2**33), max_size=4), st.just({}), st.just([]), st.just([[]]),
)


@st.composite
def spec_lies(draw, doc):
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        path = draw(st.sampled_from(paths))
        parent, key = _get(doc, path[:-1]), path[-1]
        action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "copy"]))
        if action == "delete":
            if isinstance(parent, dict):
                del parent[key]
            else:
                parent.pop(key)
        elif action == "copy":
            parent[key] = copy.deepcopy(_get(doc, draw(st.sampled_from(paths))[:len(path)]))
        else:
            parent[key] = copy.deepcopy(draw(lies))  # st.just values are shared objects
    return doc


def _resign(f, doc):
    table = pq.read_table(f)
    meta = dict(table.schema.metadata)
    meta[b"trajstore"] = json.dumps(doc, allow_nan=True).encode()
    pq.write_table(table.replace_schema_metadata(meta), f)
    checksums.sum_path(f).write_text(checksums.sum_line(checksums.file_sha256(f), f.name))


@settings(max_examples=400 * SCALE)
@given(step=st.integers(0, len(BATCHES) - 1), data=st.data())
def test_lying_specs_raise_a_trajstore_error(dump, step, data, monkeypatch):
    """A re-signed file whose description lies: a TrajstoreError naming the file, or a batch."""
    monkeypatch.setattr(_limits, "MAX_DECODED_BYTES", 256 << 20)
    f = dump / "train" / paths.step_name(step)
    with _Restore(f) as r:
        doc = DOCS.setdefault(step, json.loads(pq.ParquetFile(f).schema_arrow.metadata[b"trajstore"]))
        lie = data.draw(spec_lies(doc))
        assume(lie != doc)
        _resign(f, lie)
        rd = trajstore.Reader(dump)
        try:
            got = rd.read(step)
            rd.info(step)
        except TrajstoreError as e:
            assert f.name in str(e), f"error does not name the file: {e}"
            _count(f"spec_error:{type(e).__name__}")
            return
        del got
        _count("spec_decoded")  # e.g. a changed pad value or meta: a consistent lie, decoded as told
        del r


# ----------------------------------------------------------------------------- named cases
def _doc(f):
    return json.loads(pq.ParquetFile(f).schema_arrow.metadata[b"trajstore"])


def _edit(f, fn):
    d = _doc(f)
    fn(d)
    _resign(f, d)


def _keys(d):
    return dict(d["batch"]["keys"])


CASES = {
    "newer_format_version": (0, lambda d: d.update(format_version=99), FormatVersionError, "upgrade"),
    "format_version_not_int": (0, lambda d: d.update(format_version="1"), FormatError, "format version"),
    "other_step": (0, lambda d: d.update(step=7), FormatError, "holds step 7"),
    "row_count_lies": (0, lambda d: d.update(num_rows=5), FormatError, "rows"),
    "batch_size_lies": (0, lambda d: d["batch"].update(B=9), FormatError, "trajectories"),
    "missing_column": (0, lambda d: _keys(d)["input_ids"].update(col="nope"), FormatError, "missing"),
    "wrong_dtype": (0, lambda d: _keys(d)["input_ids"].update(dtype="float32"), FormatError, "Arrow type"),
    "unknown_dtype": (0, lambda d: _keys(d)["input_ids"].update(dtype="complex64"), FormatError, "dtype"),
    "bf16_as_numpy": (0, lambda d: _keys(d)["logprobs"].update(lib="numpy"), FormatError, "bfloat16"),
    "huge_T": (0, lambda d: d["batch"].update(T=2**40), FormatError, "over the limit"),
    # no values per token, but a [B, T] mask to build: counted (issue 17)
    "zero_width_huge_T": (0, lambda d: (d["batch"].update(T=2**33), _keys(d)["topk"].update(trail=[0])),
                          FormatError, "over the limit.*TRAJSTORE_MAX_DECODED_BYTES"),
    "huge_sample_trail": (0, lambda d: _keys(d)["rewards"].update(trail=[2**36]), FormatError,
                          "over the limit.*TRAJSTORE_MAX_DECODED_BYTES"),
    "negative_T": (0, lambda d: d["batch"].update(T=-1), FormatError, "T is -1"),
    "negative_trail": (0, lambda d: _keys(d)["topk"].update(trail=[-1]), FormatError, "trail"),
    "huge_trail": (0, lambda d: _keys(d)["input_ids"].update(trail=[2**40]), FormatError, "limit"),
    "pad_not_int": (0, lambda d: _keys(d)["input_ids"].update(pad="0"), FormatError, "pad"),
    "unknown_node": (0, lambda d: _keys(d)["rewards"].update(t="lambda"), FormatError, "unknown node type"),
    "unknown_side": (0, lambda d: d["batch"].update(side="up"), FormatError, "side"),
    "b64_garbage": (0, lambda d: _keys(d)["scalar"].update(data="!!!!"), FormatError, "inline tensor"),
    "b64_wrong_size": (0, lambda d: _keys(d)["scalar"].update(shape=[1000]), FormatError, "inline tensor"),
    "gtensor_huge": (0, lambda d: _keys(d)["scalar"].update(shape=[2**40, 2**30]), FormatError, "inline"),
    "keys_not_pairs": (0, lambda d: d["batch"].update(keys=[["a"]]), FormatError, "pair"),
    "duplicate_keys": (0, lambda d: d["batch"]["keys"].append(d["batch"]["keys"][0]), FormatError, "unique"),
    "spec_not_object": (0, lambda d: d.update(batch=[1]), FormatError, "batch spec"),
    "deep_nesting": (0, lambda d: d["batch"]["keys"].append(["deep", _deep(200)]), FormatError, "deeper"),
    "none_out_of_range": (2, lambda d: d["batch"]["elem"].update(none=[99]), FormatError, "row indices"),
    "none_negative": (2, lambda d: d["batch"]["elem"].update(none=[-1]), FormatError, "row indices"),
    "hostile_np_dtype": (4, lambda d: _keys(d)["uid"].update(np_dtype="[('a','O')]"), FormatError, "np_dtype"),
    "huge_np_str": (4, lambda d: _keys(d)["uid"].update(np_dtype="<U999999999"), FormatError, "limit|not understood"),
    "value_type_lies": (4, lambda d: _keys(d)["obj"]["elem"].update(ptype="int"), FormatError, "Arrow type"),
    "cell_shape_col_lies": (3, lambda d: _keys(d)["pixel_values"]["elem"].update(shape_col="input_ids"),
                            FormatError, "Arrow type"),
    "meta_not_object": (0, lambda d: d.update(meta=[1]), FormatError, "meta"),
    "wrapper_unknown": (0, lambda d: d["batch"].update(wrapper={"type": "evil"}), FormatError, "container"),
}


def _deep(n):
    node = {"t": "json", "v": 1}
    for _ in range(n):
        node = {"t": "group", "keys": [["x", node]]}
    return node


@pytest.mark.parametrize("name", sorted(CASES))
def test_named_lie(dump, name):
    step, fn, exc, msg = CASES[name]
    f = dump / "train" / paths.step_name(step)
    with _Restore(f):
        _edit(f, fn)
        with pytest.raises(exc, match=msg) as e:
            trajstore.Reader(dump).read(step)
        assert f.name in str(e.value)


def _table_edit(f, fn):
    """Rewrite the file's data (not its description) and re-sign it."""
    t = pq.read_table(f)
    t = fn(t)
    pq.write_table(t, f)
    checksums.sum_path(f).write_text(checksums.sum_line(checksums.file_sha256(f), f.name))


def test_cell_shapes_that_do_not_match_values(dump):
    import pyarrow as pa

    f = dump / "train" / paths.step_name(3)
    with _Restore(f):
        def lie(t):
            i = t.schema.get_field_index("__shape__pixel_values")
            return t.set_column(i, t.schema.field(i), pa.array([[5, 2], [-1]], type=pa.list_(pa.int64())))
        _table_edit(f, lie)
        with pytest.raises(FormatError, match="row 0 has shape") as e:
            trajstore.Reader(dump).read(3)
        assert f.name in str(e.value)


@pytest.mark.parametrize("content", [b"", b"PAR1", b"PAR1" + b"\0" * 100 + b"PAR1", b"not parquet at all",
                                     b"\x89PNG\r\n\x1a\n" + bytes(200)])
def test_not_parquet(tmp_path, content):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, BATCHES[1])
    f = tmp_path / "train" / paths.step_name(0)
    f.write_bytes(content)
    for verify in (True, False):
        with pytest.raises(FormatError, match=f.name):
            trajstore.Reader(tmp_path, verify=verify)[0]


def test_step_file_is_a_directory(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, BATCHES[1])
    (tmp_path / "train" / paths.step_name(1)).mkdir()
    for verify in (True, False):
        with pytest.raises(FormatError, match="step_00000001.parquet"):
            trajstore.Reader(tmp_path, verify=verify)[1]


def test_foreign_parquet_file(tmp_path):
    import pyarrow as pa

    with trajstore.Writer(tmp_path) as w:
        w.append(0, BATCHES[1])
    f = tmp_path / "train" / paths.step_name(0)
    pq.write_table(pa.table({"a": [1, 2]}), f)
    checksums.sum_path(f).write_text(checksums.sum_line(checksums.file_sha256(f), f.name))
    with pytest.raises(FormatError, match="not written by trajstore"):
        trajstore.Reader(tmp_path)[0]


# ----------------------------------------------------------------------------- manifest
MANIFESTS = {
    "not_json": (b"{nope", FormatError, "not valid JSON"),
    "empty": (b"", FormatError, "not valid JSON"),
    "binary": (bytes(range(256)), FormatError, "not valid JSON"),
    "not_object": (b"[1, 2]", FormatError, "not a trajstore manifest"),
    "foreign": (b'{"format": "other", "format_version": 1}', FormatError, "not a trajstore manifest"),
    "newer": (b'{"format": "trajstore", "format_version": 3}', FormatVersionError, "upgrade trajstore"),
    "version_str": (b'{"format": "trajstore", "format_version": "1"}', FormatError, "positive int"),
    "version_bool": (b'{"format": "trajstore", "format_version": true}', FormatError, "positive int"),
    "version_zero": (b'{"format": "trajstore", "format_version": 0}', FormatError, "positive int"),
    "deep": (b"[" * 100000 + b"]" * 100000, FormatError, "manifest"),
    "environment_list": (b'{"format": "trajstore", "format_version": 2, "environment": [1]}', FormatError,
                         "environment.*not an object"),
    "environment_str": (b'{"format": "trajstore", "format_version": 2, "environment": "x"}', FormatError,
                        "environment.*not an object"),
}


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_manifest_that_lies(tmp_path, name):
    with trajstore.Writer(tmp_path) as w:
        w.append(0, BATCHES[1])
    content, exc, msg = MANIFESTS[name]
    (tmp_path / "trajstore.json").write_bytes(content)
    for open_ in (trajstore.Reader, trajstore.Writer, trajstore.verify, _describe,
                  lambda p: trajstore.Recorder(trajstore.DumpReplayConfig(replay=True, path=str(p)))):
        with pytest.raises(exc, match=msg) as e:
            open_(tmp_path)
        assert "trajstore.json" in str(e.value)


def _describe(p):
    from trajstore.inspection.describe import describe

    return describe(p)


def test_manifest_is_a_directory(tmp_path):
    (tmp_path / "trajstore.json").mkdir()
    with pytest.raises(FormatError, match="trajstore.json"):
        trajstore.Reader(tmp_path)


def test_manifest_says_trajstore_but_split_is_missing(tmp_path):
    trajstore.Writer(tmp_path).close()
    shutil.rmtree(tmp_path / "train")
    with pytest.raises(trajstore.DumpNotFoundError, match="no split 'train'"):
        trajstore.Reader(tmp_path)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                           max_leaves=10)
manifests = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"format": st.sampled_from(["trajstore", "other", 1]),
                           "format_version": st.one_of(st.integers(-2, 3), st.booleans(), st.text(max_size=2),
                                                       st.none(), st.floats())},
                          optional={"environment": json_values}).map(lambda v: json.dumps(v).encode()),
)


@pytest.fixture(scope="module")
def one_step_dump(tmp_path_factory):
    """A dump of one step (``BATCHES[1]``), written once: each example below works on a copy."""
    p = tmp_path_factory.mktemp("one_step")
    with trajstore.Writer(p) as w:
        w.append(0, BATCHES[1])
    return p


@settings(max_examples=300 * SCALE)
@given(content=manifests)
def test_fuzzed_manifest(tmp_path_factory, one_step_dump, content):
    p = tmp_path_factory.mktemp("manifest") / "d"
    shutil.copytree(one_step_dump, p)
    (p / "trajstore.json").write_bytes(content)
    try:
        r = trajstore.Reader(p)
    except TrajstoreError as e:
        assert "trajstore.json" in str(e), e
        _count(f"manifest_error:{type(e).__name__}")
        return
    assert r.manifest.get("format") == "trajstore" and type(r.manifest["format_version"]) is int
    assert 1 <= r.manifest["format_version"] <= MANIFEST_VERSION
    assert_batch_equal(r[0], BATCHES[1])
    _count("manifest_ok")
