"""AReaL (areal 1.0.4): single-controller ``RTensor`` values, stored as their local tensors.

In single-controller mode the rollout batch the trainer holds (``actor.prepare_batch``, then the
``values`` / ``ref_logp`` / ``prox_logp`` it adds) is a list of trajectory dicts whose tensors are
``RTensor``s (``areal/infra/rpc/rtensor.py``): a shard handle (``shard``: shard id and node address)
and ``data``, a tensor on the meta device (shape and dtype, no values) until it is fetched. trajstore
stores each RTensor as its local tensor ("localized"), so a dump of such a batch is the same file as
a dump of the batch the engines see after ``RTensor.localize``, and replay hands back plain tensors.

When and how, so that ``Writer.append`` stays cheap and never waits for the network:

* ``Writer.append`` checks the batch (``format/batch/check.py``); one refused there is checked again on
  ``check_view(batch)``, where each remote RTensor stands in as a one-element tensor expanded to
  its shape and dtype (so batches without RTensors pay nothing). Nothing is fetched.
* The snapshot taken at ``append`` (``snapshot.py``) starts one batched fetch of all the batch's
  remote RTensors on a background thread (``fetch``), right away, so the shards are read before
  the trainer frees them at the end of its step (``clear_batches``); the writer's encoder waits
  for it. An RTensor whose ``data`` is already local is taken like any CPU tensor.
* The fetch goes through AReaL's own ``RTensor.localize``, on *copies* of the RTensors: the
  trainer's own RTensors stay remote. An RTensor holding local data is serialized whole by AReaL's
  RPC (``areal.infra.rpc.serialization``), so localizing the trainer's objects in place would
  make every later engine call ship the full tensors. The fetched tensors also land in AReaL's
  client-side fetch buffer, which ``clear_batches`` empties as usual.
* A fetch that fails (a shard already freed) fails that step in the background (``on_error``);
  the Recorder records it as skipped and training goes on.

An RTensor is recognised by its class's module and name; areal is never imported here.
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["RTENSOR_MODULE", "is_rtensor", "is_remote", "check_view", "fetch", "nbytes"]

RTENSOR_MODULE = "areal.infra.rpc.rtensor"

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def is_rtensor(v: Any) -> bool:
    """``v`` is an AReaL ``RTensor`` (by class module and name; areal is not imported)."""
    t = type(v)
    return t.__name__ == "RTensor" and t.__module__ == RTENSOR_MODULE


def is_remote(rt: Any) -> bool:
    """An RTensor whose values are not in this process yet (``data`` on the meta device)."""
    return bool(rt.data.is_meta)


def nbytes(rt: Any) -> int:
    return rt.data.numel() * rt.data.element_size()


def _stand_in(rt: Any) -> torch.Tensor:
    """A tensor of the RTensor's shape and dtype for the structure check: its local data, else one
    element expanded (no values are read from it)."""
    d = rt.data
    if not d.is_meta:
        return d
    return torch.empty((), dtype=d.dtype).expand(d.shape)


_MAX_DEPTH = 16  # RTensors sit at most 4 levels down (list, dict, multi_modal_input list, dict)


def _replace(obj: Any, cls: type, depth: int = 0) -> Any:
    """``obj`` with a stand-in (``_stand_in``) in place of each ``cls`` (RTensor) value in its
    dicts, lists and tuples down to ``_MAX_DEPTH`` levels; ``obj`` itself where it holds none
    (nothing is copied then)."""
    if type(obj) is cls:
        return _stand_in(obj)
    if depth > _MAX_DEPTH:
        return obj
    if isinstance(obj, dict):
        new = None
        for k, v in obj.items():
            if type(v) is torch.Tensor:  # the common leaf, at the cost of one check
                continue
            r = _replace(v, cls, depth + 1)
            if r is not v:
                new = dict(obj) if new is None else new
                new[k] = r
        return obj if new is None else new
    if isinstance(obj, list | tuple):
        items = None
        for i, v in enumerate(obj):
            if type(v) is torch.Tensor:
                continue
            r = _replace(v, cls, depth + 1)
            if r is not v:
                items = list(obj) if items is None else items
                items[i] = r
        if items is None:
            return obj
        return items if isinstance(obj, list) else tuple(items)
    return obj


def check_view(batch: Any) -> Any:
    """``batch`` as ``Writer.append`` checks it: each RTensor replaced by a tensor of its shape and
    dtype (its local data where it has it). ``batch`` itself when AReaL's RTensor module is not
    loaded in this process (then no batch can hold one) or the batch holds none."""
    cls = getattr(sys.modules.get(RTENSOR_MODULE), "RTensor", None)
    return batch if cls is None else _replace(batch, cls)


def _localize(rts: list) -> list[torch.Tensor]:
    cls = type(rts[0])
    copies = [cls(shard=rt.shard, data=rt.data) for rt in rts]  # the trainer's own stay remote
    out = cls.localize(copies)
    return [t if t.device.type == "cpu" else t.cpu() for t in out]


def fetch(rts: list) -> Future:
    """Start fetching the values of the remote RTensors ``rts`` through AReaL's ``RTensor.localize``
    (one batched fetch, on a background thread); the future gives their CPU tensors in order."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="trajstore-rtensor")
        return _pool.submit(_localize, list(rts))
