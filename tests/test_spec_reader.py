"""Issue 13: an independent reader written from docs/FORMAT.md alone (tests/spec_reader.py, pyarrow +
numpy, no trajstore) decodes every batch form exactly as ``trajstore.Reader`` does."""

from __future__ import annotations

import ast
import glob
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import spec_reader
import trajstore
from _reader_forms import FORMS
from spec_reader import SpecError, Tensor, Wrapped, read_meta, read_step, typed
from trajstore.testing import assert_batch_equal, batches, padded_batches, typed_batches, typed_values

HERE = Path(__file__).parent


def test_spec_reader_imports_only_pyarrow_and_numpy():
    """The spec reader is an outside implementation: no trajstore, no torch, nothing but the standard
    library, numpy and pyarrow."""
    tree = ast.parse((HERE / "spec_reader.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    roots = {n.split(".")[0] for n in names}
    assert roots <= {"__future__", "base64", "json", "math", "re", "dataclasses", "pathlib", "typing",
                     "numpy", "pyarrow"}, roots


# ----------------------------------------------------------------------------- comparison
def containers(x: Any, top: bool = True) -> Any:
    """What trajstore.Reader returned, with its containers as ("tensordict", batch_size, fields) /
    ("dataproto", batch, non_tensor_batch, meta_info); nested TensorDicts as plain dicts."""
    if all(hasattr(x, k) for k in ("batch", "non_tensor_batch", "meta_info")) and not isinstance(x, dict):
        return ("dataproto", None if x.batch is None else containers(x.batch),
                {k: containers(v, False) for k, v in x.non_tensor_batch.items()}, containers(x.meta_info, False))
    if hasattr(x, "batch_size") and hasattr(x, "to_dict"):
        fields = {k: containers(x[k], False) for k in x.keys()}
        return ("tensordict", list(x.batch_size), fields) if top else fields
    if isinstance(x, dict):
        return {k: containers(v, False) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(containers(v, False) for v in x)
    if isinstance(x, np.ndarray) and x.dtype == object:
        out = np.empty(x.shape, dtype=object)
        for i, v in enumerate(x.reshape(-1)):
            out.reshape(-1)[i] = containers(v, False)
        return out
    return x


def from_spec(x: Any) -> Any:
    """The spec reader's values in the same terms: its Tensors as torch tensors (bf16 from its bits),
    a DataProto's ``non_tensor_keys`` as its non-tensor batch, the rest its TensorDict, ``meta_info``
    or the typed ``meta_info_t``."""
    if isinstance(x, Tensor):
        if x.dtype == "bfloat16":
            return torch.from_numpy(x.array.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(x.array.copy())
    if isinstance(x, dict):
        return {k: from_spec(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(from_spec(v) for v in x)
    if isinstance(x, np.ndarray) and x.dtype == object:
        out = np.empty(x.shape, dtype=object)
        for i, v in enumerate(x.reshape(-1)):
            out.reshape(-1)[i] = from_spec(v)
        return out
    if not isinstance(x, Wrapped):
        return x
    w, value = x.wrapper, from_spec(x.value)
    if w["type"] == "tensordict":
        return ("tensordict", list(w["batch_size"]), value)
    assert w["type"] == "dataproto", w
    nt, td = w["non_tensor_keys"], w["td"]
    batch = None if td is None else ("tensordict", list(td["batch_size"]), {k: v for k, v in value.items() if k not in nt})
    meta = w["meta_info"] if "meta_info" in w else from_spec(typed(w["meta_info_t"]))
    return ("dataproto", batch, {k: value[k] for k in nt}, meta)


def check(path: Path, batch: Any, step: int = 0, meta: dict | None = None) -> None:
    """Write ``batch`` (and ``meta``); the spec reader's decode of the step file (batch and meta)
    equals trajstore's read."""
    with trajstore.Writer(path) as w:
        w.append(step, batch, meta=meta)
    f = path / "train" / f"step_{step:08d}.parquet"
    reader = trajstore.Reader(path, "train")
    assert_batch_equal(from_spec(read_step(f)), containers(reader[step]))
    assert_batch_equal(from_spec(read_meta(f)), reader.meta(step))


# ----------------------------------------------------------------------------- the cases
@pytest.mark.parametrize("form", list(FORMS))
def test_fixed_forms(tmp_path, form):
    if form in ("tensordict", "dataproto"):
        pytest.importorskip("tensordict")
    batch, _ = FORMS[form]()
    check(tmp_path, batch)


def _tensordict(batch: dict) -> Any:
    from tensordict import TensorDict

    B = len(batch["rewards"])
    return TensorDict({k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}, batch_size=[B])


def test_nested_tensordict(tmp_path):
    """A TensorDict with nested TensorDicts (one empty) and a NonTensorData field."""
    tensordict = pytest.importorskip("tensordict")
    td = tensordict.TensorDict({"a": torch.ones(2, 3), "n": tensordict.TensorDict({"x": torch.zeros(2)}, [2]),
                                "e": tensordict.TensorDict({}, [2])}, [2])
    td["s"] = tensordict.NonTensorData("hello", batch_size=[2])
    check(tmp_path, td)


@given(st.one_of(batches(), typed_batches(dataproto=True)),
       st.none() | st.dictionaries(st.text(max_size=4), typed_values(max_leaves=4), max_size=3))
def test_any_batch(tmp_path_factory, batch, meta):
    """Every batch form, and step metadata plain (``meta``) or typed (``meta_t``, version 3)."""
    check(tmp_path_factory.mktemp("spec"), batch, meta=meta)


@given(padded_batches())
def test_tensordict_batches(tmp_path_factory, batch):
    pytest.importorskip("tensordict")
    check(tmp_path_factory.mktemp("spec"), _tensordict(batch))


def test_refuses_what_the_spec_refuses(tmp_path):
    """An unknown format version, and a column the spec names missing, are refused."""
    check(tmp_path, FORMS["padded"]()[0])
    f = Path(glob.glob(str(tmp_path / "train" / "step_*.parquet"))[0])
    table = pq.read_table(f)
    meta = json.loads(table.schema.metadata[b"trajstore"])
    for name, change in [("version", lambda m, t: ({**m, "format_version": 99}, t)),
                         ("column", lambda m, t: (m, t.drop_columns(["logprobs"])))]:
        m, t = change(meta, table)
        bad = tmp_path / name
        bad.mkdir()
        pq.write_table(t.replace_schema_metadata({b"trajstore": json.dumps(m)}), bad / f.name)
        with pytest.raises(SpecError):
            read_step(bad / f.name)
    assert spec_reader.KNOWN_VERSIONS == (1, 2, 3, 6)


def test_refuses_version_3_constructs_in_older_files(tmp_path):
    """A segtensor node or a ``meta_t`` in a file claiming version 2, and a segtensor whose counts
    do not fit its rows, are refused (3.6, 3.7)."""
    batch = {"rewards": torch.zeros(2), "pixel_values": torch.ones(5, 3),
             "image_grid_thw": torch.tensor([[1, 1, 2], [1, 1, 3]])}
    check(tmp_path, batch, meta={"t": (1, 2)})
    f = tmp_path / "train" / "step_00000000.parquet"
    table = pq.read_table(f)
    meta = json.loads(table.schema.metadata[b"trajstore"])
    assert meta["format_version"] == 3 and "meta_t" in meta
    seg = dict(meta["batch"]["keys"])["pixel_values"]
    assert seg["t"] == "segtensor" and seg["counts"] == [2, 3]

    def with_counts(m, counts):
        keys = [[k, {**n, "counts": counts} if k == "pixel_values" else n] for k, n in m["batch"]["keys"]]
        return {**m, "batch": {**m["batch"], "keys": keys}}

    for name, m, fails in [("v2", {**meta, "format_version": 2}, (read_step, read_meta)),
                           ("counts", with_counts(meta, [3, 2]), (read_step,)),
                           ("short", with_counts(meta, [5]), (read_step,)),
                           ("both", {**meta, "meta": {}}, (read_step, read_meta))]:
        bad = tmp_path / name
        bad.mkdir()
        pq.write_table(table.replace_schema_metadata({b"trajstore": json.dumps(m)}), bad / f.name)
        for fn in fails:
            with pytest.raises(SpecError):
                fn(bad / f.name)


# ----------------------------------------------------------------------------- version-3 layouts
def _spec(path: Path) -> tuple[pa.Table, dict]:
    f = path / "train" / "step_00000000.parquet"
    table = pq.read_table(f)
    return table, json.loads(table.schema.metadata[b"trajstore"])


def _rewrite(tmp_path: Path, name: str, table: pa.Table, meta: dict) -> Path:
    bad = tmp_path / name
    bad.mkdir()
    pq.write_table(table.replace_schema_metadata({b"trajstore": json.dumps(meta)}), bad / "step_00000000.parquet")
    return bad / "step_00000000.parquet"


def _mrope(side: str) -> dict:
    """verl's Qwen2-VL batch: mrope ``position_ids`` ``[B, 4, T]`` (token axis last), its padded
    positions holding different values; ``right``: one attention_mask group (form padded), ``span``:
    prompts left-padded and responses right-padded (form masked, a span group)."""
    g = torch.Generator().manual_seed(40)
    P, R = 3, 4
    pm = torch.arange(P)[None, :] >= torch.tensor([[1], [3], [0]])
    rm = torch.arange(R)[None, :] < torch.tensor([[2], [4], [0]])
    am = torch.cat([pm, rm], 1) if side == "span" else torch.arange(P + R)[None, :] < torch.tensor([[5], [7], [0]])
    pos = torch.randint(0, 50, (3, 4, P + R), generator=g)
    batch = {"input_ids": torch.randint(1, 99, (3, P + R), generator=g) * am, "attention_mask": am.long(),
             "position_ids": pos, "rope_f": torch.randn(3, 2, P + R, generator=g).to(torch.bfloat16).masked_fill(~am[:, None], 1.5),
             "rewards": torch.tensor([1.0, 0.0, -1.0])}
    if side == "span":
        batch.update(prompts=batch["input_ids"][:, :P], responses=batch["input_ids"][:, P:], response_mask=rm.long())
    return batch


@pytest.mark.parametrize("side", ["right", "span"])
def test_token_axis_last(tmp_path, side):
    """3.4 / 3.7 (version 3): ``[B, C, T]`` fields following attention_mask on their last axis, with a
    ``pad_col`` (position_ids) and a ``pad`` (bf16 rope_f), are decoded as trajstore does."""
    check(tmp_path, _mrope(side))
    table, meta = _spec(tmp_path)
    keys = dict(meta["batch"]["keys"])
    assert meta["format_version"] == 6 and meta["batch"]["form"] == ("masked" if side == "span" else "padded")  # 6: int32 ids (3.2)
    assert keys["position_ids"]["axis"] == "last" and "pad_col" in keys["position_ids"]
    assert keys["rope_f"]["axis"] == "last" and keys["rope_f"]["trail"] == [2] and "pad_col" not in keys["rope_f"]

    def node(m, **change):
        ks = [[k, {**n, **change} if k == "position_ids" else n] for k, n in m["batch"]["keys"]]
        return {**m, "batch": {**m["batch"], "keys": ks}}

    for name, m in [("v2", {**meta, "format_version": 2}), ("axis", node(meta, axis="first")),
                    ("sample", node(meta, kind="sample")), ("empty", node(meta, trail=[])),
                    ("trail", node(meta, trail=[3]))]:
        with pytest.raises(SpecError):
            read_step(_rewrite(tmp_path, name, table, m))


def _groups() -> list:
    """AReaL groups: ``[g, T]`` masks right-padded, left-padded, unpadded (stored whole) and a None
    slot; token cells ``[g, T]`` / ``[g, T, 2]`` with one pad value and with their own pad values."""
    g = torch.Generator().manual_seed(41)
    out: list = []
    for lens, left in [([3, 1], False), ([2, 4, 0], True), ([4, 4], False), (None, False)]:
        if lens is None:
            out.append(None)
            continue
        G, T = len(lens), 4
        ar = torch.arange(T)[None, :]
        m = ar >= T - torch.tensor(lens)[:, None] if left else ar < torch.tensor(lens)[:, None]
        out.append({"input_ids": torch.randint(1, 99, (G, T), generator=g, dtype=torch.int32) * m,
                    "attention_mask": m.to(torch.int32), "logprobs": torch.randn(G, T, generator=g),
                    "topk": torch.randn(G, T, 2, generator=g).half().masked_fill(~m[..., None], -2.0),
                    "rewards": torch.randn(G, generator=g), "uid": f"g{len(out)}"})
    return out


def test_groups_by_runs(tmp_path):
    """3.10 (version 3): a list batch's groups stored by runs, pad values in ``pad`` (input_ids,
    topk) or ``pad_col`` (logprobs), a group without padding whole, are decoded as trajstore does;
    lying runs and a version-2 file are refused."""
    check(tmp_path, _groups())
    table, meta = _spec(tmp_path)
    cells = dict(meta["batch"]["elem"]["keys"])
    assert meta["format_version"] == 3
    assert all(cells[k]["runs"] == "__runs__attention_mask" for k in ("input_ids", "attention_mask", "logprobs", "topk"))
    assert "pad_col" in cells["logprobs"] and cells["input_ids"]["pad"] == 0 and "runs" not in cells["rewards"]
    runs = table.column("__runs__attention_mask").to_pylist()
    assert runs[0] == [0, 0, 3, 1] and runs[1] == [2, 0, 4, 2, 4, 0] and runs[2] is None and runs[3] is None

    def with_runs(row):
        r = runs[:1] + [row] + runs[2:]
        i = table.column_names.index("__runs__attention_mask")
        return table.set_column(i, table.field(i), pa.array(r, type=table.field(i).type))

    for name, t, m in [("v2", table, {**meta, "format_version": 2}),
                       ("outside", with_runs([3, 0, 0, 2, 4, 0]), meta),  # s + l > T
                       ("count", with_runs([2, 0, 4, 1, 4, 0]), meta),  # runs of 5 tokens, values of 6
                       ("short", with_runs([2, 0, 2, 4]), meta)]:
        with pytest.raises(SpecError):
            read_step(_rewrite(tmp_path, name, t, m))


def test_action_cells_by_shifted_runs(tmp_path):
    """3.10: OpenRLHF's [g, T-1] action cells (elements with ``sequences``) stored against the mask's
    columns 1..T-1, their runs in ``__runs__attention_mask__action``, are decoded as trajstore does."""
    groups = [None if e is None else e | {"sequences": e["input_ids"].long(),
                                          "action_mask": e["attention_mask"][:, 1:].bool(),
                                          "action_log_probs": e["logprobs"][:, 1:].clone()} for e in _groups()]
    check(tmp_path, groups)
    table, meta = _spec(tmp_path)
    cells = dict(meta["batch"]["elem"]["keys"])
    assert cells["action_log_probs"]["runs"] == cells["action_mask"]["runs"] == "__runs__attention_mask__action"
    assert table.column("__runs__attention_mask__action").to_pylist()[:2] == [[0, 0, 2, 0], [1, 0, 3, 2, 3, 0]]


def test_row_key_orders_nulls_and_strict_floats(tmp_path):
    """Version-3 value constructs from the text: a struct row's own key order (``orders``), Python
    numbers in one float64 column (``num``), NaN / inf as typed ``float`` documents."""
    rows = [{"a": torch.ones(1), "b": 1, "c": "x"}, {"c": "y", "a": torch.ones(2), "b": 2.5}, None,
            {"b": float("nan"), "a": torch.zeros(0)}]
    check(tmp_path / "a", rows)
    check(tmp_path / "b", {"r": torch.zeros(3), "n": [1, 2.5, None], "j": [{"x": float("inf")}, [1], "s"],
                           "g": float("-inf")}, meta={"loss": float("nan")})
    spec = json.loads(pq.read_schema(tmp_path / "a" / "train" / "step_00000000.parquet").metadata[b"trajstore"])
    assert spec["batch"]["elem"]["orders"] == [[1, [2, 0, 1]], [3, [1, 0]]]


def test_refuses_a_declared_mask_with_holes(tmp_path):
    """A version-6 step holding a version-5 construct the outside reader does not implement (a declared
    mask with holes, 3.4) is refused, not read as a mask rebuilt from row lengths."""
    B, T = 2, 6
    am = torch.ones(B, T, dtype=torch.long)
    lm = torch.tensor([[0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 1, 0]])
    b = {"input_ids": torch.arange(B * T).reshape(B, T), "attention_mask": am, "loss_mask": lm,
         "advantages": torch.randn(B, T) * lm}
    with trajstore.Writer(tmp_path, masks={"loss_mask": ["advantages"]}) as w:
        w.append(0, b)
    f = tmp_path / "train" / "step_00000000.parquet"
    assert json.loads(pq.read_schema(f).metadata[b"trajstore"])["format_version"] == 6
    with pytest.raises(SpecError, match="holes"):
        read_step(f)
