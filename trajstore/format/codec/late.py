"""Token values joined as they are stored and converted on the GPU (a read to a CUDA device: ``Reader.iter``
/ ``read(step, device=...)``): an int64 identifier column stored as int32 (docs/FORMAT.md 3.2) is joined
into the pinned arena as its int32 values, and a bool column as its bitmap's bytes; the device
widens or unpacks them after the copy (``device/bridge.py``, ``device/pad.py``). The host then copies and sends 4
bytes a token instead of 8, and a bit instead of a byte, and converts nothing (benchmarks/RESULTS.md,
issue 23, tenth round).

``LateColumns`` is the ``Columns`` of such a decode; only the columns of packed token fields are joined
so, and the int64 and bool ones of padded token fields: their int32 values or bitmaps are the fill jobs' values,
which the device's pad plan widens or unpacks as it places them (``device/plan.py``, ``pad.py``). A packed column joined so is
handed out by ``flat_parts`` (the packed field's values, used whole) as a placeholder of its decoded dtype
that the host never fills, with a ``Late`` record the stager turns into the conversion on the device; any other use of the column
(``list_parts``) converts it on the host first, and the stager fills a placeholder it does not find among
the batch's tensors on the host (``Late.fill``), so nothing else ever sees one unfilled.
``flat_nbytes`` sizes the pinned arena a step is decoded into.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ...base.threads import PIECE_BYTES, balance, pieces, run_parallel
from .. import dtypes as dt
from ..arrow import Columns
from ..numpy_view import _offsets, _raw, _sliced, unpack_bits

__all__ = ["Late", "LateColumns", "flat_nbytes", "host_values"]


class Late:
    """A placeholder ``out`` (the decoded values' dtype, unfilled) and the values it stands for, as stored:
    ``stored`` int32 values of an int64 field (``kind`` "int64"), or a bool field's bitmap bytes whose
    first value is bit ``shift`` of the first byte, least significant bit first ("bool")."""

    __slots__ = ("out", "stored", "kind", "shift")

    def __init__(self, out: np.ndarray, stored: np.ndarray, kind: str, shift: int) -> None:
        self.out, self.stored, self.kind, self.shift = out, stored, kind, shift

    def fill(self) -> None:
        """The placeholder filled on the host (its values were not sent as stored)."""
        self.out[...] = host_values(self.stored, self.kind, self.shift, len(self.out))


def host_values(stored: np.ndarray, kind: str, shift: int, n: int) -> np.ndarray:
    """``n`` values held as ``stored`` (see ``Late``), converted on the host."""
    if kind == "int64":
        return stored.astype(np.int64)
    return unpack_bits(stored, shift, n)


class LateColumns(Columns):
    """``Columns`` whose int64-as-int32 and bool large_list columns are joined as stored (see the module
    doc); ``late`` collects the ``Late`` records of the placeholders handed out."""

    def __init__(self, table: pa.Table, where: str, alloc: Any, joined: dict | None, late: list,
                 only: set[str], direct: Any = None) -> None:
        super().__init__(table, where, alloc, joined, direct)
        self.late, self.only = late, only  # only: the token fields' columns it may join so
        self._stored: dict[str, tuple[np.ndarray, np.ndarray, str, int]] = {}  # joined as stored, not handed out
        self._handed: dict[str, tuple[np.ndarray, Late]] = {}
        self._host = False  # inside ``list_parts``: a join converts on the host

    def _join(self, names: list[tuple[str, str]]) -> None:
        if not self._host:
            names = [(n, d) for n, d in names if n not in self._stored and n not in self._handed
                     and not self._as_stored(n, d)]
        super()._join(names)

    def _as_stored(self, name: str, dtype: str) -> bool:
        """Join column ``name`` as stored where it is one such column (else False: the ordinary join, whose
        checks raise what a damaged column holds)."""
        if dtype not in ("int64", "bool") or name not in self.only or name in self._parts or not self.has(name):
            return False
        col = self.col(name)
        if not pa.types.is_large_list(col.type) or col.null_count:
            return False
        t = col.type.value_type
        if dtype == "bool" and pa.types.is_boolean(t):
            a = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
            vals = _sliced(a)
            if not len(vals) or vals.null_count:
                return False
            shift, first = vals.offset % 8, vals.offset // 8
            nb = (shift + len(vals) + 7) // 8
            stored = self.alloc(nb, np.uint8)
            bits = np.frombuffer(vals.buffers()[1], np.uint8, count=nb, offset=first)
            if self.direct is None or not self.direct.send(stored, bits):
                stored[...] = bits
            self._stored[name] = (_offsets([a]), stored, "bool", shift)
            return True
        if dtype != "int64" or t != pa.int32():
            return False
        parts = [_raw(_sliced(c), dtype, name, self.where) for c in col.chunks]
        off = _offsets(col.chunks)
        if not int(off[-1]):
            return False
        stored = self.alloc(int(off[-1]), np.int32)
        p, copies = 0, []
        for v in parts:  # in pieces on the pool, as ``Columns._join`` copies
            dst = stored[p:p + len(v)]
            p += len(v)
            if self.direct is not None and self.direct.send(dst, v):
                continue
            copies += [(v[s], dst[s]) for s in pieces(len(v), v.itemsize)]
        run_parallel(lambda group: [d.__setitem__(Ellipsis, s) for s, d in group],
                     balance(copies, lambda x: x[1].nbytes, PIECE_BYTES), stored.nbytes)
        self._stored[name] = (off, stored, "int64", 0)
        return True

    def flat_parts(self, name: str, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, values) of a packed field used whole: a placeholder for a column joined as stored."""
        if name not in self._parts and name not in self._stored and name not in self._handed:
            self.join([(name, dtype)])
        if name in self._stored:
            off, stored, kind, shift = self._stored.pop(name)
            rec = Late(np.empty(int(off[-1]), dt.storage_numpy(dtype)), stored, kind, shift)
            self.late.append(rec)
            self._handed[name] = (off, rec)
        if name in self._handed:
            return self._handed[name][0], self._handed[name][1].out
        self._host = True  # as ``list_parts`` joins it, its values used whole
        try:
            return super().flat_parts(name, dtype)
        finally:
            self._host = False

    def list_parts(self, name: str, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        if name in self._stored:
            off, stored, kind, shift = self._stored.pop(name)
            if self.direct is not None:
                self.direct.ready_for(stored)
            self._parts[name] = (off, host_values(stored, kind, shift, int(off[-1])))
        elif name in self._handed:  # handed out, and now wanted on the host too: filled here
            off, rec = self._handed.pop(name)
            if self.direct is not None:
                self.direct.ready_for(rec.stored)
            rec.fill()
            self.late.remove(rec)
            self._parts[name] = (off, rec.out)
        self._host = True
        try:
            return super().list_parts(name, dtype)
        finally:
            self._host = False

    def joined(self, name: str, dtype: str) -> tuple[np.ndarray, np.ndarray] | None:
        """A padded field's joined column: an int64 one joined as stored gives its int32 values, a bool one its
        bitmap's bytes (``bitmap``: its first value's bit); the pad plan widens or unpacks them on the device,
        or on the host where it builds the field there (``device/plan.py``)."""
        if name in self._stored:
            return self._stored[name][0], self._stored[name][1]
        return super().joined(name, dtype)

    def bitmap(self, name: str) -> int:
        got = self._stored.get(name)
        return got[3] if got is not None and got[2] == "bool" else -1

    def offsets(self, name: str, dtype: str) -> np.ndarray:
        if name in self._stored:
            return self._stored[name][0]
        if name in self._handed:
            return self._handed[name][0]
        return super().offsets(name, dtype)


def flat_nbytes(table: pa.Table) -> int:
    """Bytes of the tensors decoded from ``table`` in a flat layout (bools one byte each), with
    room for each tensor's alignment: the size of pinned staging to decode it into."""
    total = 1 << 20
    for f, col in zip(table.schema, table.columns):
        t = col.type.value_type if pa.types.is_large_list(col.type) else col.type
        name = (f.metadata or {}).get(b"trajstore.dtype", b"").decode(errors="replace")
        if pa.types.is_boolean(t):
            w = 1
        elif pa.types.is_integer(t) or pa.types.is_floating(t):
            # the decoded width: an int64 column stored as int32 (3.2) decodes to 8 bytes a value
            w = dt.storage_numpy(name).itemsize if dt.known(name) else t.bit_width // 8
        else:
            continue
        n = sum(len(c.values) for c in col.chunks) if pa.types.is_large_list(col.type) else len(col)
        total += n * w + 512
    return total
