"""diff finds a single perturbed value at its (step, trajectory, token); identical dumps are identical."""

import tempfile

import numpy as np
import pytest
import torch
from _dumps import make_tokenizer, padded_dump, write
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore import ConfigError, StepNotFoundError
from trajstore.base.text import parse_steps


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
    # a field in one dump only is a difference; in neither, a mistake (docs/CLI.md: exit 2)
    c = tmp_path / "c"
    write(c, {0: {"input_ids": torch.ones(2, 3, dtype=torch.long), "extra": torch.zeros(2)}})
    d = tmp_path / "d"
    write(d, {0: {"input_ids": torch.ones(2, 3, dtype=torch.long)}})
    rep = trajstore.diff(c, d, fields=["extra"])
    assert rep.entries[0].status == "missing" and "'extra'" in rep.entries[0].note
    with pytest.raises(ConfigError, match=r"'nope'.*fields: input_ids, attention_mask"):
        trajstore.diff(base, b, fields=["nope"], steps=[0])


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


def test_strings_differ(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    for p, u in ((a, ["x", "y"]), (b, ["x", "z"])):
        write(p, {0: {"r": torch.zeros(2), "uid": u}})
    rep = _both(monkeypatch, a, b)
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


# ---------------------------------------------------------------- the column path (issue 16)
import math  # noqa: E402
import shutil  # noqa: E402

import pyarrow.parquet as pq  # noqa: E402

from trajstore import cli  # noqa: E402
from trajstore.inspection import diff as diff_mod  # noqa: E402
from trajstore.inspection import diff_arrow  # noqa: E402
from trajstore.store import checksums  # noqa: E402
from trajstore.testing import padded_batches  # noqa: E402

_KEYS = ("step", "field", "status", "n", "n_exceed", "max_abs", "max_rel", "first", "note")


def _plain(v):
    """NaN-safe, comparable form of an entry value."""
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _entries(rep):
    return [{k: _plain(getattr(e, k)) for k in _KEYS} for e in rep.entries]


def _both(monkeypatch, *args, **kw):
    """The report of the column path and of the decode path; they must agree."""
    fast = trajstore.diff(*args, **kw)
    monkeypatch.setattr(diff_mod, "FAST", False)
    slow = trajstore.diff(*args, **kw)
    monkeypatch.setattr(diff_mod, "FAST", True)
    assert _entries(fast) == _entries(slow)
    for ef, es in zip(fast.entries, slow.entries):
        assert set(ef.sums) == set(es.sums)
        # summed in another order: the sums of the values may round otherwise (and cancel); the counts and
        # the sums of differences (non-zero only where values differ) agree
        for k in set(ef.sums) & {"n", "d", "ad", "d2"}:
            v, w = ef.sums[k], es.sums[k]
            assert v == w or (math.isnan(v) and math.isnan(w)) or v == pytest.approx(w, rel=1e-9)
    return fast


def _no_decode(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the decode path was used")
    monkeypatch.setattr(diff_mod, "_rows", fail)


def _batch(B, lengths, side, seed):
    """Padded batch with a field of every kind the column path takes: token fields of int, float32,
    bfloat16, float16 (one with a trailing dim), per-sample scalars and vectors."""
    T = max(lengths) + 1
    g = torch.Generator().manual_seed(seed)
    ar = torch.arange(T)[None]
    n = torch.tensor(lengths)[:, None]
    am = ar < n if side == "right" else ar >= T - n
    return {"input_ids": torch.randint(0, 99, (B, T), generator=g) * am, "attention_mask": am,
            "loss_mask": am & (torch.rand(B, T, generator=g) < 0.7),
            "logprobs": torch.randn(B, T, generator=g) * am,
            "lp16": (torch.randn(B, T, generator=g) * am).to(torch.bfloat16),
            "h16": torch.randn(B, T, 2, generator=g).to(torch.float16),
            "rewards": torch.randn(B, generator=g),
            "vec": torch.randn(B, 7, generator=g, dtype=torch.float64), "uid": [f"u{i}-é" for i in range(B)]}


SPECIAL = ["plus1", "nan", "nan_payload", "neg_zero", "inf", "one_ulp"]


def _plant(t, where, kind):
    """``t`` with the value at ``where`` changed as ``kind`` says; returns (tensor, beyond tolerance)."""
    t = t.clone()
    v = t[where]
    if kind == "plus1":
        t[where] = v + 1
    elif kind == "nan":
        t[where] = float("nan") if not torch.isnan(v) else 0.0
    elif kind == "nan_payload":  # NaN on both sides, other bits: not the same bits, yet equal
        t[where] = float("nan")
        bits = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        nxt = bits.clone()
        nxt[where] = bits[where] ^ 1
        return t, nxt.view(t.dtype), False
    elif kind == "neg_zero":  # -0.0 against 0.0: equal numbers, other bits
        t[where] = 0.0
        u = t.clone()
        u[where] = -0.0
        return t, u, False
    elif kind == "inf":
        t[where] = float("inf")
    elif kind == "one_ulp":
        t[where] = torch.nextafter(v, torch.tensor(float("inf"), dtype=v.dtype)) if t.dtype != torch.bfloat16 \
            else (v.float().view(torch.int32) + (1 << 16)).view(torch.float32).to(torch.bfloat16)
    return None, t, True


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.sampled_from(["right", "left"]),
       st.sampled_from(["logprobs", "lp16", "h16", "rewards", "vec", "input_ids"]), st.sampled_from(SPECIAL),
       st.integers(0, 1), st.data())
def test_planted_change_found_by_the_column_path(lengths, side, name, kind, step, data):
    i = data.draw(st.integers(0, len(lengths) - 1))
    _planted(lengths, side, name, kind, step, i, data.draw(st.integers(0, lengths[i] - 1)))


@pytest.mark.parametrize("name,kind", [("logprobs", "neg_zero"), ("lp16", "neg_zero"), ("h16", "neg_zero"),
                                       ("logprobs", "nan_payload"), ("lp16", "nan_payload"), ("vec", "nan_payload")])
def test_signed_zero_and_nan_payload_are_not_the_same_bits(name, kind):
    _planted([3, 1, 4], "left", name, kind, 1, 2, 3)


def _planted(lengths, side, name, kind, step, i, t):
    """Dump a, and b: a copy with one value changed (``kind``) at trajectory ``i``, token ``t``;
    the column path finds exactly that change, and agrees with the decode path."""
    B = len(lengths)
    steps_a = {s: _batch(B, lengths, side, seed=s) for s in (0, 1)}
    steps_b = {s: dict(b) for s, b in steps_a.items()}
    T = steps_a[step]["attention_mask"].shape[1]
    pos = t if side == "right" else T - lengths[i] + t
    x = steps_a[step][name]
    if name == "input_ids":
        kind = "plus1"
    where = {"vec": (i, t), "rewards": (i,), "h16": (i, pos, 1)}.get(name, (i, pos))
    new_a, new_b, beyond = _plant(x, where, kind)
    if new_a is not None:
        steps_a[step] = {**steps_a[step], name: new_a}
        steps_b[step] = {**steps_b[step], name: new_a}
    steps_b[step][name] = new_b
    with tempfile.TemporaryDirectory() as d:
        write(f"{d}/a", steps_a)
        write(f"{d}/b", steps_b)
        with pytest.MonkeyPatch.context() as mp:
            _no_decode(mp)
            rep = trajstore.diff(f"{d}/a", f"{d}/b")
        with pytest.MonkeyPatch.context() as mp:
            assert _entries(_both(mp, f"{d}/a", f"{d}/b")) == _entries(rep)
            assert _entries(_both(mp, f"{d}/a", f"{d}/b", pair=("logprobs", "logprobs"), mask="loss_mask"))
    changed = [(e.step, e.field) for e in rep.entries if e.status != "identical"]
    assert changed == [(step, name)]
    e = [e for e in rep.entries if e.status != "identical"][0]
    if not beyond:
        assert e.status == "close" and rep.ok and e.first is None
        return
    fd = rep.first_divergence
    assert e.status == "differs" and e.n_exceed == 1
    assert (fd["step"], fd["field"], fd["trajectory"]) == (step, name, i)
    if name == "rewards":
        assert "token" not in fd
    elif name == "vec":  # 7 values, never the padded width T (rows would then cut it by the mask)
        assert fd["token"] == t
    else:
        assert fd["token"] == t and fd.get("element") == (1 if name == "h16" else None)


@settings(max_examples=20, deadline=None)
@given(padded_batches(), st.data())
def test_column_path_agrees_with_decode_path(batch, data):
    """Any padded batch of trajstore.testing, one bit flipped in one field: same report both ways."""
    other = dict(batch)
    names = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.numel()]
    if names:
        k = data.draw(st.sampled_from(names))
        v = batch[k].clone()
        if v.dtype == torch.bool:
            v.view(-1)[data.draw(st.integers(0, v.numel() - 1))] ^= True
        else:
            u = v.view(torch.uint8).view(-1)
            u[data.draw(st.integers(0, u.numel() - 1))] ^= 1 << data.draw(st.integers(0, 7))
        other[k] = v
    with tempfile.TemporaryDirectory() as d:
        try:
            write(f"{d}/a", {0: batch})
            write(f"{d}/b", {0: other})
        except trajstore.TrajstoreError:
            return  # the flip made the batch invalid (e.g. an attention mask of other values)
        with pytest.MonkeyPatch.context() as mp:
            full = _entries(_both(mp, f"{d}/a", f"{d}/b"))
            _both(mp, f"{d}/a", f"{d}/b", first=True)
            for name in {e["field"] for e in full} - {"*"}:  # one field read alone: the same entries
                mp.setattr(diff_mod, "FAST", False)
                assert _entries(trajstore.diff(f"{d}/a", f"{d}/b", fields=[name])) == \
                    [e for e in full if e["field"] == name]


def test_first_stops_at_the_first_divergence(tmp_path, tok_path, base):
    b = tmp_path / "b"
    padded_dump(b, tok_path, perturb=(1, 2, 5, 1e-3))
    full = trajstore.diff(base, b, fields=["versions", "logprobs", "rewards"])
    short = trajstore.diff(base, b, fields=["versions", "logprobs", "rewards"], first=True)
    assert short.first_divergence == full.first_divergence
    assert [(e.step, e.field) for e in short.entries] == [(0, "versions"), (0, "logprobs"), (0, "rewards"),
                                                          (1, "versions"), (1, "logprobs")]
    assert len(full.entries) == 9


def test_unknown_steps_and_fields_are_errors(tmp_path, base, capsys):
    with pytest.raises(StepNotFoundError, match=r"steps 50-60: none is in .* \(steps 0-2\)"):
        trajstore.diff(base, base, steps="50-60")
    with pytest.raises(ConfigError, match=r"field 'reward' is in no compared step.*rewards"):
        trajstore.diff(base, base, fields=["reward"])
    with pytest.raises(ConfigError, match="'old_logprob'"):
        trajstore.diff(base, pair=("logprobs", "old_logprob"))
    rep = trajstore.diff(base, base, steps="2-60")  # some exist: a step in neither dump is no difference
    assert rep.identical and {e.step for e in rep.entries} == {2}
    for argv in (["--fields", "reward"], ["--steps", "50-60"]):
        assert cli.run(["diff", str(base), str(base), *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("'reward'" in err or "50-60" in err)
    assert cli.run(["diff", str(base), str(base), "--first"]) == 0


def _corrupt_column(f, column):
    """Overwrite the middle of ``column``'s data in step file ``f``; its checksum record follows."""
    md = pq.ParquetFile(f).metadata
    j = [md.schema.column(k).path for k in range(md.num_columns)].index(column)
    raw = bytearray(f.read_bytes())
    for g in range(md.num_row_groups):
        c = md.row_group(g).column(j)
        start = c.dictionary_page_offset or c.data_page_offset
        lo, hi = start + 8, start + c.total_compressed_size
        raw[lo:hi] = bytes(hi - lo)
    f.write_bytes(bytes(raw))
    sp = checksums.sum_path(f)
    sp.write_text(checksums.sum_line(checksums.file_sha256(f), f.name))


def test_only_the_compared_fields_are_read(tmp_path, tok_path, base, monkeypatch):
    b = tmp_path / "b"
    shutil.copytree(base, b)
    r = trajstore.Reader(b)
    for s in r.steps:
        _corrupt_column(r.file(s), "input_ids.list.element")
    try:  # the damage is real: reading input_ids fails, or finds other values
        damaged = not trajstore.diff(base, b, fields=["input_ids"]).identical
    except Exception:
        damaged = True
    assert damaged
    for fast in (True, False):
        monkeypatch.setattr(diff_mod, "FAST", fast)
        assert trajstore.diff(base, b, fields=["logprobs", "uid", "rewards"]).identical
        assert trajstore.diff(base, b, pair=("logprobs", "old_logprobs"), mask="loss_mask").ok


def test_same_bytes_read_once(tmp_path, base, monkeypatch):
    b = tmp_path / "b"
    shutil.copytree(base, b)
    read = []
    orig = diff_arrow.read_columns
    monkeypatch.setattr(diff_arrow, "read_columns", lambda r, s, *a: read.append(str(r.path)) or orig(r, s, *a))
    rep = trajstore.diff(base, b)
    assert rep.identical and set(read) == {str(base)} and len(read) == 3
    read.clear()
    f = trajstore.Reader(b).file(1)
    f.write_bytes(f.read_bytes())
    checksums.sum_path(f).write_text(checksums.sum_line("0" * 64, f.name))  # another record: read both
    assert trajstore.diff(base, b).identical and sorted(set(read)) == sorted({str(base), str(b)})


@pytest.mark.parametrize("pos", [0, 4, 8])
def test_packed_batches_on_the_column_path(tmp_path, monkeypatch, pos):
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    a = {"input_ids": torch.arange(9), "cu_seqlens": cu, "logprobs": torch.randn(9, generator=g),
         "hidden": torch.randn(9, 2, generator=g).to(torch.bfloat16), "rewards": torch.randn(3, generator=g)}
    b = {**a, "hidden": a["hidden"].clone()}
    b["hidden"][pos, 1] += 1
    write(tmp_path / "a", {0: a})
    write(tmp_path / "b", {0: b})
    _no_decode(monkeypatch)
    rep = trajstore.diff(tmp_path / "a", tmp_path / "b")
    traj = int(torch.searchsorted(cu, pos, right=True)) - 1
    fd = rep.first_divergence
    assert (fd["field"], fd["trajectory"], fd["token"], fd["element"]) == ("hidden", traj, pos - int(cu[traj]), 1)
    assert [e.field for e in rep.entries] == ["input_ids", "logprobs", "hidden", "rewards"]
    monkeypatch.undo()
    _both(monkeypatch, tmp_path / "a", tmp_path / "b")


def test_strings_of_a_padded_batch(tmp_path, monkeypatch):
    a = _batch(3, [2, 3, 1], "right", 0)
    write(tmp_path / "a", {0: a})
    write(tmp_path / "b", {0: {**a, "uid": ["u0-é", "other", "u2-é"]}})
    write(tmp_path / "c", {0: dict(a)})
    rep = _both(monkeypatch, tmp_path / "a", tmp_path / "b")
    fd = rep.first_divergence
    assert (fd["field"], fd["trajectory"], fd["b"]) == ("uid", 1, "other") and rep.fields()["uid"]["n"] == 3
    _no_decode(monkeypatch)
    rep = trajstore.diff(tmp_path / "a", tmp_path / "c")
    assert rep.identical and rep.fields()["uid"]["n"] == 3


def test_steps_written_by_several_ranks(tmp_path, monkeypatch):
    """The shards of a step (their padded widths differ) joined, then compared on their columns."""
    def shards(path, change):
        for r, lengths in enumerate(([2, 4], [1, 5, 3])):
            with trajstore.Writer(path, rank=r, world_size=2) as w:
                for s in (0, 1):
                    b = _batch(len(lengths), lengths, "right", seed=10 * s + r)
                    if change and (s, r) == (1, 1):
                        b["logprobs"] = b["logprobs"].clone()
                        b["logprobs"][1, 3] += 1
                    w.append(s, b)
    shards(tmp_path / "a", False)
    shards(tmp_path / "b", True)
    assert trajstore.Reader(tmp_path / "a")._sharded(1)
    with monkeypatch.context() as mp:
        _no_decode(mp)
        rep = trajstore.diff(tmp_path / "a", tmp_path / "b")
    fd = rep.first_divergence
    assert (fd["step"], fd["field"], fd["trajectory"], fd["token"]) == (1, "logprobs", 3, 3)
    assert [(e.step, e.field) for e in rep.entries if e.status != "identical"] == [(1, "logprobs")]
    _both(monkeypatch, tmp_path / "a", tmp_path / "b")
    _both(monkeypatch, tmp_path / "a", tmp_path / "b", pair=("logprobs", "lp16"), mask="loss_mask")
