"""Reading other tools' dump files for ``trajstore import``: the ONE place trajstore loads a
pickle-based file.

* :func:`load_weights_only` reads a ``torch.save`` file with ``torch.load(weights_only=True)``,
  torch's restricted loader (tensors, numbers, strings, lists, tuples, dicts; no other class is
  built and no code from the file runs). A file that needs more raises :class:`NeedsTrust`.
* :func:`unpickle_trusted` unpickles without that restriction. Unpickling runs code named by the
  file, so it is only ever called when the user passed ``--trust-pickle`` (``trust_pickle=True``)
  for files they made themselves. It is the only function of the package that unpickles; it
  never imports verl or ROLL: their ``DataProto`` classes are read into :class:`PickledDataProto`
  stand-ins (``STAND_INS``) that keep the class's name, so the imported step comes back as the
  real class where that class is loaded (``trajstore/format/batch/containers.py``).
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import FormatError, TrajstoreError

__all__ = ["NeedsTrust", "PickledDataProto", "STAND_INS", "load_weights_only", "unpickle_trusted"]


class NeedsTrust(TrajstoreError):
    """The file holds objects ``torch.load(weights_only=True)`` does not build."""


class PickledDataProto:
    """A verl / ROLL ``DataProto`` as read from a pickle: ``batch`` (TensorDict or None),
    ``non_tensor_batch`` (dict of numpy arrays), ``meta_info`` (dict). Subclassed per source class
    (:data:`STAND_INS`) under that class's module and name."""

    remote_batch: Any = None  # ROLL: fields held by another process (not in the file)

    def __init__(self, batch: Any = None, non_tensor_batch: dict | None = None, meta_info: dict | None = None):
        self.batch = batch
        self.non_tensor_batch = {} if non_tensor_batch is None else non_tensor_batch
        self.meta_info = {} if meta_info is None else meta_info

    def __setstate__(self, state: Any) -> None:
        self._state = state  # decoded by unpickle_trusted once the outer pickle is read

    def __len__(self) -> int:
        if self.batch is not None and len(self.batch.batch_size):
            return int(self.batch.batch_size[0])
        return len(next(iter(self.non_tensor_batch.values()), ()))


def _stand_in(module: str, name: str) -> type:
    return type(name, (PickledDataProto,), {"__module__": module, "__qualname__": name})


STAND_INS = {(m, "DataProto"): _stand_in(m, "DataProto")
             for m in ("verl.protocol", "roll.distributed.scheduler.protocol")}


def load_weights_only(path: Path) -> Any:
    """``torch.load(path, weights_only=True)`` on CPU; :class:`NeedsTrust` if the file holds classes it
    does not build, :class:`FormatError` if it is no pickle it understands."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        m = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if m is None:  # not a pickle torch.load(weights_only=True) understands (or a damaged file)
            why = re.search(r"WeightsUnpickler error:\s*(.+)", str(e))
            raise FormatError(f"{path}: not readable by torch.load(weights_only=True) "
                              f"({why.group(1) if why else str(e).splitlines()[0]})") from None
        raise NeedsTrust(f"{path}: torch.load(weights_only=True) cannot read it: it holds {m.group(1)}") from None


def unpickle_trusted(path: Path) -> Any:
    """Unpickle ``path`` with no restriction. ONLY for ``trust_pickle=True``: this runs code named by
    the file. ``.pt``/``.pth`` files go through ``torch.load(weights_only=False)``, other files
    through ``pickle``; verl / ROLL ``DataProto`` objects become :class:`PickledDataProto` stand-ins
    (their inner TensorDict, saved by ``torch.save`` or verl's numpy serialization, is loaded too)."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            return STAND_INS.get((module, name)) or super().find_class(module, name)

    with open(path, "rb") as f:
        if path.suffix in (".pt", ".pth"):
            return torch.load(f, map_location="cpu", weights_only=False)
        obj = Unpickler(f).load()
    if isinstance(obj, PickledDataProto) and hasattr(obj, "_state"):
        state = obj.__dict__.pop("_state")
        if not (isinstance(state, tuple) and len(state) in (3, 4)):
            raise TrajstoreError(f"{path}: a DataProto whose pickled state is a {type(state).__name__}, not the "
                                 "(batch, non_tensor_batch, [remote_batch,] meta_info) tuple verl and ROLL write")
        raw, obj.non_tensor_batch, obj.meta_info = state[0], state[1], state[-1]
        obj.remote_batch = state[2] if len(state) == 4 else None  # ROLL's newer DataProto adds it
        if isinstance(raw, tuple):  # VERL_DATAPROTO_SERIALIZATION_METHOD=numpy
            obj.batch = _numpy_serialized(raw)
        elif raw is not None:
            buf = raw if isinstance(raw, io.BytesIO) else io.BytesIO(raw)
            buf.seek(0)
            obj.batch = torch.load(buf, map_location="cpu", weights_only=False)
    return obj


def _numpy_serialized(raw: tuple) -> Any:
    """verl's ``serialize_tensordict`` output (batch_size, device, {key: (dtype, shape, bytes)})."""
    from tensordict import TensorDict

    batch_size, _device, items = raw
    out = {}
    for k, v in items.items():
        if len(v) != 3:
            raise TrajstoreError(f"field {k!r}: nested tensors of verl's numpy serialization are not supported")
        dtype, shape, data = v
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise TrajstoreError(f"field {k!r}: {dtype!r} is not a torch dtype")
        out[k] = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).view(shape)
    return TensorDict(out, batch_size=batch_size)
