"""TensorDict and DataProto-shaped batches round-trip through a dump."""

import sys
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore import adapters
from trajstore.adapters import DataProtoLike
from trajstore.errors import BatchError, MissingDependencyError, UnsupportedTypeError
from trajstore.testing import assert_batch_equal, non_tensor_values, padded_batches

tensordict = pytest.importorskip("tensordict")
TensorDict = tensordict.TensorDict


@dataclass
class DataProto:  # the shape of verl.protocol.DataProto, without verl
    batch: object = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


def roundtrip(tmp_path, batch, step=0):
    with trajstore.Writer(tmp_path / "d", overwrite=True) as w:
        w.append(step, batch)
    return trajstore.Reader(tmp_path / "d")[step]


def assert_td_equal(a, b, path="td"):
    assert type(b) is type(a), f"{path}: {type(b)} != {type(a)}"
    assert a.batch_size == b.batch_size, f"{path}: batch_size {b.batch_size} != {a.batch_size}"
    assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(b.keys())} != {list(a.keys())}"
    for k in a.keys():
        x, y = a.get(k), b.get(k)
        if isinstance(x, torch.Tensor):
            assert_batch_equal(x, y, f"{path}.{k}")
        elif type(x).__name__ in ("NonTensorData", "NonTensorStack"):
            assert type(y) is type(x)
            assert (x.tolist() if hasattr(x, "tolist") and type(x).__name__ == "NonTensorStack" else x.data) == \
                (y.tolist() if type(y).__name__ == "NonTensorStack" else y.data)
        else:
            assert_td_equal(x, y, f"{path}.{k}")


def tensors_only(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}


@settings(max_examples=25)
@given(padded_batches())
def test_tensordict_roundtrip(tmp_path_factory, batch):
    tmp = tmp_path_factory.mktemp("td")
    td = TensorDict(tensors_only(batch), batch_size=[batch["input_ids"].shape[0]])
    back = roundtrip(tmp, td)
    assert_td_equal(td, back)
    assert back.device is None or back.device.type == "cpu"


def test_tensordict_nested_nontensor_and_unpadded_storage(tmp_path):
    B, T = 3, 5
    mask = torch.arange(T)[None] < torch.tensor([5, 2, 0])[:, None]
    td = TensorDict({"input_ids": torch.arange(B * T).view(B, T).masked_fill(~mask, 0),
                     "attention_mask": mask,
                     "extra": {"per_tok": torch.randn(B, T, 2)}}, batch_size=[B])
    td["extra"].batch_size = [B, T]
    td.set_non_tensor("note", "hello")
    td.set("uids", tensordict.NonTensorStack.from_list(["a", "b", "c"]))
    back = roundtrip(tmp_path, td)
    assert_td_equal(td, back)
    assert back["extra"].batch_size == torch.Size([B, T])
    assert back.get("note").data == "hello"
    # attention_mask was seen through the TensorDict: input_ids is stored unpadded
    info = trajstore.Reader(tmp_path / "d").info(0)
    node = dict(info["batch"]["keys"])["input_ids"]
    assert node["kind"] == "token"


@settings(max_examples=25)
@given(padded_batches(max_batch=4), st.data())
def test_dataproto_roundtrip_keeps_class(tmp_path_factory, batch, data):
    B = batch["input_ids"].shape[0]
    nt = {}
    for i in range(data.draw(st.integers(0, 2))):
        vals = data.draw(non_tensor_values(B))
        nt[f"nt{i}"] = np.empty(B, dtype=object)
        for j, v in enumerate(vals):
            nt[f"nt{i}"][j] = v
    nt["uid"] = np.array([f"u{i}" for i in range(B)], dtype=object)
    dp = DataProto(batch=TensorDict(tensors_only(batch), batch_size=[B]), non_tensor_batch=nt,
                   meta_info={"temperature": 1.0, "eos_token_id": [2, 7], "note": None})
    back = roundtrip(tmp_path_factory.mktemp("dp"), dp)
    assert type(back) is DataProto  # this module is imported, so its class is used
    assert_td_equal(dp.batch, back.batch)
    assert_batch_equal(dp.non_tensor_batch, back.non_tensor_batch)
    assert back.meta_info == dp.meta_info


def test_dataproto_class_not_loaded_comes_back_as_dataprotolike(tmp_path, monkeypatch):
    dp = DataProto(batch=TensorDict({"x": torch.arange(4)}, batch_size=[4]),
                   non_tensor_batch={"uid": np.array(list("abcd"), dtype=object)}, meta_info={"k": 1})
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, dp)
    monkeypatch.delitem(sys.modules, __name__)  # the recorded module is not loaded: never imported
    back = trajstore.Reader(tmp_path / "d")[0]
    assert type(back) is DataProtoLike and len(back) == 4
    assert torch.equal(back.batch["x"], torch.arange(4))
    assert list(back.non_tensor_batch["uid"]) == list("abcd") and back.meta_info == {"k": 1}


def test_dataproto_without_tensors(tmp_path):
    dp = DataProto(batch=None, non_tensor_batch={"s": np.array(["a", None, 3], dtype=object)}, meta_info={})
    back = roundtrip(tmp_path, dp)
    assert back.batch is None
    assert_batch_equal(dp.non_tensor_batch, back.non_tensor_batch)


def test_recorded_class_must_be_dataproto_shaped():
    # a file names the class; anything but an already-loaded DataProto-shaped dataclass is refused
    assert adapters._loaded_class("subprocess:Popen") is None
    assert adapters._loaded_class("os:system") is None
    assert adapters._loaded_class("no_such_module_xyz:DataProto") is None
    assert adapters._loaded_class(f"{__name__}:DataProto") is DataProto
    plain = {"x": torch.arange(2)}
    tag = {"type": "dataproto", "td": {"batch_size": [2]}, "non_tensor_keys": [], "meta_info": {},
           "cls": "subprocess:Popen"}
    assert type(adapters.wrap(plain, tag)) is DataProtoLike


def test_dataproto_errors(tmp_path):
    td = TensorDict({"x": torch.arange(2)}, batch_size=[2])
    with pytest.raises(BatchError, match="'x'.*both"):
        roundtrip(tmp_path, DataProto(batch=td, non_tensor_batch={"x": np.array([1, 2], dtype=object)}))
    with pytest.raises(UnsupportedTypeError, match="meta_info"):
        roundtrip(tmp_path, DataProto(batch=td, meta_info={"dtype": torch.float32}))


def test_tensordict_needs_tensordict_to_read(tmp_path, monkeypatch):
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, TensorDict({"x": torch.arange(3)}, batch_size=[3]))
    monkeypatch.setitem(sys.modules, "tensordict", None)  # import tensordict now fails
    with pytest.raises(MissingDependencyError, match="pip install tensordict"):
        trajstore.Reader(tmp_path / "d")[0]


def test_plain_batches_untouched():
    b = {"x": torch.zeros(2)}
    assert adapters.unwrap(b) == (b, None)
    assert adapters.wrap(b, None) is b


def test_recorder_replays_containers_on_the_mapped_device(tmp_path):
    td = TensorDict({"x": torch.arange(6).view(3, 2), "attention_mask": torch.ones(3, 2)}, batch_size=[3])
    dp = DataProto(batch=td.clone(), non_tensor_batch={"u": np.array([1, "a", None], dtype=object)},
                   meta_info={"t": 0.5})
    with trajstore.Recorder(dump=True, path=str(tmp_path / "d")) as rec:
        rec.batch(0, lambda: td)
        rec.batch(1, lambda: dp)
    rec = trajstore.Recorder(replay=True, path=str(tmp_path / "d"), device="cpu")
    assert_td_equal(td, rec.batch(0, lambda: None))
    back = rec.batch(1, lambda: None)
    assert type(back) is DataProto and back.meta_info == {"t": 0.5}
    assert_td_equal(dp.batch, back.batch)
    assert_batch_equal(dp.non_tensor_batch, back.non_tensor_batch)
    rec.close()
