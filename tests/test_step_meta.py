"""Step metadata (``Writer.append(step, batch, meta=...)``) of any value an RL trainer puts there:
plain JSON is stored as ``meta`` (format version 1, as before), anything else as the typed document
``meta_t`` (docs/FORMAT.md 3.6, 3.8; version 3); ``Reader.meta`` / ``Recorder.meta`` give back the
same values and types; ``trajstore info`` / ``show`` display it; a lying file raises FormatError."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trajstore
from _dumps import small_batch, write
from trajstore.cli import run
from trajstore.errors import FormatError, UnsupportedTypeError
from trajstore.testing import assert_batch_equal, typed_values

# what a trainer's step metadata holds: timing of numpy scalars, metrics tensors, tuples, int keys, bytes
TRAINER_META = {
    "timing": {"gen": np.float64(1.5), "num_preempted/max": np.int64(0), "update_actor": 0.25},
    "metrics": {"actor/entropy": torch.tensor([0.5, 0.25]), "actor/lr": np.float32(1e-6)},
    "seqlens": (128, 64), "per_rank": {0: 12, 1: 7}, "rng": b"\x00\xffstate",
    "uids": np.array(["a", "b"], dtype=object), "when": np.datetime64("2026-11-26T10:00", "s"),
}


def _file_doc(d, step):
    f = trajstore.Reader(d).file(step)
    return f, json.loads(pq.read_schema(f).metadata[b"trajstore"])


def test_plain_meta_stays_plain_json_version_1(tmp_path, int64_tokens):
    meta = {"lr": 1e-6, "tags": ["a", {"b": None}], "ok": True}
    r = write(tmp_path / "d", {0: small_batch()}, meta=meta)
    _, doc = _file_doc(tmp_path / "d", 0)
    assert doc["meta"] == meta and "meta_t" not in doc and doc["format_version"] == 1
    got = r.meta(0)
    assert got == meta and type(got["lr"]) is float


def test_trainer_meta_round_trips_with_its_types(tmp_path, int64_tokens):
    r = write(tmp_path / "d", {0: small_batch()}, meta=TRAINER_META)
    _, doc = _file_doc(tmp_path / "d", 0)
    assert "meta" not in doc and doc["format_version"] == 3 and isinstance(doc["meta_t"], dict)
    got = r.meta(0)
    assert_batch_equal(got, TRAINER_META, "meta")
    assert type(got["timing"]["gen"]) is np.float64 and type(got["seqlens"]) is tuple
    assert list(got["per_rank"]) == [0, 1] and got["rng"] == TRAINER_META["rng"]
    assert r.info(0)["batch"]["form"] == "padded"  # the batch itself is unaffected


def test_meta_is_taken_at_append(tmp_path):
    meta = {"timing": {"gen": np.float64(1.0)}, "lst": [1]}
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, small_batch(), meta=meta)
        meta["timing"]["gen"] = np.float64(2.0)
        meta["lst"].append(2)
        plain = {"lst": [1]}
        w.append(1, small_batch(), meta=plain)
        plain["lst"].append(2)
    r = trajstore.Reader(tmp_path / "d")
    assert r.meta(0)["timing"]["gen"] == 1.0 and r.meta(0)["lst"] == [1] and r.meta(1) == {"lst": [1]}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.text(max_size=4) | st.integers(-3, 3) | st.just("$t"), typed_values(), max_size=4))
def test_any_meta_round_trips(tmp_path_factory, int64_tokens, meta):
    d = tmp_path_factory.mktemp("m") / "d"
    r = write(d, {0: small_batch(B=1, T=2)}, meta=meta)
    got = r.meta(0)
    assert list(got) == list(meta)
    assert_batch_equal(got, meta, "meta")
    _, doc = _file_doc(d, 0)
    assert ("meta" in doc) != ("meta_t" in doc) and doc["format_version"] == (3 if "meta_t" in doc else 1)
    if "meta_t" not in doc:  # plain JSON: stored as such, for readers of version 1 and outside readers
        assert_batch_equal(doc["meta"], meta, "meta")


def test_unstorable_meta_names_the_place_and_the_fix(tmp_path):
    with trajstore.Writer(tmp_path / "d") as w:
        with pytest.raises(UnsupportedTypeError, match=r"step 3 meta\['timing'\]\[1\]: .*set.*convert it to"):
            w.append(3, small_batch(), meta={"timing": (1, {2})})
    assert trajstore.Reader(tmp_path / "d").steps == []


def test_recorder_dump_skips_unstorable_meta_and_replays_typed_meta(tmp_path, caplog):
    with trajstore.Recorder(dump=True, path=str(tmp_path / "d")) as rec:
        b = small_batch()
        assert rec.batch(0, lambda: b, meta=TRAINER_META) is b
        assert rec.batch(1, lambda: b, meta={"bad": object()}) is b  # training goes on
    rp = trajstore.Recorder(replay=True, path=str(tmp_path / "d"))
    assert_batch_equal(rp.meta(0), TRAINER_META, "meta")
    assert rp.steps == [0] and "meta['bad']" in caplog.text


def test_info_and_show_display_meta(tmp_path, capsys):
    write(tmp_path / "d", {0: small_batch()}, meta=TRAINER_META)

    def cli(*a):
        assert run([*a[:1], str(tmp_path / "d"), *a[1:]]) == 0
        return capsys.readouterr().out

    info = json.loads(cli("info", "--json"))
    shown = info["splits"]["train"]["per_step"][0]["meta"]
    assert shown["timing"] == {"gen": 1.5, "num_preempted/max": 0, "update_actor": 0.25}
    assert shown["metrics"]["actor/entropy"] == [0.5, 0.25] and shown["per_rank"] == {"0": 12, "1": 7}
    assert shown["seqlens"] == [128, 64] and shown["rng"] == repr(TRAINER_META["rng"])
    assert '{"timing":{"gen":1.5' in cli("info")
    assert json.loads(cli("show", "--step", "0", "--json"))["meta"] == shown
    assert 'meta {"timing"' in cli("show", "--step", "0")


LIES = {
    "both": (lambda d: d.update(meta={}), "together with meta"),
    "in_version_1": (lambda d: d.update(format_version=1), "format version 1"),
    "not_a_dict": (lambda d: d.update(meta_t=[1]), "not a dict"),
    "malformed": (lambda d: d["meta_t"]["timing"].update({"gen": {"$t": "np", "dtype": "<f8", "v": "AA=="}}),
                  "malformed"),
    "unknown_tag": (lambda d: d.update(meta_t={"$t": "pickle", "v": ""}), "unknown"),
}


@pytest.mark.parametrize("name", sorted(LIES))
def test_lying_meta_is_a_format_error_naming_the_file(tmp_path, name):
    write(tmp_path / "d", {0: small_batch()}, meta=TRAINER_META)
    f, doc = _file_doc(tmp_path / "d", 0)
    mutate, msg = LIES[name]
    mutate(doc)
    t = pq.read_table(f)
    pq.write_table(t.replace_schema_metadata({b"trajstore": json.dumps(doc).encode()}), f)
    r = trajstore.Reader(tmp_path / "d", verify=False)
    with pytest.raises(FormatError, match=msg) as e:
        r.meta(0)
    assert f.name in str(e.value)
