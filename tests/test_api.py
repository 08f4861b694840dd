"""Writer / Reader behaviour and error messages."""

import json

import pytest
import torch
from _dumps import small_batch, write

import trajstore
from trajstore import (
    BatchError,
    ConfigError,
    DumpNotFoundError,
    StepExistsError,
    StepNotFoundError,
    UnsupportedTypeError,
)
from trajstore.testing import assert_batch_equal


def batch(B=3, T=5, seed=0):
    return small_batch(B, T, seed, logprobs=True)


def test_steps_len_contains_iter_meta(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        for s in (5, 0, 2):
            w.append(s, batch(seed=s), meta={"lr": 0.5 * s, "tag": str(s)})
    r = trajstore.Reader(tmp_path)
    assert r.steps == [0, 2, 5] and len(r) == 3
    assert 2 in r and 3 not in r and "2" not in r
    seen = [s for s, _ in r]
    assert seen == [0, 2, 5]
    for s, b in r:
        assert_batch_equal(batch(seed=s), b)
    assert r.meta(5) == {"lr": 2.5, "tag": "5"}


def test_columns_subset(tmp_path):
    r = write(tmp_path, {0: batch()})
    out = r.read(0, columns=["rewards"])
    assert list(out) == ["rewards"] and torch.equal(out["rewards"], batch()["rewards"])
    with pytest.raises(ConfigError, match="nope"):
        r.read(0, columns=["nope"])


def test_layout_conversion(tmp_path):
    b = batch(B=4, T=7)
    r = write(tmp_path, {0: b})
    p = r.read(0, layout="packed")
    m = b["attention_mask"]
    assert torch.equal(p["input_ids"], b["input_ids"][m])
    assert torch.equal(p["logprobs"], b["logprobs"][m])
    assert p["cu_seqlens"].tolist() == [0] + m.sum(1).cumsum(0).tolist()
    assert p["max_seqlen"] == int(m.sum(1).max())
    assert "attention_mask" not in p
    # packed -> padded
    rp = write(tmp_path, {0: p}, split="packed")
    pad = rp.read(0, layout="padded")
    T = int(m.sum(1).max())
    assert torch.equal(pad["attention_mask"], m[:, :T])
    assert torch.equal(pad["input_ids"], b["input_ids"][:, :T])
    assert_batch_equal(rp[0], p)


def test_step_exists_and_overwrite(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        w.append(1, batch(seed=1))
    with trajstore.Writer(tmp_path) as w:
        with pytest.raises(StepExistsError, match="step 1 already exists"):
            w.append(1, batch(seed=2))
            w.flush()
    assert_batch_equal(trajstore.Reader(tmp_path)[1], batch(seed=1))
    with trajstore.Writer(tmp_path) as w:
        w.append(1, batch(seed=2), overwrite=True)
    assert_batch_equal(trajstore.Reader(tmp_path)[1], batch(seed=2))


def test_resume_appends_more_steps(tmp_path):
    write(tmp_path, {0: batch(seed=0)})
    created = json.loads((tmp_path / "trajstore.json").read_text())["created"]
    assert write(tmp_path, {1: batch(seed=1)}).steps == [0, 1]
    assert json.loads((tmp_path / "trajstore.json").read_text())["created"] == created


def test_missing_step_message(tmp_path):
    write(tmp_path, {s: batch() for s in (0, 1, 2, 10)})
    write(tmp_path, {7: batch()}, split="val")
    r = trajstore.Reader(tmp_path)
    with pytest.raises(StepNotFoundError) as e:
        r[7]
    msg = str(e.value)
    assert str(tmp_path) in msg and "'train'" in msg and "4 step(s) from 0 to 10" in msg
    assert "nearest: 2, 10" in msg and "'val'" in msg
    assert e.value.step == 7
    with pytest.raises(KeyError):  # also a KeyError
        r[99]


def test_no_dump_and_no_split(tmp_path):
    with pytest.raises(DumpNotFoundError, match="trajstore.json"):
        trajstore.Reader(tmp_path / "nothing")
    write(tmp_path, {0: batch()})
    with pytest.raises(FileNotFoundError, match="no split 'eval'.*train"):
        trajstore.Reader(tmp_path, split="eval")


@pytest.mark.parametrize("step", [-1, 1.0, "3", True, None])
def test_bad_steps(tmp_path, step):
    with trajstore.Writer(tmp_path) as w:
        with pytest.raises(ConfigError, match="step"):
            w.append(step, batch())


@pytest.mark.parametrize("split", ["a/b", "..", "../x", "", ".hidden", "x" * 200])
def test_bad_splits(tmp_path, split):
    with pytest.raises(ConfigError, match="split"):
        trajstore.Writer(tmp_path, split=split)


def test_field_length_mismatch_names_field(tmp_path):
    b = batch()
    b["rewards"] = torch.zeros(4)
    with trajstore.Writer(tmp_path) as w:
        with pytest.raises(BatchError, match="'rewards'.*leading dimension is 4"):
            w.append(0, b)
        b = batch()
        b["uids"] = ["a", "b"]
        with pytest.raises(BatchError, match="'uids'.*2 entries"):
            w.append(0, b)
    assert trajstore.Reader(tmp_path).steps == []


def test_unsupported_values(tmp_path):
    with trajstore.Writer(tmp_path) as w:
        with pytest.raises(UnsupportedTypeError, match="complex64"):
            w.append(0, {"x": torch.zeros(2, dtype=torch.complex64)})
        with pytest.raises(UnsupportedTypeError, match="'x'"):
            w.append(0, {"x": [object(), object()]})
        with pytest.raises(trajstore.TrajstoreError, match="meta"):
            w.append(0, batch(), meta={"t": {1, 2}})  # a set (tuples are stored: tests/test_step_meta.py)


def test_field_kinds_recorded(tmp_path):
    b = batch()
    b["topk"] = torch.zeros(3, 5, 2)
    spec = write(tmp_path, {0: b}).info(0)["batch"]
    keys = dict(spec["keys"])
    assert keys["input_ids"]["kind"] == "token" and keys["topk"]["kind"] == "token"
    assert keys["rewards"]["kind"] == "sample"
    assert spec["side"] == "right"


def test_non_constant_padding_is_kept_and_field_stays_per_token(tmp_path):
    # logprobs * mask leaves -0.0 and 0.0 in the padding; verl-style tensors hold garbage there
    b = batch(B=4, T=9)
    b["logprobs"] = torch.randn(4, 9) * b["attention_mask"]
    b["garbage"] = torch.randn(4, 9, 2)
    r = write(tmp_path, {0: b})
    keys = dict(r.info(0)["batch"]["keys"])
    assert keys["logprobs"]["kind"] == "token" and keys["logprobs"]["pad_col"] == "__pad__logprobs"
    assert keys["garbage"]["kind"] == "token"
    assert_batch_equal(r[0], b)
    assert_batch_equal(r.read(0, columns=["garbage"]), {"garbage": b["garbage"]})
    m = b["attention_mask"]
    assert torch.equal(r.read(0, layout="packed")["garbage"], b["garbage"][m])
    import pandas as pd

    df = pd.read_parquet(r.file(0))
    assert [len(x) for x in df["logprobs"]] == m.sum(1).tolist()
