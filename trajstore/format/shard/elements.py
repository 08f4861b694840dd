"""Joining shards (``format/shard/join.py``), the per-row elements of lists, list batches and
numpy object arrays: ``none`` / ``missing`` / ``ints`` / ``orders`` rows shifted to the joined
rows, a struct's keys the union of the shards' (a key a shard lacks is ``missing`` in its rows),
a shard of only None rows given null columns, value types that differ between the shards (or
tensors of other dtypes) stored as typed JSON documents, a list batch's groups by runs with one
``pad`` value or a ``__pad__`` column.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pyarrow as pa

from .. import dtypes as dt
from .. import typed
from ..arrow import Columns
from ..codec.sequences import decode_elems
from ..spec import PAD_PREFIX
from .masks import pad_field, norm_pad, pad_fill, pad_list, same, name_of, stored
from ..values import dumps

__all__ = ["Rows"]


class Rows:
    """The element part of ``shard_join.Joiner`` (its state: ``tables``, ``n``, ``base``,
    ``patch``, ``rename``, ``version``; ``fail``, ``col``, ``column``, ``shift``)."""

    def elem(self, parents: list[dict], path: tuple) -> dict:
        nodes = [p["elem"] for p in parents]
        return self.elems(nodes, path)

    def elems(self, nodes: list[dict], path: tuple) -> dict:
        live = [(k, n) for k, n in enumerate(nodes) if n.get("t") != "empty"]
        if live and live[0][1].get("t") != "struct" and self.absent(nodes):
            return copy.deepcopy(live[0][1])
        none, missing = self.shift(nodes, "none"), self.shift(nodes, "missing")
        if not live:
            out: dict = {"t": "empty"}
        else:
            ts = {n["t"] for _, n in live}
            if ts <= {"cell", "value"} and (len(ts) > 1 or not same([n for _, n in live], ("lib", "dtype"))) \
                    or len(ts) > 1 and ts <= {"cell", "value", "struct"}:
                # tensors of other dtypes, values, or dicts in one shard and other values in another
                # (a dict holding a numpy scalar is a struct, [None, []] a value): typed documents
                out = self.as_typed(nodes, live)
            elif len(ts) > 1:
                raise self.fail(f"field {name_of(path)!r} holds {sorted(ts)} in different shards")
            else:
                t = live[0][1]["t"]
                out = self.cell(nodes, live, path) if t == "cell" else self.value(nodes, live, path) \
                    if t == "value" else self.struct(nodes, live, path)
        if none:
            out["none"] = none
        if missing:
            out["missing"] = missing
        return out

    def nulls(self, nodes: list[dict], live: list, key: str, name: str) -> None:
        """Shards where every row is None or absent (``empty``) get an all-null column ``name``."""
        k0 = live[0][0]
        like = self.column(k0, live[0][1][key])
        for k, n in enumerate(nodes):
            if n.get("t") == "empty":
                self.patch[k][name] = (pa.nulls(self.n[k], like.type), None)

    def cell(self, nodes: list[dict], live: list, path: tuple) -> dict:
        ns = [n for _, n in live]
        if not same(ns, ("lib", "dtype")):
            raise self.fail(f"field {name_of(path)!r} holds tensors of dtypes {[n['dtype'] for n in ns]}")
        out = {**ns[0], "col": self.col(live, "col"), "shape_col": self.col(live, "shape_col")}
        for key in ("kind", "runs", "pad", "pad_col", "none", "missing"):
            out.pop(key, None)
        self.nulls(nodes, live, "col", out["col"])
        self.nulls(nodes, live, "shape_col", out["shape_col"])
        if any("runs" in n for n in ns):
            self.runs_cell(nodes, live, out, path)
        elif all(n.get("kind") == "token" for n in ns) and len(live) == len(nodes) \
                and not any(n.get("none") or n.get("missing") for n in nodes):
            out["kind"] = "token"
        return out

    def runs_cell(self, nodes: list[dict], live: list, out: dict, path: tuple) -> None:
        """A list batch's token cell stored by runs in some shards (3.10): the pad values merged
        as for a padded field, row by row of each group's padded positions."""
        runs = next(n["runs"] for _, n in live if "runs" in n)
        out.update(kind="token", runs=runs)
        for k in range(len(nodes)):
            if runs not in self.tables[k].column_names:
                self.patch[k][runs] = (pa.nulls(self.n[k], pa.list_(pa.int64())), pa.field(
                    runs, pa.list_(pa.int64()), metadata={"trajstore.kind": "runs"}))
        dtype, size = out["dtype"], dt.storage_numpy(out["dtype"]).itemsize
        npads = []
        for k, n in enumerate(nodes):
            rr = self.column(k, runs).to_pylist() if runs in self.tables[k].column_names else [None] * self.n[k]
            shapes = self.column(k, n["shape_col"]).to_pylist() if n.get("t") == "cell" else [None] * self.n[k]
            if n.get("t") == "cell" and "runs" not in n and any(r is not None and s is not None
                                                                 for r, s in zip(rr, shapes)):
                raise self.fail(f"field {name_of(path)!r} is stored by runs in some shards and whole in others "
                                "for rows whose groups have padding", [live[0][0], k])
            npads.append(np.array([0 if r is None or s is None else
                                   (math.prod(s) - sum(r[len(r) // 2:]) * math.prod(s[2:])) for r, s in zip(rr, shapes)],
                                  np.int64))
        has = [k for k, n in live if "runs" in n and npads[k].any()]
        own = {k: (norm_pad(nodes[k]["pad"], size) if nodes[k].get("pad") is not None else None) for k in has}
        values = {p for p in own.values() if p is not None}
        if not any("pad_col" in nodes[k] for k in has) and len(values) <= 1:
            out["pad"] = values.pop() if values else None
            return
        out["pad"] = None
        name = out["pad_col"] = PAD_PREFIX + out["col"]
        for k, n in enumerate(nodes):
            if "pad_col" in n:
                if n["pad_col"] != name:
                    self.rename[k][n["pad_col"]] = name
                continue
            off = np.zeros(self.n[k] + 1, np.int64)
            np.cumsum(npads[k], out=off[1:])
            vals = pad_fill(int(off[-1]), own.get(k) or 0, dtype)
            self.patch[k][name] = (pad_list(off, stored(vals, dtype)), pad_field(name, dtype))

    def value(self, nodes: list[dict], live: list, path: tuple) -> dict:
        ns = [n for _, n in live]
        ptypes = {n["ptype"] for n in ns}
        name = self.col(live, "col")
        out = {"t": "value", "col": name}
        if len(ptypes) > 1 and not ptypes <= {"num", "float"}:
            return self.as_typed(nodes, live)
        self.nulls(nodes, live, "col", name)
        if len(ptypes) == 1 and "num" not in ptypes:
            out["ptype"] = ns[0]["ptype"]
            return out
        if ptypes <= {"num", "float"}:
            out["ptype"] = "num"
            rows: list[int] = []
            every = True
            for k, n in live:
                listed = set(n.get("none", ())) | set(n.get("missing", ()))
                present = [i for i in range(self.n[k]) if i not in listed]
                got = present if n.get("ints") is True else list(n.get("ints") or [])
                every &= got == present
                rows += [self.base[k] + i for i in got]
            out["ints"] = True if every else rows
            self.version = max(self.version, 3)
            return out
        return self.as_typed(nodes, live)

    def as_typed(self, nodes: list[dict], live: list) -> dict:
        """Rows whose types differ between the shards: every row a typed document (3.8), in the
        column of the first shard that has one (a struct's shard has its own columns, left out)."""
        name = self.col([(k, n) for k, n in live if "col" in n], "col")
        for k, n in enumerate(nodes):
            if n.get("t") == "empty":
                vals: list = [None] * self.n[k]
            else:
                vals = decode_elems(Columns(self.tables[k], f"rank {self.ranks[k]}"), n, self.n[k])
            docs = [None if v is None else typed.encode(v) for v in vals]
            self.version = max([self.version, 2] + [typed.version(d) for d in docs if d is not None])
            self.patch[k][name] = (pa.array([None if d is None else dumps(d) for d in docs], pa.string()),
                                   pa.field(name, pa.string(), metadata={"trajstore.kind": "json"}))
        return {"t": "value", "col": name, "ptype": "tjson"}

    def struct(self, nodes: list[dict], live: list, path: tuple) -> dict:
        names: list[str] = []
        for _, n in live:
            names += [k for k, _ in n["keys"] if k not in names]
        kids = []
        for key in names:
            child = []
            for k, n in enumerate(nodes):
                got = dict(n.get("keys", [])).get(key)
                child.append(got if got is not None else {"t": "empty", "missing": list(range(self.n[k]))})
            kids.append([key, self.elems(child, path + (key,))])
        out: dict = {"t": "struct", "keys": kids}
        orders = self.orders(nodes, names)
        if orders:
            out["orders"] = orders
            self.version = max(self.version, 3)
        return out

    def orders(self, nodes: list[dict], names: list[str]) -> list:
        """The rows whose dict's keys come in another order than the joined ``keys``."""
        idx = {k: i for i, k in enumerate(names)}
        out = []
        for k, n in enumerate(nodes):
            if n.get("t") != "struct":
                continue
            own = [key for key, _ in n["keys"]]
            absent = [set(c.get("missing", ())) for _, c in n["keys"]]
            skip = set(n.get("none", ())) | set(n.get("missing", ()))
            listed = dict((r, ks) for r, ks in n.get("orders", ()))
            for i in range(self.n[k]):
                if i in skip:
                    continue
                ks = listed.get(i, [j for j in range(len(own)) if i not in absent[j]])
                mine = [idx[own[j]] for j in ks]
                if mine != sorted(mine):
                    out.append([self.base[k] + i, mine])
        return out
