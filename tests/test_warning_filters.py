"""Decoding a read-only Arrow buffer into a tensor (``format.dtypes.from_storage``) keeps torch's warning about
read-only arrays from the user without changing the process's warning filters: several prefetch threads
decode at once, and ``warnings.catch_warnings`` on each of their calls, interleaved, once left an "ignore
UserWarning" filter behind, silencing every later UserWarning of the program (trajstore's own warnings
included)."""

import sys
import threading
import warnings

import numpy as np
import pytest
import torch

import trajstore
from trajstore.format import dtypes as dt


@pytest.fixture
def fresh(monkeypatch):
    """from_storage as in a new process: torch's read-only warning not yet taken."""
    monkeypatch.setattr(dt, "_read_only_quiet", False)


def _read_only(n=4, dtype=np.int32):
    return np.frombuffer(bytes(n * np.dtype(dtype).itemsize), dtype)


def test_concurrent_decodes_leave_the_warning_filters_as_they_were(fresh, tmp_path):
    """Bursts of 8 threads converting read-only arrays at once, thread switches every 10 us (after which
    the old per-call ``catch_warnings`` had left its filter behind one time in three), then a deep prefetch
    replay: after each, the filters are the ones before, and a UserWarning of the program is still shown."""
    before = list(warnings.filters)
    a = _read_only()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        def run():
            for _ in range(2000):
                assert dt.from_storage(a, "int32").dtype == torch.int32

        for _ in range(10):
            ts = [threading.Thread(target=run) for _ in range(8)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert list(warnings.filters) == before
    finally:
        sys.setswitchinterval(old)
    with trajstore.Writer(tmp_path / "r") as w:
        for s in range(12):
            w.append(s, {"input_ids": torch.arange(40).reshape(4, 10) + s, "logprobs": torch.randn(4, 10)})
    got = list(trajstore.Reader(tmp_path / "r").iter(prefetch=8))
    assert len(got) == 12 and torch.equal(got[3][1]["input_ids"], torch.arange(40).reshape(4, 10) + 3)
    assert list(warnings.filters) == before
    with pytest.warns(UserWarning, match="the program's own"):
        warnings.warn("the program's own", UserWarning)


def test_the_filters_are_touched_once_and_torchs_warning_never_shown(fresh, monkeypatch):
    calls = []
    real = warnings.catch_warnings

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(dt.warnings, "catch_warnings", counting)
    with real(record=True) as shown:
        warnings.simplefilter("always")
        for i in range(50):
            t = dt.from_storage(_read_only(3 + i % 2), "int32")
            assert t.dtype == torch.int32 and t.tolist() == [0] * (3 + i % 2)
        assert dt.from_storage(np.ones(3, np.float32), "float32").tolist() == [1.0] * 3  # writable
        b = dt.from_storage(_read_only(2, np.int16), "bfloat16")
        assert b.dtype == torch.bfloat16 and b.view(torch.int16).tolist() == [0, 0]
    assert len(calls) == 1 and dt._read_only_quiet
    assert not [w for w in shown if dt._TORCH_READ_ONLY in str(w.message)]


def test_a_torch_that_warns_every_time_stays_quiet_and_guarded(fresh, monkeypatch):
    """A torch whose read-only warning comes on every call: each conversion is guarded (under the lock),
    the user never sees it, and a warning another thread gives meanwhile is shown, not swallowed."""
    real = torch.from_numpy

    def loud(a):
        warnings.warn("The given NumPy array is not writable (every time)", UserWarning)
        warnings.warn("someone else's", RuntimeWarning)
        return real(a)

    monkeypatch.setattr(torch, "from_numpy", loud)
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        for _ in range(3):
            assert dt.from_storage(_read_only(), "int32").tolist() == [0] * 4
    assert not dt._read_only_quiet
    msgs = [str(w.message) for w in shown]
    assert not [m for m in msgs if dt._TORCH_READ_ONLY in m]
    assert msgs.count("someone else's") == 6  # two conversions a call, three calls
    assert list(warnings.filters) == before
