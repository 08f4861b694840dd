"""The one walk of a batch's dict/list/tuple structure (``map_tree``) and its tensor form
(``map_tensors``: ``fn`` on every torch tensor, TensorDict and DataProto-like containers rebuilt as
they were). The writer's snapshot (``trajstore/write/snapshot.py``) and the reader's staging
(``bridge.py``) walk a batch with it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..format.batch import containers

__all__ = ["map_tree", "map_tensors", "leaves"]


def map_tree(obj: Any, leaf: Callable[[Any, tuple | None], Any], path: tuple | None = None) -> Any:
    """Rebuild the dict/list/tuple structure of ``obj`` (one new container per container) with
    ``leaf(value, path)`` in place of every other value. ``path`` is the value's key/index path
    from ``obj`` when a starting path is given (``()``), else None (no tuples are built, and a
    tensor, the most common value, goes to ``leaf`` without a call of its own)."""
    if isinstance(obj, dict):
        if path is None:
            return {k: leaf(v, None) if isinstance(v, torch.Tensor) else map_tree(v, leaf) for k, v in obj.items()}
        return {k: map_tree(v, leaf, path + (k,)) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        if path is None:
            out = [leaf(v, None) if isinstance(v, torch.Tensor) else map_tree(v, leaf) for v in obj]
        else:
            out = [map_tree(v, leaf, path + (i,)) for i, v in enumerate(obj)]
        return out if isinstance(obj, list) else tuple(out)
    return leaf(obj, path)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Rebuild dict/list/tuple structure with ``fn`` applied to every torch tensor; a TensorDict or
    DataProto-like batch comes back as the same kind of container (``adapters``)."""
    return map_tree(obj, _TensorLeaf(fn))


class _TensorLeaf:
    """``map_tensors``' leaf: ``fn`` on a tensor, containers rebuilt around it. A class, not a
    closure that calls itself: such a closure is a reference cycle holding ``fn`` and all it holds
    (a step's tensors, its device batch) until Python's cycle collector runs, whose pauses then
    free whole steps with every thread stopped (``tests/test_torch_bridge.py``)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[torch.Tensor], Any]):
        self.fn = fn

    def __call__(self, x: Any, _path: tuple | None) -> Any:
        if isinstance(x, torch.Tensor):
            return self.fn(x)
        if x is None or isinstance(x, str | int | float | bool | np.ndarray | np.generic):
            return x
        plain, tag = containers.unwrap(x)
        if tag is not None:
            return containers.wrap(map_tree(plain, self), tag)
        if isinstance(x, Mapping):
            return {k: map_tree(v, self) for k, v in x.items()}
        return x


def leaves(obj: Any) -> list[torch.Tensor]:
    """Every torch tensor of ``obj``, in ``map_tensors`` order."""
    out: list[torch.Tensor] = []
    map_tensors(obj, lambda t: out.append(t) or t)
    return out
