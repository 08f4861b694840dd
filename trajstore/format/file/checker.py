"""What each check of a step file's spec asks of the file, and the decode budget (``format/file/validate.py``
walks the spec with it): a column the spec names, of the Arrow type and dtype the node says (3.2: by the
file's format version), a dtype trajstore writes, row indices within the file, a token field's pad and pad
column; ``add`` counts what the decode will allocate beyond the data itself against
``limits.MAX_DECODED_BYTES`` (``Over`` past it). Each raises ``envelope.Bad`` with what does not fit."""

from __future__ import annotations

import pyarrow as pa

from .. import dtypes as dt
from .. import limits
from .envelope import Bad

LIBS = ("torch", "numpy", "np_scalar")


class Over(Exception):
    """A decode over ``limits.MAX_DECODED_BYTES``: ``(nbytes, what)``."""


def need_int(v, what: str, lo: int = 0) -> int:
    if type(v) is not int or v < lo:
        raise Bad(f"{what} is {v!r}, expected an int >= {lo}")
    return v


def need_str(v, what: str) -> str:
    if type(v) is not str:
        raise Bad(f"{what} is {v!r}, expected a string")
    return v


class Checker:
    """The file's columns (``types``, the dtypes their field metadata names), its row count ``n``, its spec
    and format version, and the bytes the decode allocates so far (``bytes``)."""

    def __init__(self, schema: pa.Schema, n: int, spec: dict, version=None, budget: bool = True):
        self.budget = budget  # False: the decode budget is not applied (DuckDB reads the columns itself)
        self.types = {f.name: f.type for f in schema}
        self.dtypes = {f.name: (f.metadata or {}).get(b"trajstore.dtype") for f in schema}
        self.n = n
        self.bytes = 0
        self.spec = spec
        self.version = version  # the file's format version
        self.v = version if type(version) is int else 1  # ...as the storage types go by it (3.2)

    def add(self, nbytes: int, what: str) -> None:
        self.bytes += nbytes
        if self.budget and self.bytes > limits.MAX_DECODED_BYTES:
            raise Over(self.bytes, what)

    def col(self, node: dict, key: str, expect) -> str:
        name = need_str(node.get(key), f"column name {key!r}")
        if name not in self.types:
            raise Bad(f"column {name!r} named in the spec is missing from the file")
        t = self.types[name]
        if not expect(t):
            raise Bad(f"column {name!r} has Arrow type {t}, which does not fit the spec")
        return name

    def tcol(self, node: dict, key: str, name: str, listed: bool = True) -> str:
        """A tensor column of dtype ``name``: its Arrow type (3.2: by the file's version; a list column
        of int64 may hold int32 from version 6) and the
        dtype its field metadata names (a float32 column of a float32 field or of a widened
        bfloat16 one look alike)."""
        want, values = dt.arrow_type(name, self.v), dt.list_types(name, self.v)
        col = self.col(node, key, (lambda t: pa.types.is_large_list(t) and t.value_type in values) if listed
                       else (lambda t: t == want))
        m = self.dtypes.get(col)
        if m is not None and m != name.encode():
            raise Bad(f"column {col!r} has Arrow type {self.types[col]} of dtype {m.decode(errors='replace')!r}, "
                      f"the spec says {name}")
        return col

    def dtype(self, node: dict) -> tuple[str, int]:
        name, lib = node.get("dtype"), node.get("lib")
        if type(name) is not str or not dt.known(name):
            raise Bad(f"dtype {name!r} is not one trajstore writes")
        if lib not in LIBS:
            raise Bad(f"lib {lib!r} is not one of {LIBS}")
        if lib == "torch" and name in ("uint16", "uint32", "uint64"):
            raise Bad(f"dtype {name} has no torch equivalent")
        if lib != "torch" and name == "bfloat16":
            raise Bad("bfloat16 has no numpy equivalent")
        return name, dt.storage_numpy(name).itemsize

    def rows(self, node: dict, key: str) -> None:
        v = node.get(key, [])
        if type(v) is not list or any(type(i) is not int or not 0 <= i < self.n for i in v):
            raise Bad(f"{key!r} must list row indices in [0, {self.n}), got {str(v)[:80]}")

    def pad(self, node: dict, name: str, size: int) -> None:
        """A token field's ``pad`` (an int of the dtype's width) and its ``pad_col`` column."""
        pad = node.get("pad")
        lo, hi = (0, 1 << 8) if size == 1 else (-(1 << (8 * size - 1)), 1 << (8 * size - 1))
        if pad is not None and (type(pad) is not int or not lo <= pad < hi):
            raise Bad(f"pad {pad!r} is not an int of {size * 8} bits")
        if "pad_col" in node:
            self.tcol(node, "pad_col", name)
