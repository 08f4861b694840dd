"""DumpReplayConfig.masks reaches the Recorder's Writer: a field whose mask names and shapes do not
tell is declared once in the config (also as JSON in TRAJSTORE_MASKS)."""

import pytest
import torch

import trajstore
from trajstore import ConfigError, DumpReplayConfig, Recorder
from trajstore.testing import assert_batch_equal


def _batch():
    B, W = 3, 5
    ar = torch.arange(W)
    pm = ar[None, :] >= torch.tensor([2, 0, 4])[:, None]  # left-padded prompt
    cm = ar[None, :] < torch.tensor([5, 1, 3])[:, None]  # right-padded completion
    return {"prompt_ids": torch.arange(B * W).reshape(B, W) * pm, "prompt_mask": pm.to(torch.int64),
            "completion_ids": torch.arange(B * W).reshape(B, W) * cm, "completion_mask": cm.to(torch.int64),
            "extra_logps": torch.randn(B, W) * cm}  # width 5 like both masks: the name does not say which


def test_masks_from_env_and_dict():
    cfg = DumpReplayConfig.from_env(environ={"TRAJSTORE_DUMP": "1",
                                             "TRAJSTORE_MASKS": '{"completion_mask": ["extra_logps"]}'})
    assert cfg.masks == {"completion_mask": ["extra_logps"]}
    assert DumpReplayConfig.from_dict({"masks": {"m": ("a", "b")}}).masks == {"m": ["a", "b"]}
    assert DumpReplayConfig().masks is None
    for bad in ("{not json", '["a"]', {"m": "a"}, {"m": [1]}, 3):
        with pytest.raises(ConfigError, match="DumpReplayConfig.masks"):
            DumpReplayConfig(masks=bad)


@pytest.mark.parametrize("declared", [False, True])
def test_recorder_passes_masks_to_the_writer(tmp_path, declared):
    b = _batch()
    masks = {"completion_mask": ["extra_logps"]} if declared else None
    with Recorder(DumpReplayConfig(dump=True, path=str(tmp_path), masks=masks)) as rec:
        rec.batch(0, lambda: b)
    r = trajstore.Reader(tmp_path)
    assert_batch_equal(r[0], b)
    node = dict(r.info(0)["batch"]["keys"])["extra_logps"]
    assert ("mask" in node) is declared  # declared: stored per token of the completion; else whole


@pytest.mark.parametrize("encodings", ["portable", "compact"])
def test_recorder_writes_the_configured_encodings(tmp_path, encodings):
    """DumpReplayConfig.encodings (TRAJSTORE_ENCODINGS) reaches the Writer: ``compact`` stores
    float tensor values BYTE_STREAM_SPLIT, ``portable`` (the default) does not."""
    import pyarrow.parquet as pq

    cfg = DumpReplayConfig.from_env(environ={"TRAJSTORE_DUMP": "1", "TRAJSTORE_PATH": str(tmp_path),
                                             "TRAJSTORE_ENCODINGS": encodings})
    assert cfg.encodings == encodings and DumpReplayConfig().encodings == "portable"
    b = _batch()
    with Recorder(cfg) as rec:
        rec.batch(0, lambda: b)
    assert_batch_equal(trajstore.Reader(tmp_path)[0], b)
    meta = pq.ParquetFile(next(tmp_path.rglob("step_*.parquet"))).metadata
    encs = {e for rg in range(meta.num_row_groups) for c in range(meta.num_columns)
            for e in meta.row_group(rg).column(c).encodings}
    assert ("BYTE_STREAM_SPLIT" in encs) is (encodings == "compact"), encs
    with pytest.raises(ConfigError, match="DumpReplayConfig.encodings"):
        DumpReplayConfig(encodings="small")
