"""Cheap checks of a batch's structure, run by ``Writer.append`` on the caller's thread.

Encoding runs in the background, so a batch that cannot be stored would otherwise only fail at
the next ``append``/``flush``. These checks look at types, dtypes, keys, shapes and lengths -
never at tensor values, never a GPU sync - and raise the same errors (same messages) the encoder
would. They are conservative: what they let through is still fully checked by ``schema.encode``
in the background (a failure there is raised as ``WriterError`` naming the step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .. import schema
from ..errors import UnsupportedTypeError

__all__ = ["check"]


_where = schema._where


def _tensor(x: Any, path: tuple) -> None:
    if isinstance(x, torch.Tensor):
        schema.check_tensor(x, path)


def _keys(d: Mapping, path: tuple) -> None:
    for k in d:
        if type(k) is not str:
            raise UnsupportedTypeError(f"field {_where(path)!r}: key {k!r} is not a str")


def _ctx(batch: Mapping) -> dict:
    """Batch size (and T / N where known without reading GPU memory) like ``schema._layout``."""
    cu = batch.get("cu_seqlens")
    if isinstance(cu, torch.Tensor | np.ndarray) and cu.ndim == 1 and cu.shape[0] >= 1:
        n = None
        if isinstance(cu, np.ndarray) or cu.device.type == "cpu":
            n = int(cu[-1])
        return {"form": "packed", "B": int(cu.shape[0]) - 1, "N": n}
    m = batch.get("attention_mask")
    if isinstance(m, torch.Tensor | np.ndarray) and m.ndim >= 2:
        return {"form": "padded", "B": int(m.shape[0]), "T": int(m.shape[1])}
    return {"form": "plain", "B": None}


def _field(v: Any, path: tuple, ctx: dict) -> None:
    B = ctx["B"]
    if isinstance(v, torch.Tensor) or (isinstance(v, np.ndarray) and v.dtype.kind in "biuf"):
        _tensor(v, path)
        if v.ndim == 0 or B is None or path == ("cu_seqlens",):
            return
        shape = list(v.shape)
        if ctx["form"] == "padded" and v.ndim >= 2 and shape[:2] == [B, ctx["T"]]:
            return
        if ctx["form"] == "packed" and (ctx["N"] is None or shape[0] == ctx["N"]):
            return
        if shape[0] != B:
            raise schema.length_error(path, shape, ctx)
        return
    if isinstance(v, Mapping):
        _keys(v, path)
        for k, x in v.items():
            _field(x, path + (k,), ctx)
        return
    if isinstance(v, list | tuple) or (isinstance(v, np.ndarray) and v.dtype.kind == "O" and v.ndim == 1):
        if B is not None and len(v) != B:
            raise schema.entries_error(path, len(v), B)
        _elems(list(v), path)


def _elems(elems: list, path: tuple) -> None:
    """Per-trajectory values: tensors, dicts (str keys), or JSON values of supported types."""
    for i, e in enumerate(elems):
        if e is None or isinstance(e, str | bool | int | float | np.generic):
            continue
        if isinstance(e, torch.Tensor):
            _tensor(e, path + (i,))
        elif isinstance(e, Mapping):
            _keys(e, path)
            for k, x in e.items():
                if isinstance(x, list | dict):
                    if not _has_tensor(x):
                        schema.check_json(x, f"field {_where(path + (k,))!r} row {i}")
                elif isinstance(x, torch.Tensor):
                    _tensor(x, path + (k, i))
                elif not (x is None or isinstance(x, str | bool | int | float | np.ndarray | np.generic)):
                    raise UnsupportedTypeError(
                        f"field {_where(path + (k,))!r} row {i}: value of type {type(x).__name__} "
                        "cannot be stored exactly")
        elif isinstance(e, list):
            if not _has_tensor(e):
                schema.check_json(e, f"field {_where(path)!r} row {i}")
        elif not isinstance(e, np.ndarray | tuple):
            raise UnsupportedTypeError(
                f"field {_where(path)!r} row {i}: value of type {type(e).__name__} cannot be stored "
                "exactly; use None, bool, int, float, str, list or dict with str keys (or a tensor / "
                "numpy array)")


def _has_tensor(v: Any) -> bool:
    """Whether a tensor or array is anywhere inside ``v`` (iterative: values may nest deeply)."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor | np.ndarray):
            return True
        if isinstance(x, Mapping):
            stack.extend(x.values())
        elif isinstance(x, list | tuple):
            stack.extend(x)
    return False


def check(batch: Any) -> None:
    """Raise BatchError / UnsupportedTypeError for what can be seen without reading values."""
    if isinstance(batch, Mapping):
        for k in batch:
            if type(k) is not str:
                raise UnsupportedTypeError(f"batch key {k!r} is a {type(k).__name__}; keys must be str")
        ctx = _ctx(batch)  # plain dicts (B None): the encoder infers the batch size, lengths are its job
        for k, v in batch.items():
            _field(v, (k,), ctx)
    elif isinstance(batch, list | tuple):
        for i, e in enumerate(batch):
            if e is None:
                continue
            if not isinstance(e, Mapping):
                raise UnsupportedTypeError(
                    "a list batch must hold one dict (or None) per trajectory; "
                    f"got {sorted({type(x).__name__ for x in batch})}")
            _keys(e, (i,))
    else:
        raise UnsupportedTypeError(
            f"batch of type {type(batch).__name__} is not supported; pass a dict of tensors, "
            "a list of per-trajectory dicts, a TensorDict or a DataProto-like object")
