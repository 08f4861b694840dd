"""Follows the structure walk of ``Writer.append(step, batch)`` with ``sys.setprofile``: the trajstore
modules and functions entered while ``format/batch/check.check`` runs on the caller's thread, and
while the encoder (``format/codec/encoder.encode_plain``) runs in the background. A *stay* is a run
of consecutive calls into one module; ``visits`` counts the stays per module."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import trajstore

ROOT = Path(trajstore.__file__).resolve().parent


@dataclass
class Walk:
    calls: list[tuple[str, str]] = field(default_factory=list)  # (module, function) per call, in order

    @property
    def modules(self) -> list[str]:
        return [m for m, _ in self.calls]

    @property
    def stays(self) -> list[str]:
        out: list[str] = []
        for m in self.modules:
            if not out or out[-1] != m:
                out.append(m)
        return out

    @property
    def visits(self) -> Counter:
        return Counter(self.stays)

    def count(self, module: str, function: str) -> int:
        return self.calls.count((module, function))


def _module(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return ".".join(rel.with_suffix("").parts)


class Tracer:
    """Records the calls made inside the functions ``roots`` (module, function) on any thread."""

    def __init__(self, roots: set[tuple[str, str]]) -> None:
        self.roots = roots
        self.walks: dict[tuple[str, str], list[Walk]] = {r: [] for r in roots}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._files: dict[str, str | None] = {}

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        fn = frame.f_code.co_filename
        mod = self._files.get(fn, "?")
        if mod == "?":
            mod = self._files[fn] = _module(fn)
        if mod is None:
            return
        key = (mod, frame.f_code.co_name)
        st = self._local.__dict__.setdefault("stack", [])  # (root key, frame) being followed
        if event == "call":
            if not st and key in self.roots:
                st.append((key, frame, Walk()))
            if st:
                st[-1][2].calls.append(key)
        elif st and st[-1][1] is frame:
            root, _, walk = st.pop()
            with self._lock:
                self.walks[root].append(walk)

    def __enter__(self) -> Tracer:
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


CHECK = ("format.batch.check", "check")
ENCODE = ("format.codec.encoder", "encode_plain")


def follow(batch: Any, tmp: Path, masks: dict | None = None) -> tuple[Walk, Walk]:
    """(the walk of ``check`` inside ``append``, the encoder's walk) of one ``Writer.append``."""
    tracer = Tracer({CHECK, ENCODE})
    with tracer, trajstore.Writer(tmp, masks=masks, workers=1) as w:
        w.append(0, batch)
        w.flush()
    (check,), (encode,) = tracer.walks[CHECK], tracer.walks[ENCODE]
    return check, encode


# ----------------------------------------------------------------------------- representative batches
def _padded() -> dict:
    torch.manual_seed(0)
    am = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    return {"input_ids": torch.randint(0, 100, (3, 4)), "attention_mask": am,
            "response_mask": torch.tensor([[0, 1, 0, 0], [0, 1, 1, 1], [0, 1, 0, 0]]),
            "old_log_probs": torch.randn(3, 4), "advantages": torch.randn(3, 4),
            "rewards": torch.randn(3), "uid": ["a", "b", "c"], "meta": {"temperature": 1.0}}


def _verl() -> dict:
    am = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    return {"prompts": torch.tensor([[0, 5, 6], [7, 8, 9]]), "responses": torch.tensor([[1, 2, 0], [3, 4, 5]]),
            "input_ids": torch.arange(12).reshape(2, 6), "attention_mask": am,
            "position_ids": torch.arange(12).reshape(2, 6), "response_mask": am[:, 3:],
            "old_log_probs": torch.randn(2, 3), "token_level_scores": torch.randn(2, 3)}


def _packed() -> dict:
    return {"input_ids": torch.arange(9), "cu_seqlens": torch.tensor([0, 4, 6, 9], dtype=torch.int32),
            "logprobs": torch.randn(9), "rewards": torch.randn(3), "data_source": ["x", "y", "z"]}


def _two_sided() -> dict:
    return {"input_ids": torch.arange(10).reshape(2, 5), "attention_mask": torch.tensor([[0, 1, 1, 1, 0],
                                                                                         [1, 1, 1, 0, 0]]),
            "loss_mask": torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 0, 0]]), "values": torch.randn(2, 5)}


def _multi_mask() -> tuple[dict, dict]:
    b = {"input_ids": torch.arange(8).reshape(2, 4), "prompt_ids": torch.arange(6).reshape(2, 3),
         "prompt_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]), "completion_ids": torch.arange(10).reshape(2, 5),
         "completion_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]),
         "turn_mask": torch.tensor([[1, 0, 1, 1], [1, 1, 0, 1]]), "rewards": torch.randn(2)}
    return b, {"turn_mask": ["input_ids"]}


def _list() -> list:
    return [{"input_ids": torch.arange(n), "attention_mask": torch.ones(n, dtype=torch.int64), "reward": float(n),
             "text": f"row {n}", "extra": {"tool": "calc", "scores": torch.randn(2)}} for n in (3, 5, 2)]


def _dataproto() -> Any:
    from types import SimpleNamespace

    td = pytest_importorskip_tensordict()
    b = _padded()
    batch = td.TensorDict({k: v for k, v in b.items() if isinstance(v, torch.Tensor)}, batch_size=[3])
    return SimpleNamespace(batch=batch, non_tensor_batch={"uid": np.array(["a", "b", "c"], dtype=object)},
                           meta_info={"temperature": 1.0})


def pytest_importorskip_tensordict() -> Any:
    import tensordict

    return tensordict


def _tensordict() -> Any:
    td = pytest_importorskip_tensordict()
    b = _padded()
    return td.TensorDict({k: v for k, v in b.items() if isinstance(v, torch.Tensor)}, batch_size=[3])


# name -> (make the batch, masks)
BATCHES: dict[str, Callable[[], tuple[Any, dict | None]]] = {
    "padded": lambda: (_padded(), None),
    "verl-parts": lambda: (_verl(), None),
    "packed": lambda: (_packed(), None),
    "two-sided": lambda: (_two_sided(), None),
    "multi-mask": _multi_mask,
    "list": lambda: (_list(), None),
    "dataproto": lambda: (_dataproto(), None),
    "tensordict": lambda: (_tensordict(), None),
}


def main() -> None:
    import tempfile

    for name, make in BATCHES.items():
        try:
            batch, masks = make()
        except ImportError as e:
            print(f"{name}: skipped ({e})")
            continue
        with tempfile.TemporaryDirectory() as d:
            chk, enc = follow(batch, Path(d), masks)
        for what, walk in (("check", chk), ("encode", enc)):
            v = walk.visits
            print(f"{name:11} {what:6} stays {len(walk.stays):3}  " + "  ".join(
                f"{m.split('.')[-1]} {n}" for m, n in v.most_common()))
        print("   ", " > ".join(m.split(".")[-1] for m in chk.stays))


if __name__ == "__main__":
    main()
