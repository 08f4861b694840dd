"""Module paths of earlier releases still import (issue: the folders show the layers): each earlier path in
``trajstore._moved.MOVED`` is the module at its new place, the same object, and the front doors at the top
(``trajstore.writer``, ``reader``, ``torch_bridge``, ``recorder``, ``config``) give the names they gave."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from trajstore import _moved

FRONT_DOORS = {
    "trajstore.writer": ["Writer", "Committed"],
    "trajstore.reader": ["Reader"],
    "trajstore.torch_bridge": ["PinnedPool", "Arena", "Staged", "snapshot_cuda", "host_arena", "stage", "launch",
                               "to_device", "as_device", "on_device", "map_tree", "map_tensors"],
    "trajstore.recorder": ["Recorder", "DumpReplayConfig"],
    "trajstore.config": ["DumpReplayConfig", "default_run_id", "location", "ENV_VARIABLES", "check_env"],
}


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_earlier_path_is_the_module_at_its_new_place(old):
    assert importlib.import_module(old) is importlib.import_module(_moved.MOVED[old])


def test_earlier_paths_import_in_a_fresh_process_by_every_form():
    """``import a.b as m``, ``from a import b`` and ``from a.b import name`` each work before anything else
    of trajstore is loaded (the alias finder is installed by ``import trajstore``, which they all run first)."""
    code = ("import trajstore.snapshot as s; from trajstore.format import layout; "
            "from trajstore.format.containers import unwrap; from trajstore._threads import budget; "
            "import trajstore.write.snapshot as t, trajstore.format.batch.layout as l; "
            "assert s is t and layout is l; print('ok')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


@pytest.mark.parametrize("door", sorted(FRONT_DOORS))
def test_front_doors_keep_their_names(door):
    """Each front door lists the names it gave, and each is the object its room defines."""
    mod = importlib.import_module(door)
    assert mod.__all__ == FRONT_DOORS[door]
    for name in FRONT_DOORS[door]:
        got = getattr(mod, name)
        home = importlib.import_module(getattr(got, "__module__", None) or "trajstore.record.config")
        assert home.__name__.startswith(("trajstore.write.", "trajstore.read.", "trajstore.device.",
                                         "trajstore.record.")), (name, home.__name__)
        assert getattr(home, name) is got, name


def test_unknown_paths_still_fail():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("trajstore.no_such_module")
