"""Warnings for likely mistakes (issue 16): a mask of another width than the per-token-looking tensors
next to it, and an unknown TRAJSTORE_* environment variable. Both are trajstore.errors warnings
(TrajstoreWarning, a UserWarning), attributed to the caller's line."""

import re
import warnings
from pathlib import Path

import pytest
import torch

import trajstore
from trajstore.record import config
from trajstore.inspection.describe import describe
from trajstore.errors import BatchWarning, ConfigWarning, TrajstoreWarning

PKG = Path(trajstore.__file__).parent


def _batch(T_ids: int, T_mask: int = 8) -> dict:
    return {"input_ids": torch.arange(4 * T_ids).view(4, T_ids), "attention_mask": torch.ones(4, T_mask, dtype=torch.long),
            "rewards": torch.ones(4)}


def test_a_mask_wider_than_input_ids_warns_naming_both_shapes(tmp_path):
    b = _batch(6)
    with pytest.warns(BatchWarning) as rec, trajstore.Writer(tmp_path / "d") as w:
        w.append(0, b)
    assert len(rec) == 1 and issubclass(rec[0].category, TrajstoreWarning)
    msg = str(rec[0].message)
    assert "'input_ids' [4, 6]" in msg and "'attention_mask' [4, 8]" in msg and "per-sample" in msg and "pad" in msg
    assert rec[0].filename == __file__  # the caller's append line, not trajstore's
    # what the warning says is what happens: input_ids comes back whole, stored per sample
    assert torch.equal(trajstore.Reader(tmp_path / "d")[0]["input_ids"], b["input_ids"])
    kinds = {f["name"]: f["kind"] for f in describe(str(tmp_path / "d"))["splits"]["train"]["fields"]}
    assert kinds["input_ids"] == "sample"


def test_nested_and_recorder_fields_are_named(tmp_path):
    b = {**_batch(8), "extra": {"old_logprobs": torch.zeros(4, 3)}, "pixel_values": torch.zeros(4, 3, 2)}
    with pytest.warns(BatchWarning, match=r"'extra\.old_logprobs' \[4, 3\]") as rec:
        with trajstore.Recorder(dump=True, path=str(tmp_path / "d")) as r:
            r.batch(0, lambda: b)
    assert "pixel_values" not in str(rec[0].message) and "input_ids" not in str(rec[0].message)


@pytest.mark.parametrize("batch", [
    _batch(8),                                                         # same width
    {**_batch(8), "pixel_values": torch.zeros(4, 5), "image_grid_thw": torch.ones(4, 3)},  # per-sample names
    {"prompts": torch.zeros(4, 3), "responses": torch.zeros(4, 5), "attention_mask": torch.ones(4, 8),
     "response_mask": torch.ones(4, 5), "old_log_probs": torch.zeros(4, 5)},  # verl's parts of the mask
    {**_batch(8), "completion_ids": torch.zeros(4, 5, dtype=torch.long), "completion_mask": torch.ones(4, 5),
     "old_per_token_logps": torch.zeros(4, 5)},                       # TRL's own mask of that width
])
def test_batches_that_follow_their_masks_do_not_warn(tmp_path, batch):
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrajstoreWarning)
        with trajstore.Writer(tmp_path / "d") as w:
            w.append(0, batch)


def test_an_unknown_trajstore_variable_warns_with_the_closest_known_one():
    env = {"TRAJSTORE_DUMPP": "1", "TRAJSTORE_PATH": "/tmp/x", "HOME": "/root"}
    with pytest.warns(ConfigWarning) as rec:
        cfg = trajstore.DumpReplayConfig.from_env(environ=env)
    assert cfg.dump is False and cfg.path == "/tmp/x"
    assert len(rec) == 1 and rec[0].filename == __file__
    assert "TRAJSTORE_DUMPP" in str(rec[0].message) and "did you mean TRAJSTORE_DUMP?" in str(rec[0].message)
    with pytest.warns(ConfigWarning, match="did you mean MYAPP_MAX_KEEP"):  # another prefix: its own names
        trajstore.DumpReplayConfig.from_env("MYAPP_", environ={"MYAPP_MAXKEEP": "3"})


def test_known_variables_do_not_warn():
    env = {k: "" for k in config.ENV_VARIABLES} | {"TRAJSTORE_DUMP": "1", "OTHER_DUMPP": "1"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrajstoreWarning)
        assert trajstore.DumpReplayConfig.from_env(environ=env).dump is True


def test_every_variable_the_package_reads_is_listed():
    """config.ENV_VARIABLES is the one list: a variable read anywhere in trajstore/ must be in it."""
    found = {m for f in PKG.rglob("*.py") for m in re.findall(r"[\"'](TRAJSTORE_[A-Z0-9_]+)[\"']", f.read_text())}
    found.discard("TRAJSTORE_")  # the prefix itself
    known = set(config.ENV_VARIABLES) | set(config.TEST_VARIABLES)  # the test suite's own, named in config.py
    assert found and found <= known, found - known
