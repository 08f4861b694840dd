"""diff finds a single perturbed value at its (step, trajectory, token); identical dumps are identical."""

import tempfile

import numpy as np
import pytest
import torch
from _dumps import make_tokenizer, padded_dump, write
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore import ConfigError
from trajstore._text import parse_steps


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def base(tmp_path_factory, tok_path):
    d = tmp_path_factory.mktemp("base") / "a"
    padded_dump(d, tok_path)
    return d


@pytest.mark.parametrize("side", ["right", "left"])
def test_single_perturbation_found(tmp_path, tok_path, side):
    a, b = tmp_path / "a", tmp_path / "b"
    padded_dump(a, tok_path, pad_side=side)
    padded_dump(b, tok_path, pad_side=side, perturb=(1, 2, 5, 1e-3))
    rep = trajstore.diff(a, b)
    assert not rep.ok and not rep.identical
    fd = rep.first_divergence
    assert (fd["step"], fd["field"], fd["trajectory"], fd["token"]) == (1, "logprobs", 2, 5)
    assert fd["abs"] == pytest.approx(1e-3, rel=1e-3)
    bad = [e for e in rep.entries if e.status != "identical"]
    assert [(e.step, e.field, e.n_exceed) for e in bad] == [(1, "logprobs", 1)]
    f = rep.fields()["logprobs"]
    assert f["status"] == "differs" and f["max_abs"] == pytest.approx(1e-3, rel=1e-3)
    # within tolerance: ok but not identical
    loose = trajstore.diff(a, b, atol=2e-3)
    assert loose.ok and not loose.identical and loose.fields()["logprobs"]["status"] == "close"
    assert trajstore.diff(a, b, rtol=1.0).ok
    # restricted to other steps or fields: identical
    assert trajstore.diff(a, b, steps="0,2").identical
    assert trajstore.diff(a, b, fields=["input_ids", "rewards"]).identical


def test_identical_dumps(tmp_path, tok_path, base):
    b = tmp_path / "b"
    padded_dump(b, tok_path)
    rep = trajstore.diff(base, b)
    assert rep.ok and rep.identical and rep.first_divergence is None
    assert {e.status for e in rep.entries} == {"identical"}
    assert {e.step for e in rep.entries} == {0, 1, 2}
    d = rep.to_dict()
    assert d["identical"] and d["fields"]["logprobs"]["max_abs"] == 0


def test_missing_steps_and_fields(tmp_path, tok_path, base):
    b = tmp_path / "b"
    padded_dump(b, tok_path, steps=(0, 1))
    rep = trajstore.diff(base, b)
    assert not rep.ok
    fd = rep.first_divergence
    assert fd["step"] == 2 and fd["status"] == "missing" and "not in b" in fd["note"]
    rep = trajstore.diff(base, b, fields=["nope"], steps=[0])
    assert rep.entries[0].status == "missing" and "'nope'" in rep.entries[0].note


def test_shape_mismatch(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for p, n in ((a, 3), (b, 4)):
        write(p, {0: {"input_ids": torch.arange(2 * n).reshape(2, n),
                      "attention_mask": torch.ones(2, n, dtype=torch.bool)}})
    e = trajstore.diff(a, b).entries[0]
    assert e.status == "mismatch" and e.first == {"trajectory": 0} and "shape" in e.note


def test_rejected_on_one_side(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    t = {"ids": torch.tensor([1, 2]), "reward": 1.0}
    write(a, {0: [t, None]})
    write(b, {0: [t, t]})
    rep = trajstore.diff(a, b)
    assert rep.first_divergence["trajectory"] == 1 and rep.first_divergence["status"] == "mismatch"
    assert trajstore.diff(a, a).identical


def test_strings_differ(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for p, u in ((a, ["x", "y"]), (b, ["x", "z"])):
        write(p, {0: {"r": torch.zeros(2), "uid": u}})
    rep = trajstore.diff(a, b)
    f = rep.fields()["uid"]
    assert f["status"] == "differs" and f["first"]["trajectory"] == 1 and f["first"]["b"] == "z"


def test_pair_of_fields_in_one_dump(tmp_path, tok_path):
    d = tmp_path / "a"
    padded_dump(d, tok_path, perturb=(2, 0, 20, 0.5))
    rep = trajstore.diff(d, pair=("logprobs", "old_logprobs"), mask="loss_mask")
    assert not rep.ok
    fd = rep.first_divergence
    assert (fd["step"], fd["field"], fd["trajectory"], fd["token"]) == (2, "logprobs vs old_logprobs", 0, 20)
    f = rep.fields()["logprobs vs old_logprobs"]
    assert f["n_exceed"] == 1 and f["max_abs"] == pytest.approx(0.5)
    assert f["mean_abs"] == pytest.approx(0.5 / f["n"]) and f["mean_diff"] == pytest.approx(0.5 / f["n"])
    assert f["p50_abs"] == 0 and f["rmse"] == pytest.approx(np.sqrt(0.25 / f["n"]))
    assert 0.5 < f["corr"] <= 1 + 1e-9
    # only loss-mask tokens are compared
    r = trajstore.Reader(d)
    n_model = sum(int((r.read(s, columns=["loss_mask"])["loss_mask"] != 0).sum()) for s in r.steps)
    assert f["n"] == n_model
    assert trajstore.diff(d, pair=("logprobs", "old_logprobs"), atol=0.6).ok


def test_bad_arguments(base):
    with pytest.raises(ConfigError):
        trajstore.diff(base)
    with pytest.raises(ConfigError):
        trajstore.diff(base, base, atol=-1)
    with pytest.raises(ConfigError, match="cannot read"):
        trajstore.diff(base, base, steps="x-y")


@settings(max_examples=25)
@given(st.lists(st.integers(0, 50), max_size=8), st.integers(0, 5))
def test_parse_steps(steps, width):
    text = ",".join(f"{s}-{s + width}" if i % 2 else f"{s}:{s + width}" for i, s in enumerate(steps))
    want = tuple(sorted({s + k for s in steps for k in range(width + 1)}))
    assert (parse_steps(text) or ()) == want


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.data())
def test_any_single_change_is_located(B, T, data):
    i, t = data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, T - 1))
    x = torch.randn(B, T, generator=torch.Generator().manual_seed(B * 10 + T))
    y = x.clone()
    y[i, t] = y[i, t] + 1
    with tempfile.TemporaryDirectory() as d:
        for name, v in (("a", x), ("b", y)):
            write(f"{d}/{name}", {0: {"lp": v, "attention_mask": torch.ones(B, T, dtype=torch.bool)}})
        fd = trajstore.diff(f"{d}/a", f"{d}/b").first_divergence
    assert (fd["trajectory"], fd["token"]) == (i, t)
