"""TensorDict and DataProto-shaped batches round-trip through a dump."""

import sys
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from _dumps import roundtrip, write
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore.format.batch import containers as adapters
from trajstore.format.batch.containers import DataProtoLike
from trajstore.errors import BatchError, MissingDependencyError, UnsupportedTypeError
from trajstore.testing import assert_batch_equal, non_tensor_values, padded_batches

tensordict = pytest.importorskip("tensordict")
TensorDict = tensordict.TensorDict


@dataclass
class DataProto:  # the shape of verl.protocol.DataProto, without verl
    batch: object = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


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
def test_tensordict_roundtrip(batch):
    td = TensorDict(tensors_only(batch), batch_size=[batch["input_ids"].shape[0]])
    back = roundtrip(td)[0]
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
    r = write(tmp_path, {0: td})
    back = r[0]
    assert_td_equal(td, back)
    assert back["extra"].batch_size == torch.Size([B, T])
    assert back.get("note").data == "hello"
    # attention_mask was seen through the TensorDict: input_ids is stored unpadded
    info = r.info(0)
    node = dict(info["batch"]["keys"])["input_ids"]
    assert node["kind"] == "token"


@settings(max_examples=25)
@given(padded_batches(max_batch=4), st.data())
def test_dataproto_roundtrip_keeps_class(batch, data):
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
    back = roundtrip(dp)[0]
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


def test_dataproto_without_tensors():
    dp = DataProto(batch=None, non_tensor_batch={"s": np.array(["a", None, 3], dtype=object)}, meta_info={})
    back = roundtrip(dp)[0]
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


def test_dataproto_errors():
    td = TensorDict({"x": torch.arange(2)}, batch_size=[2])
    with pytest.raises(BatchError, match="'x'.*both"):
        roundtrip(DataProto(batch=td, non_tensor_batch={"x": np.array([1, 2], dtype=object)}))
    with pytest.raises(UnsupportedTypeError, match="meta_info"):
        roundtrip(DataProto(batch=td, meta_info={"dtype": torch.float32}))


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


def _containers():
    td = TensorDict({"x": torch.arange(6).view(3, 2), "attention_mask": torch.ones(3, 2, dtype=torch.bool),
                     "nested": TensorDict({"y": torch.randn(3, 4)}, batch_size=[3])}, batch_size=[3])
    dp = DataProto(batch=td.clone(), non_tensor_batch={"u": np.array([1, "a", None], dtype=object)},
                   meta_info={"t": 0.5})
    return td, dp


def test_map_tensors_reaches_into_containers():
    from trajstore.device import bridge as torch_bridge

    td, dp = _containers()
    out = torch_bridge.map_tensors(td, lambda t: t + 1)
    assert isinstance(out, TensorDict) and out.batch_size == td.batch_size
    assert torch.equal(out["x"], td["x"] + 1) and torch.equal(out["nested", "y"], td["nested", "y"] + 1)
    back = torch_bridge.map_tensors(dp, lambda t: t * 0)
    assert type(back) is DataProto and back.meta_info == dp.meta_info
    assert not back.batch["x"].any() and back.non_tensor_batch["u"] is not None
    assert_batch_equal(dp.non_tensor_batch, back.non_tensor_batch)
    assert len(torch_bridge._leaves(dp)) == 3


@pytest.mark.cuda
def test_read_to_cuda_moves_container_batches(tmp_path):
    td, dp = _containers()
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, td)
        w.append(1, dp)
    r = trajstore.Reader(tmp_path / "d")
    g = r.read(0, device="cuda")
    assert isinstance(g, TensorDict) and g.device.type == "cuda" and g["x"].is_cuda and g["nested", "y"].is_cuda
    assert_td_equal(td, g.cpu())
    g = r.read(1, device="cuda")
    assert type(g) is DataProto and g.batch["x"].is_cuda
    assert_td_equal(dp.batch, g.batch.cpu())
    got = [(s, type(b), (b if isinstance(b, TensorDict) else b.batch)["x"].is_cuda) for s, b in r.iter(device="cuda")]
    assert got == [(0, TensorDict, True), (1, DataProto, True)]
    rec = trajstore.Recorder(replay=True, path=str(tmp_path / "d"), device="cuda")
    assert rec.batch(1, lambda: None).batch["x"].is_cuda
    rec.close()
