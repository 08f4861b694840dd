"""Issue 13: an independent reader written from docs/FORMAT.md alone (tests/spec_reader.py, pyarrow +
numpy, no trajstore) decodes every batch form exactly as ``trajstore.Reader`` does."""

from __future__ import annotations

import ast
import glob
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import spec_reader
import trajstore
from _reader_forms import FORMS
from spec_reader import SpecError, Tensor, Wrapped, read_step, typed
from trajstore.testing import assert_batch_equal, batches, padded_batches, typed_batches

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


def check(path: Path, batch: Any, step: int = 0) -> None:
    """Write ``batch``; the spec reader's decode of the step file equals trajstore's read."""
    with trajstore.Writer(path) as w:
        w.append(step, batch)
    ours = read_step(path / "train" / f"step_{step:08d}.parquet")
    theirs = trajstore.Reader(path, "train")[step]
    assert_batch_equal(from_spec(ours), containers(theirs))


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


@given(st.one_of(batches(), typed_batches(dataproto=True)))
def test_any_batch(tmp_path_factory, batch):
    check(tmp_path_factory.mktemp("spec"), batch)


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
    assert spec_reader.KNOWN_VERSIONS == (1, 2, 3)
