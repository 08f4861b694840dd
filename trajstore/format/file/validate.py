"""Check a step file's stored description (its "spec") before decoding it.

A file is input: its spec may lie (wrong column names or types, negative or huge shapes,
indices out of range).  ``check`` walks the spec once, checks every node's types and
ranges against the Parquet schema and row count, and bounds the memory the decode will
allocate beyond the data itself (padded outputs and their masks, inline tensors, fixed-width
strings, a Python object per row of each per-trajectory node) by ``limits.MAX_DECODED_BYTES``
(``TRAJSTORE_MAX_DECODED_BYTES``; ``limits.check_pages`` bounds what pyarrow decompresses,
``limits.load_doc`` the description's JSON). The envelope's parts (shards, wrappers,
struct key orders) are checked in ``format/file/envelope.py``, the columns a node names and the running
decode budget in ``format/file/checker.py``. Everything raises FormatError naming the file.
"""

from __future__ import annotations

import base64
import binascii
import math
import re

import numpy as np
import pyarrow as pa

from ...errors import FormatError
from .. import dtypes as dt
from .. import limits
from ..limits import MAX_SPEC_DEPTH as MAX_DEPTH
from ..spec import RUNS_ACTION, RUNS_COL
from .checker import Checker, Over
from .checker import need_int as _int
from .checker import need_str as _str
from .envelope import Bad as _Bad
from .envelope import check_orders, class_tag, longest, shape as _shape, shard, typed_doc as _typed, wrapper

_NP_STR = re.compile(r"^[<>|=]?(O|U\d{1,9}|S\d{1,9}|[Mm]8(\[\d{0,4}[a-zA-Z]{1,2}\])?|c(8|16))$")


class _Checker(Checker):
    """The walk of the spec's nodes, each asking ``Checker``'s questions of the file."""

    def field(self, node, depth: int) -> None:
        if type(node) is not dict:
            raise _Bad(f"a spec node is {type(node).__name__}, expected an object")
        if depth > MAX_DEPTH:
            raise _Bad(f"the spec nests deeper than {MAX_DEPTH} levels")
        t = node.get("t")
        if t == "json":
            if "v" not in node:
                raise _Bad("a scalar field has no value")
            return
        if t == "tvalue":
            if "v" not in node:
                raise _Bad("a typed value field has no value")
            _typed(node["v"], "a batch-wide typed value")
            return
        if t == "gtensor":
            name, size = self.dtype(node)
            count = math.prod(_shape(node.get("shape"), "gtensor shape"))
            data = _str(node.get("data"), "gtensor data")
            if count * size != len(data) // 4 * 3 - data[-2:].count("="):
                raise _Bad(f"an inline tensor of shape {node['shape']} {name} does not match its data")
            try:
                base64.b64decode(data, validate=True)
            except binascii.Error:
                raise _Bad(f"an inline tensor's data is not base64: {data[:40]!r}") from None
            self.add(count * size, "an inline tensor")
            if "col" in node:  # a packed step's cu_seqlens, also as a column (3.7)
                self.tcol(node, "col", name, listed=False)
        elif t == "group":
            self.keys(node, depth)
        elif t == "seq":
            self.seq(node, depth)
        elif t == "tensor":
            self.tensor(node)
        elif t == "segtensor":
            self.segments(node)
        else:
            raise _Bad(f"unknown node type {t!r}")

    def orders(self, node: dict) -> None:
        check_orders(self, node)

    def keys(self, node: dict, depth: int, child=None) -> None:
        keys = node.get("keys")
        if type(keys) is not list:
            raise _Bad("'keys' must be a list")
        seen = set()
        for kv in keys:
            if type(kv) is not list or len(kv) != 2 or type(kv[0]) is not str or kv[0] in seen:
                raise _Bad(f"a key entry {str(kv)[:60]} is not a unique [name, node] pair")
            seen.add(kv[0])
            (child or self.field)(kv[1], depth + 1)

    def tensor(self, node: dict) -> None:
        name, size = self.dtype(node)
        trail = _shape(node.get("trail"), "trail shape")
        w = math.prod(trail)
        kind = node.get("kind")
        if kind == "sample" and "axis" in node:
            raise _Bad(f"sample field {node.get('col')!r} has a token axis")
        if kind == "sample":  # its values, whatever their encoding compresses them to in the file
            self.add(self.n * w * size, f"field {node.get('col')!r} of {self.n} rows of {trail}")
        if kind == "sample" and not trail:
            self.tcol(node, "col", name, listed=False)
            return
        self.tcol(node, "col", name)
        spec = self.spec
        g = self.group(node)
        if kind == "sample":
            T = spec.get("T") if g is None else g["W"]
            if node.get("tokenlike") and (spec.get("form") not in ("padded", "masked") or trail[:1] != [T]):
                raise _Bad(f"a tokenlike field of trailing shape {trail} in a batch that is not padded to it")
            if g is not None and node.get("tokenlike") and g.get("side") is None:
                raise _Bad(f"a tokenlike field follows mask {g['src']!r}, which has holes")
            if g is not None and trail[:1] != [g["W"]]:
                raise _Bad(f"a field of trailing shape {trail} follows mask {g['src']!r} of width {g['W']}")
            return
        if kind != "token":
            raise _Bad(f"tensor kind {kind!r} is not 'token' or 'sample'")
        if "axis" in node:  # [B, C..., T] stored token-major (format version 3)
            if node["axis"] != "last" or not trail or not w:
                raise _Bad(f"token field {node['col']!r} has axis {node['axis']!r} with trailing shape {trail}")
            if type(self.version) is int and self.version < 3:
                raise _Bad(f"a token field with its token axis last in a file of format version {self.version} "
                           "(it needs 3)")
        self.pad(node, name, size)
        if spec.get("form") == "padded":  # the output, its [B, T] bool mask and the mask's arange(T)
            T = spec["T"]
            self.add(limits.padded_bytes(self.n, T, w * size), f"field {node['col']!r} padded to [{self.n}, {T}]")
        if spec.get("form") == "masked":
            if g is None or g.get("side") is None:
                raise _Bad(f"token field {node['col']!r} of a masked batch names no mask group with a side")
            masks = 3 if g.get("side") == "span" else 1  # a span's mask is built from two comparisons
            self.add(limits.padded_bytes(self.n, g["W"], w * size, masks),
                     f"field {node['col']!r} padded to [{self.n}, {g['W']}]")

    def segments(self, node: dict) -> None:
        """A segmented tensor (format version 3): counts of one run of rows per trajectory."""
        name, _ = self.dtype(node)
        if node.get("lib") not in ("torch", "numpy"):
            raise _Bad(f"a segmented tensor has lib {node.get('lib')!r}")
        if type(self.version) is int and self.version < 3:
            raise _Bad(f"a segmented tensor in a file of format version {self.version} (it needs 3)")
        w = math.prod(_shape(node.get("trail"), "trail shape"))
        counts = node.get("counts")
        if type(counts) is not list or len(counts) != self.n or any(type(c) is not int or c < 0 for c in counts):
            raise _Bad(f"the counts of a segmented tensor are not {self.n} ints >= 0")
        if w >= 1 << 62 or sum(counts) * max(w, 1) >= 1 << 62:
            raise _Bad(f"a segmented tensor of {sum(counts)} rows of {node['trail']} is too large")
        self.add(sum(counts) * w * dt.storage_numpy(name).itemsize, f"a segmented tensor of {sum(counts)} rows")
        self.tcol(node, "col", name)

    def group(self, node: dict) -> dict | None:
        """The mask group a tensor node of a masked batch follows (None: none, or another form)."""
        if "mask" not in node:
            return None
        groups, i = self.spec.get("masks"), node["mask"]
        if self.spec.get("form") != "masked" or type(i) is not int or not 0 <= i < len(groups):
            raise _Bad(f"mask reference {i!r} names no mask group of the batch")
        return groups[i]

    def masks(self, spec: dict) -> None:
        """A masked batch's mask groups: unique keys, mask fields of the batch, widths within them,
        a start column for a span."""
        groups = spec.get("masks")
        if type(groups) is not list or not groups or len(groups) > 1024:
            raise _Bad("a masked batch has no list of mask groups")
        keys = dict(spec.get("keys") or []) if type(spec.get("keys")) is list and all(
            type(kv) is list and len(kv) == 2 and type(kv[0]) is str for kv in spec["keys"]) else {}
        seen = set()
        for g in groups:
            if type(g) is not dict:
                raise _Bad("a mask group is not an object")
            key, src = _str(g.get("key"), "mask group key"), _str(g.get("src"), "mask group src")
            lo, W = _int(g.get("lo"), "mask group lo"), _int(g.get("W"), "mask group width")
            if key in seen:
                raise _Bad(f"mask group key {key!r} is used twice")
            seen.add(key)
            m = keys.get(src)
            if type(m) is not dict or m.get("t") != "tensor" or type(m.get("trail")) is not list:
                raise _Bad(f"mask group {key!r} names {src!r}, which is not a tensor field of the batch")
            full = m.get("trail")[:1] if m.get("kind") == "sample" else [
                groups[m["mask"]].get("W") if type(m.get("mask")) is int and 0 <= m["mask"] < len(groups)
                and type(groups[m["mask"]]) is dict else None]
            if not full or type(full[0]) is not int or lo + W > full[0]:
                raise _Bad(f"mask group {key!r} takes columns {lo}:{lo + W} of {src!r}, wider than it")
            if "side" not in g:
                raise _Bad(f"mask group {key!r} has no padding side")
            side = g.get("side")
            if side not in ("right", "left", "span", None):
                raise _Bad(f"mask group {key!r} has padding side {side!r}")
            if "holes" in g and (g["holes"] is not True or side is None):
                raise _Bad(f"mask group {key!r}: holes {g['holes']!r} (only true, on a group with a side)")
            if "holes" in g and type(self.version) is int and self.version < 5:
                raise _Bad(f"mask group {key!r} has holes in a file of format version {self.version} (it needs 5)")
            if (side == "span") != ("start_col" in g):
                raise _Bad(f"mask group {key!r}: a start column goes with side 'span' only")
            if side == "span":
                self.col(g, "start_col", lambda t: t == pa.int64())
            if "len_col" in g:
                self.col(g, "len_col", lambda t: t == pa.int64())

    def runs(self, node: dict, name: str) -> None:
        """A token cell whose grouped rows hold their runs only: the runs column, pad or pad_col."""
        if type(self.version) is int and self.version < 3:
            raise _Bad(f"a cell stored by runs in a file of format version {self.version} (it needs 3)")
        if node.get("runs") not in (RUNS_COL, RUNS_ACTION) or node.get("kind") != "token":
            raise _Bad(f"cell {node.get('col')!r} names runs column {node.get('runs')!r}")
        self.col(node, "runs", lambda t: t == pa.list_(pa.int64()))
        self.pad(node, name, dt.storage_numpy(name).itemsize)

    def seq(self, node: dict, depth: int) -> None:
        c = node.get("container")
        if c not in ("list", "tuple", "ndarray"):
            raise _Bad(f"container {c!r} is not list, tuple or ndarray")
        if c == "ndarray":
            s = _str(node.get("np_dtype"), "np_dtype")
            if not _NP_STR.match(s):
                raise _Bad(f"np_dtype {s!r} is not an object, str or bytes dtype")
            try:
                d = np.dtype(s)
            except TypeError:
                raise _Bad(f"np_dtype {s!r} is not understood by numpy") from None
            if d.kind in "SU" and d.itemsize == 0:
                raise _Bad(f"np_dtype {s!r}: numpy has no arrays of zero-width strings")
            digits = re.sub(r"\D", "", s) if s.lstrip("<>|=")[:1] in "USO" else ""
            self.add(self.n * (int(digits or 0) * (4 if "U" in s else 1) + 8), "a numpy string array")
        if "trail" in node:
            if c != "ndarray":
                raise _Bad(f"a {c} has a row shape")
            self.add(self.n * math.prod(_shape(node["trail"], "trail shape")) * 16, "a numpy array's rows")
        self.elem(node.get("elem"), depth + 1)

    def elem(self, node, depth: int) -> None:
        if type(node) is not dict:
            raise _Bad("an element node is not an object")
        if depth > MAX_DEPTH:
            raise _Bad(f"the spec nests deeper than {MAX_DEPTH} levels")
        self.rows(node, "none")
        self.rows(node, "missing")
        t = node.get("t")
        # one Python object per row (a dict for a struct, a tensor for a cell), whatever the file holds
        self.add(self.n * (limits.STRUCT_ROW_BYTES if t in ("struct", "cell") else limits.ROW_OBJECT_BYTES),
                 f"{self.n} rows of a per-trajectory {t} field")
        if t == "empty":
            return
        if t == "cell":
            name, _ = self.dtype(node)
            self.tcol(node, "col", name)
            self.col(node, "shape_col", lambda t: t == pa.list_(pa.int64()))
            if "runs" in node:  # a list batch's groups unpadded (format version 3)
                self.runs(node, name)
        elif t == "value":
            p = node.get("ptype")
            want = {"str": pa.string(), "json": pa.string(), "tjson": pa.string(), "bool": pa.bool_(), "float": pa.float64(),
                    "int": pa.int64(), "num": pa.float64(), "ilist": pa.large_list(pa.int64()),
                    "flist": pa.large_list(pa.float64())}.get(p) if type(p) is str else None
            if want is None:
                raise _Bad(f"value type {p!r} is unknown")
            if p in ("ilist", "flist") and type(self.version) is int and self.version < 4:
                raise _Bad(f"an {p!r} value column in a file of format version {self.version} (it needs 4)")
            if p == "num":  # Python numbers in a float64 column, the int rows listed (version 3)
                if type(self.version) is int and self.version < 3:
                    raise _Bad(f"a 'num' value column in a file of format version {self.version} (it needs 3)")
                if node.get("ints") is not True:
                    self.rows(node, "ints")
                    if "ints" not in node:
                        raise _Bad("a 'num' value column without 'ints'")
            self.col(node, "col", lambda t: t == want)
        elif t == "struct":
            self.keys(node, depth, self.elem)
            if "orders" in node:
                self.orders(node)
        else:
            raise _Bad(f"unknown element type {t!r}")


def check(doc: dict, schema: pa.Schema, num_rows: int, where: str, budget: bool = True) -> None:
    """Raise FormatError unless ``doc`` (a step's trajstore metadata) fits the file (``budget``: and a decode
    of it stays within ``limits.MAX_DECODED_BYTES``)."""
    try:
        spec = doc.get("batch")
        n = _int(doc.get("num_rows"), "num_rows")
        if n != num_rows:
            raise _Bad(f"the file holds {num_rows} rows, its metadata says {n}")
        if not isinstance(doc.get("meta", {}), dict):
            raise _Bad("meta is not an object")
        if "shard" in doc:
            shard(doc, schema)
        ch = _Checker(schema, n, spec, doc.get("format_version"), budget)
        t = spec.get("t")
        if t == "batch":
            form = spec.get("form")
            if form not in ("padded", "packed", "plain", "masked"):
                raise _Bad(f"batch form {form!r} is unknown")
            if _int(spec.get("B"), "B") != n:
                raise _Bad(f"the spec says {spec['B']} trajectories, the file holds {n} rows")
            if form == "padded":
                _int(spec.get("T"), "T")
                if spec.get("side") not in ("right", "left", None):
                    raise _Bad(f"padding side {spec.get('side')!r} is unknown")
                if "len_col" in spec:
                    ch.col(spec, "len_col", lambda t: t == pa.int64())
            if form == "masked":
                if type(doc.get("format_version")) is int and doc["format_version"] < 2:
                    raise _Bad("a masked batch in a file of format version 1 (it needs 2)")
                ch.masks(spec)
            ch.keys(spec, 0)
            keys = dict(spec["keys"])
            cu = keys.get("cu_seqlens")
            if form == "packed" and isinstance(cu, dict) and cu.get("t") == "gtensor":
                ch.add(n * longest(cu), "the attention mask of a padded conversion")
            if spec.get("wrapper") is not None:
                wrapper(spec["wrapper"], keys)
        elif t == "seq":
            if spec.get("container") not in ("list", "tuple"):
                raise _Bad(f"a list batch has container {spec.get('container')!r}")
            if "wrapper" in spec:
                class_tag(spec["wrapper"], True)  # a list of a framework's dataclass (version 4)
            ch.elem(spec.get("elem"), 1)
        else:
            raise _Bad(f"batch node type {t!r} is unknown")
    except _Bad as e:
        raise FormatError(f"{where}: the file's description does not fit its contents: {e}; "
                          "the file is damaged or was not written by trajstore") from None
    except Over as e:
        raise limits.over(where, *e.args) from None
    except RecursionError:
        raise FormatError(f"{where}: the file's description nests too deeply; "
                          "the file is damaged or was not written by trajstore") from None

