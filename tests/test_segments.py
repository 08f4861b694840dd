"""Segmented tensors (docs/FORMAT.md 3.7 ``segtensor``, format version 3): a field whose leading
dimension is cut into one run of rows per trajectory, TRL/Qwen-VL ``pixel_values`` split by
``image_grid_thw`` and ``num_images`` (``trajstore.integrations.trl``). Generic batches round-trip
bit for bit and each trajectory's rows are its own; sizes that do not add up fail at ``append``;
a file that lies about its segments raises FormatError."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trajstore
from _dumps import check_inspection, write
from _dumps import int64_tokens as int64_token_columns
from test_corrupt import _Restore, _resign, spec_lies
from trajstore.errors import BatchError, ConfigError, FormatError, TrajstoreError
from trajstore.format import limits as _limits
from trajstore.format.codec.rows import to_numpy
from trajstore.store import paths
from trajstore.read.tables import step_rows
from trajstore.testing import assert_batch_equal, image_batches


def _rows_per_sample(b):
    """Each sample's rows of pixel_values and image_grid_thw, computed here the way TRL does."""
    n = b.get("num_images", [1] * len(b["image_grid_thw"]))
    per_image = [int(np.prod(g)) for g in np.asarray(b["image_grid_thw"]).tolist()]
    bounds = np.cumsum([0] + list(n))
    return [sum(per_image[bounds[i]:bounds[i + 1]]) for i in range(len(n))], list(n)


def vlm(B=4, images=(2, 0, 1, 3), d=6, dtype=torch.bfloat16, seed=0):
    """A prompt/completion batch with several images per sample (one with none)."""
    g = torch.Generator().manual_seed(seed)
    grids = torch.randint(1, 4, (sum(images), 3), generator=g)
    grids[:, 0] = 1
    rows = int(grids.prod(-1).sum())
    cm = torch.arange(5)[None, :] < torch.tensor([5, 1, 3, 4][:B])[:, None]
    return {"prompt_ids": torch.randint(0, 99, (B, 3), generator=g), "prompt_mask": torch.ones(B, 3, dtype=torch.int64),
            "completion_ids": torch.randint(0, 99, (B, 5), generator=g), "completion_mask": cm.to(torch.int64),
            "pixel_values": torch.randn(rows, d, generator=g).to(dtype), "image_grid_thw": grids,
            "mm_token_type_ids": torch.zeros(B, 8, dtype=torch.int64), "num_images": list(images)}


# ----------------------------------------------------------------------------- round trips
@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(b=image_batches())
def test_image_batches_round_trip_and_rows_are_per_sample(tmp_path_factory, int64_tokens, b):
    d = tmp_path_factory.mktemp("seg") / "d"
    r = write(d, {0: b})
    assert_batch_equal(r.read(0), b)
    B = len(b["image_grid_thw"]) if "num_images" not in b else len(b["num_images"])
    rows = step_rows(r, 0)
    assert len(rows) == B
    spec = dict(r.info(0)["batch"]["keys"])
    pv_rows, grid_rows = _rows_per_sample(b)
    pv = to_numpy(b["pixel_values"])
    if spec["pixel_values"]["t"] == "segtensor":  # split: each row holds its own images' patch rows
        assert spec["pixel_values"]["counts"] == pv_rows and r.info(0)["format_version"] == 3
        at = np.cumsum([0] + pv_rows)
        for i, row in enumerate(rows):
            assert row["pixel_values"].tobytes() == pv[at[i]:at[i + 1]].tobytes()
    else:  # nothing to split: one row per sample already
        assert len(pv) == B and spec["pixel_values"]["t"] == "tensor"
    if spec["image_grid_thw"]["t"] == "segtensor":
        assert spec["image_grid_thw"]["counts"] == grid_rows and any(k != 1 for k in grid_rows)
    try:
        packed = r.read(0, layout="packed")
    except ConfigError:  # a plain batch, or a mask with holes: nothing to pack by
        return
    if spec["pixel_values"]["t"] == "segtensor":  # the same tensor in every layout
        assert_batch_equal(packed["pixel_values"], b["pixel_values"])


def test_several_images_per_sample_bf16(tmp_path):
    b = vlm()
    r = write(tmp_path / "d", {0: b, 1: vlm(images=(1, 1, 1, 1), dtype=torch.float32, seed=1)})
    assert_batch_equal(r.read(0), b)
    spec = dict(r.info(0)["batch"]["keys"])
    assert spec["pixel_values"]["t"] == spec["image_grid_thw"]["t"] == "segtensor"
    assert spec["image_grid_thw"]["counts"] == [2, 0, 1, 3]
    assert spec["pixel_values"]["counts"] == _rows_per_sample(b)[0]
    assert dict(r.info(1)["batch"]["keys"])["image_grid_thw"]["t"] == "tensor"  # one image each: per sample
    df = r.to_pandas()
    assert len(df) == 8 and [len(x) for x in df["image_grid_thw"][:4]] == [2, 0, 1, 3]
    assert [len(x) for x in df["pixel_values"][:4]] == _rows_per_sample(b)[0]
    sql = r.duckdb().execute("SELECT list_sort(list(len(pixel_values))) FROM train WHERE step = 0").fetchone()[0]
    assert sql == sorted(6 * c for c in _rows_per_sample(b)[0])


def test_inspection_tools_count_samples(tmp_path, capsys):
    write(tmp_path / "d", {0: vlm(), 1: vlm(B=3, images=(1, 2, 0), seed=2)})
    check_inspection(tmp_path / "d", [4, 3], capsys)


def test_steps_without_segments_keep_their_version(tmp_path, int64_tokens):
    b = vlm()
    del b["pixel_values"], b["image_grid_thw"], b["num_images"]
    r = write(tmp_path / "d", {0: b, 1: vlm()})
    assert r.info(0)["format_version"] == 2 and r.info(1)["format_version"] == 3


# ----------------------------------------------------------------------------- sizes that do not add up
@pytest.mark.parametrize("edit, match", [
    (lambda b: b["image_grid_thw"].__setitem__((0, 1), 9),
     r"'pixel_values' and 'image_grid_thw'.*image_grid_thw gives \d+ patch rows.*pixel_values has \d+ rows"),
    (lambda b: b.__setitem__("num_images", [2, 0, 1, 2]),
     r"'pixel_values', 'image_grid_thw' and 'num_images'.*not a list of 4 non-negative ints summing to 6"),
    (lambda b: b.__setitem__("num_images", [2, 0, 1]), r"num_images.*not a list of 4"),
    (lambda b: b.pop("num_images"), r"no num_images and the batch has 4 samples, not 6"),
])
def test_sizes_that_do_not_add_up_fail_at_append(tmp_path, edit, match):
    b = vlm()
    edit(b)
    with trajstore.Writer(tmp_path / "d") as w:
        with pytest.raises(BatchError, match=match):
            w.append(0, b)
        w.append(1, vlm())  # the writer goes on
    assert trajstore.Reader(tmp_path / "d").steps == [1]


# ----------------------------------------------------------------------------- lying files
@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    d = tmp_path_factory.mktemp("seglie") / "d"
    with int64_token_columns():  # the lies below are about version 3 constructs
        write(d, {0: vlm()})
    return d


def _doc(f):
    return json.loads(pq.ParquetFile(f).schema_arrow.metadata[b"trajstore"])


def _pv(d):
    return dict(d["batch"]["keys"])["pixel_values"]


LIES = {
    "version_2": (lambda d: d.update(format_version=2), "format version 2"),
    "counts_short": (lambda d: _pv(d)["counts"].pop(), "counts"),
    "counts_negative": (lambda d: _pv(d)["counts"].__setitem__(0, -1), "counts"),
    "counts_moved": (lambda d: _pv(d)["counts"].__setitem__(0, _pv(d)["counts"][0] + 1), "rows its counts give"),
    "counts_huge": (lambda d: _pv(d)["counts"].__setitem__(0, 2**70), "too large"),
    "trail_huge": (lambda d: _pv(d).update(trail=[2**40, 2**40]), "too large"),
    "trail_wrong": (lambda d: _pv(d).update(trail=[3]), "rows its counts give"),
    "lib_scalar": (lambda d: dict(d["batch"]["keys"])["image_grid_thw"].update(lib="np_scalar"), "lib"),
    "dtype_wrong": (lambda d: _pv(d).update(dtype="float32"), "Arrow type"),
    "column_missing": (lambda d: _pv(d).update(col="prompt_ids"), "Arrow type"),
    "counts_not_list": (lambda d: _pv(d).update(counts=None), "counts"),
}


@pytest.mark.parametrize("name", sorted(LIES))
def test_lying_segments_raise_format_error(dump, name):
    fn, match = LIES[name]
    f = dump / "train" / paths.step_name(0)
    with _Restore(f):
        d = _doc(f)
        fn(d)
        _resign(f, d)
        with pytest.raises(FormatError, match=match) as e:
            trajstore.Reader(dump).read(0)
        assert f.name in str(e.value)


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_lie_raises_a_trajstore_error_or_decodes(dump, data, monkeypatch):
    monkeypatch.setattr(_limits, "MAX_DECODED_BYTES", 256 << 20)
    f = dump / "train" / paths.step_name(0)
    with _Restore(f):
        doc = _doc(f)
        lie = data.draw(spec_lies(doc))
        _resign(f, lie)
        try:
            trajstore.Reader(dump).read(0)
        except TrajstoreError as e:
            assert f.name in str(e)


@pytest.mark.cuda
def test_cuda_batch_round_trips_and_its_grid_is_checked_in_the_background(tmp_path):
    """On the GPU, append does not read image_grid_thw (no sync); the encoder does, and a mismatch
    is a BatchWriteError (a BatchError) at the next flush, the step recorded as skipped."""
    b = {k: v.cuda() if torch.is_tensor(v) else v for k, v in vlm().items()}
    bad = {**b, "pixel_values": b["pixel_values"][:-1]}
    w = trajstore.Writer(tmp_path / "d")
    w.append(0, b)
    w.append(1, bad)
    with pytest.raises(BatchError, match=r"'pixel_values' and 'image_grid_thw'"):
        w.flush()
    w.close()
    r = trajstore.Reader(tmp_path / "d")
    assert r.steps == [0] and 1 in r.skipped
    assert_batch_equal(r.read(0), {k: v.cpu() if torch.is_tensor(v) else v for k, v in b.items()})


def test_grid_in_gpu_memory_is_checked_by_the_encoder(tmp_path, monkeypatch):
    """What append does when image_grid_thw is in GPU memory (it is not read there, no sync): the
    encoder reads it, and a mismatch is a BatchWriteError (a BatchError) at the next flush."""
    from trajstore.errors import BatchWriteError
    from trajstore.format.batch import check

    monkeypatch.setattr(check, "_on_gpu", lambda v: True)
    b = vlm()
    w = trajstore.Writer(tmp_path / "d")
    w.append(0, {**b, "pixel_values": b["pixel_values"][:-1]})  # not found at append
    with pytest.raises(BatchWriteError, match=r"'pixel_values' and 'image_grid_thw'.*gives 21 patch rows.*pixel_values has 20 rows"):
        w.flush()
    w.append(1, b)
    w.close()
    r = trajstore.Reader(tmp_path / "d")
    assert r.steps == [1] and 0 in r.skipped
    assert_batch_equal(r.read(1), b)
