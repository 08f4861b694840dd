"""A DataProto step comes back as the framework's own class whatever the reader imported first:
verl's / ROLL's modules (a fixed list in format/batch/containers.py) are imported when installed; a file
can make trajstore import nothing else."""

import importlib
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import trajstore
from trajstore.format.batch import containers

tensordict = pytest.importorskip("tensordict")

FAKE_VERL = textwrap.dedent('''
    from dataclasses import dataclass, field
    from typing import Any

    @dataclass
    class DataProto:
        batch: Any = None
        non_tensor_batch: dict = field(default_factory=dict)
        meta_info: dict = field(default_factory=dict)
''')


@pytest.fixture
def fake_verl(tmp_path, monkeypatch):
    """An installed (importable) but not yet imported package named verl."""
    pkg = tmp_path / "site" / "verl"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "protocol.py").write_text(FAKE_VERL)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for m in ("verl", "verl.protocol"):
        monkeypatch.delitem(sys.modules, m, raising=False)
    importlib.invalidate_caches()
    yield
    for m in ("verl", "verl.protocol"):
        sys.modules.pop(m, None)


def _write(path, steps=2):
    import verl.protocol

    td = tensordict.TensorDict({"input_ids": torch.arange(6).reshape(2, 3),
                                "attention_mask": torch.ones(2, 3, dtype=torch.bool)}, batch_size=[2])
    with trajstore.Writer(path) as w:
        for s in range(steps):
            w.append(s, verl.protocol.DataProto(batch=td, non_tensor_batch={"uid": np.array(["a", "b"], dtype=object)},
                                                meta_info={"t": 1.0}))
    for m in ("verl", "verl.protocol"):
        del sys.modules[m]  # a fresh reading process: verl installed, not imported


@pytest.mark.parametrize("prefetch", [0, 2])
def test_installed_framework_class_comes_back_whatever_the_import_order(fake_verl, tmp_path, prefetch):
    _write(tmp_path / "d")
    assert "verl.protocol" not in sys.modules
    got = [b for _, b in trajstore.Reader(tmp_path / "d").iter(prefetch=prefetch)]
    cls = sys.modules["verl.protocol"].DataProto
    assert all(type(b) is cls for b in got) and got[1].meta_info == {"t": 1.0}


def test_a_file_names_no_module_to_import(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: calls.append(name))
    tag = {"type": "dataproto", "td": None, "non_tensor_keys": [], "meta_info": {}}
    for cls in ("json.decoder:JSONDecoder", "no_such_pkg_xyz.protocol:DataProto", "subprocess:Popen"):
        assert type(containers.wrap({}, {**tag, "cls": cls})) is containers.DataProtoLike
    assert calls == []
    assert "no_such_pkg_xyz" not in sys.modules


def test_framework_not_installed_gives_dataprotolike(monkeypatch):
    calls = []
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: calls.append(name))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.delitem(sys.modules, "verl.protocol", raising=False)
    tag = {"type": "dataproto", "td": None, "non_tensor_keys": [], "meta_info": {}, "cls": "verl.protocol:DataProto"}
    assert type(containers.wrap({}, tag)) is containers.DataProtoLike and calls == []


def test_a_module_another_thread_is_still_importing_is_waited_for(fake_verl, tmp_path):
    """Two decoder threads meet verl.protocol at once: the second sees it in sys.modules before its
    body has run (no DataProto yet) and must wait for it, not fall back to DataProtoLike."""
    _write(tmp_path / "d")
    pkg = tmp_path / "site" / "verl"
    started = tmp_path / "started"
    (pkg / "protocol.py").write_text(  # the import signals it began, then takes its time
        f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(0.5)\n" + FAKE_VERL)
    importlib.invalidate_caches()
    r = trajstore.Reader(tmp_path / "d")
    got = {}

    def read(i):
        got[i] = r[i]

    first = threading.Thread(target=read, args=(0,))
    first.start()
    while not started.exists():  # verl.protocol is in sys.modules now, its class not yet defined
        time.sleep(0.005)
    read(1)
    first.join()
    cls = sys.modules["verl.protocol"].DataProto
    assert type(got[0]) is cls and type(got[1]) is cls
