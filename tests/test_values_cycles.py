"""A value that contains itself (issue 27, item 4): ``Writer.append`` raises a BatchError naming the
field at once, instead of walking the cycle forever. Each append runs under a timer (``_deadline``):
a walk that does not end fails the test instead of hanging it."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore.errors import BatchError
from trajstore.format import values
from trajstore.testing import assert_batch_equal

SECONDS = 20  # far more than any of these appends takes; a walk of a cycle never ends


@contextlib.contextmanager
def _deadline(seconds: float = SECONDS) -> Iterator[None]:
    """Raise TimeoutError in this (the main) thread if the block runs longer than ``seconds``."""
    def fire(*_):
        raise TimeoutError(f"still running after {seconds} s: the walk does not end")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _selfish() -> dict:
    d: dict = {"a": 1}
    d["self"] = d
    return d


def _twice() -> dict:
    d: dict = {"a": 1}
    d["x"] = d
    d["y"] = d  # two references: a walk without a visited check doubles at every level
    return d


def _row_with_tensor() -> dict:
    r: dict = {"t": torch.zeros(2)}
    r["me"] = r
    return r


def _nested_row() -> dict:
    r: dict = {"t": torch.zeros(2), "inner": {}}
    r["inner"]["back"] = r
    return r


def _list_in_itself() -> list:
    x: list = [1]
    x.append(x)
    return x


def _object_array() -> np.ndarray:
    a = np.empty(2, dtype=object)
    a[0], a[1] = {"k": 1}, None
    a[1] = {"arr": a}
    return a


CASES = {  # name -> (batch, the field the error must name)
    "dict in itself inside a list field": (lambda: {"x": torch.zeros(2, 3), "info": [_selfish(), {"a": 2}]}, "info"),
    "dict twice in itself inside a list field": (lambda: {"x": torch.zeros(2, 3), "info": [_twice(), {"a": 2}]},
                                                 "info"),
    "list-of-dicts row containing itself": (lambda: [_row_with_tensor(), {"t": torch.zeros(2)}], "me"),
    "row reaching itself through a dict": (lambda: {"x": torch.zeros(2, 3), "rows": [_nested_row(), _nested_row()]},
                                           "rows"),
    "row dict with a tensor containing itself": (lambda: {"x": torch.zeros(2, 3),
                                                          "rows": [_row_with_tensor(), {"t": torch.zeros(2)}]}, "rows"),
    "list in itself inside a list field": (lambda: {"x": torch.zeros(2, 3), "info": [_list_in_itself(), [2]]}, "info"),
    "group in itself": (lambda: {"x": torch.zeros(2, 3), "cfg": _twice()}, "cfg"),
    "batch-wide typed value in itself": (lambda: {"x": torch.zeros(2, 3), "cfg": {1: _twice()}}, "cfg"),
    "object array holding itself": (lambda: {"x": torch.zeros(2, 3), "objs": _object_array()}, "objs"),
    "tuple row holding a cycle": (lambda: {"x": torch.zeros(2, 3), "info": [(1, _twice()), (2, {})]}, "info"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cycle_is_a_batch_error_naming_the_field(tmp_path, name):
    make, field = CASES[name]
    w = trajstore.Writer(tmp_path / "d")
    try:
        with _deadline(), pytest.raises(BatchError) as e:
            w.append(0, make())
        assert field in str(e.value) and "contains itself" in str(e.value), str(e.value)
        assert isinstance(e.value, ValueError)  # the builtin a user catches
        w.append(1, {"x": torch.zeros(2, 3), "info": [{"a": 1}, {"a": 2}]})  # the writer goes on
    finally:
        w.close()
    assert trajstore.Reader(tmp_path / "d").steps == [1]


def test_cycle_in_step_meta_is_a_batch_error(tmp_path):
    with trajstore.Writer(tmp_path / "d") as w, _deadline(), pytest.raises(BatchError, match="contains itself"):
        w.append(0, {"x": torch.zeros(2, 3)}, meta={"m": _twice()})


def test_has_tensor_walks_shared_dicts_once():
    """A dict met twice without a cycle is no error; 60 levels of two references to one dict (2**60
    paths) are walked in a moment."""
    d: dict = {"leaf": 1}
    for _ in range(60):
        d = {"a": d, "b": d}
    with _deadline():
        assert values.has_tensor(d) is False
        d["t"] = np.zeros(2, np.float32)
        assert values.has_tensor(d) is True


shared = st.dictionaries(st.text(max_size=3), st.integers() | st.text(max_size=4), max_size=3)


@settings(max_examples=25, deadline=None)
@given(shared, st.integers(1, 3))
def test_shared_values_without_a_cycle_round_trip(tmp_path_factory, sub, times):
    """The same dict in several places of a row (no cycle) is stored and read back as equal copies."""
    d = tmp_path_factory.mktemp("s")
    batch = {"x": torch.zeros(2, 3), "info": [{f"k{i}": sub for i in range(times)}, {"k0": sub}],
             "rows": [{"t": torch.ones(2), "m": sub, "n": sub}, {"t": torch.zeros(2), "m": sub, "n": {}}]}
    with trajstore.Writer(d) as w, _deadline():
        w.append(0, batch)
    assert_batch_equal(trajstore.Reader(d)[0], batch)
