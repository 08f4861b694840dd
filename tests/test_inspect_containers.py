"""Every inspection tool works on TensorDict and DataProto-like dumps (they read the plain form)."""


import numpy as np
import pytest
import torch

import trajstore
from _dumps import check_inspection

tensordict = pytest.importorskip("tensordict")


def _dataproto(seed):
    from trajstore.format.batch.containers import DataProtoLike

    g = torch.Generator().manual_seed(seed)
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    td = tensordict.TensorDict({"input_ids": torch.randint(0, 50, (3, 4), generator=g).masked_fill(~m, 0),
                                "attention_mask": m, "rewards": torch.tensor([1.0, 0.0, -1.0])}, batch_size=[3])
    return DataProtoLike(batch=td, non_tensor_batch={"uid": np.array(["a", "b", "c"], dtype=object)},
                         meta_info={"temperature": 1.0})


@pytest.fixture(scope="module", params=["dataproto", "tensordict"])
def dump(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param) / "run"
    with trajstore.Writer(d) as w:
        for s in range(2):
            b = _dataproto(s)
            w.append(s, b if request.param == "dataproto" else b.batch)
    return d


def test_to_pandas_counts_trajectories_and_cuts_padding(dump):
    df = trajstore.Reader(dump).to_pandas()
    assert len(df) == 6 and list(df["step"]) == [0, 0, 0, 1, 1, 1]
    assert [len(x) for x in df["input_ids"][:3]] == [3, 2, 4]


def test_diff_show_export_run(dump, capsys):
    check_inspection(dump, [3, 3], capsys)


def test_meta_info_changed_after_append_is_recorded_as_appended(tmp_path):
    """verl pops meta_info["timing"] right after generation: the dump keeps what was appended."""
    b = _dataproto(0)
    b.meta_info = {"timing": {"gen": 1.5}, "n": [1, 2]}
    with trajstore.Writer(tmp_path) as w:
        w.append(0, b)
        b.meta_info.pop("timing")
        b.meta_info["n"].append(3)
    assert trajstore.Reader(tmp_path)[0].meta_info == {"timing": {"gen": 1.5}, "n": [1, 2]}


def test_packed_read_of_a_container(dump):
    """layout="packed" of a TensorDict / DataProto step: flat fields in a TensorDict of batch_size []."""
    r = trajstore.Reader(dump)
    got = r.read(1, layout="packed")
    td = got if isinstance(got, tensordict.TensorDictBase) else got.batch
    assert list(td.batch_size) == [] and td["cu_seqlens"].tolist() == [0, 3, 5, 9]
    padded = r[1]
    ptd = padded if isinstance(padded, tensordict.TensorDictBase) else padded.batch
    assert torch.equal(td["input_ids"], ptd["input_ids"][ptd["attention_mask"]])
