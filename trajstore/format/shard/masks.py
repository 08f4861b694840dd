"""Joining shards (``format/shard/join.py``), the fields of padded and masked batches: each mask
group's joined width (the widest shard's), side (from every row's start: right, left, or a span
with a ``__start__`` column) and padding side for a narrower shard's extra positions (the left when
every shard is left-padded, else the right); each token field's one ``pad`` value or ``__pad__``
column; a group with holes in some shard stores its fields whole in every shard. Also the small
helpers the joining modules share.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from .. import dtypes as dt
from ..arrow import Columns, list_array
from ..codec.decoder import Decoder
from ..spec import LEN_PREFIX, PAD_PREFIX, START_PREFIX
from ..values import storage

__all__ = ["Masks", "norm_pad", "pad_fill", "stored", "pad_list", "same", "name_of", "strip_masks", "pad_field"]


def norm_pad(p: int, size: int) -> int:
    """A recorded pad value as the writer spells it (docs/FORMAT.md 3.4): unsigned for 1-byte
    dtypes, the bits read as a signed int for wider ones."""
    if size == 1:
        return p % 256
    h = 1 << (8 * size - 1)
    return (p + h) % (2 * h) - h


def pad_fill(n: int, p: int, dtype: str) -> np.ndarray:
    """``n`` values of storage dtype ``dtype`` holding the bits of pad value ``p``."""
    a = np.empty(n, dt.storage_numpy(dtype))
    size = a.dtype.itemsize
    a.view(f"u{size}" if size == 1 else f"i{size}").fill(norm_pad(p, size))
    return a


def stored(values: np.ndarray, dtype: str) -> np.ndarray:
    """Storage values as a column holds them (half dtypes widened to float32, 3.2)."""
    return dt.widen(values, dtype) if dtype in dt.HALF else values


def pad_list(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    return list_array(offsets, values)


def same(nodes: list, keys: tuple) -> bool:
    return all(all(n.get(k) == nodes[0].get(k) for k in keys) for n in nodes)


def name_of(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def strip_masks(keys: list) -> None:
    """A padded batch's fields name no mask group (their group is the batch's one)."""
    for _, node in keys:
        if node.get("t") == "group":
            strip_masks(node["keys"])
        elif node.get("t") == "tensor":
            node.pop("mask", None)


def _tensors(keys: list) -> list[dict]:
    out = []
    for _, node in keys:
        out += _tensors(node["keys"]) if node.get("t") == "group" else [node] if node.get("t") == "tensor" else []
    return out


def pad_field(name: str, dtype: str) -> pa.Field:
    return pa.field(name, pa.large_list(pa.field("element", dt.arrow_type(dtype), nullable=False)), nullable=False,
                    metadata={"trajstore.dtype": dtype, "trajstore.kind": "pad"})


class Masks:
    """The mask-group part of ``shard_join.Joiner`` (its state: ``tables``, ``docs``, ``n``,
    ``patch``, ``rename``, ``groups``; ``fail``, ``col``, ``ints``)."""

    def whole(self, nodes: list[dict], i: int, path: tuple) -> dict:
        """A field of a mask group with holes in some shard: stored whole (``[B, W, ...]``, or
        ``[B, C..., W]`` for a token axis last) in every shard, a shard that stored it per token
        having it decoded."""
        pairs = list(enumerate(nodes))
        name = self.col(pairs, "col")
        out = {"t": "tensor", "col": name, "lib": nodes[0]["lib"], "dtype": nodes[0]["dtype"], "kind": "sample"}
        trails = []
        for k, n in pairs:
            if n["kind"] == "sample" and not n.get("tokenlike"):
                trails.append(n["trail"])
                continue
            dec = Decoder(Columns(self.tables[k], f"rank {self.ranks[k]}"), self.docs[k]["batch"], None)
            x = dec.batch([path[0]])
            for p in path:
                x = x[p]
            a = np.ascontiguousarray(storage(x)).reshape(len(x), math.prod(x.shape[1:]))
            trails.append(list(x.shape[1:]))
            self.patch[k][name] = (pad_list(np.arange(self.n[k] + 1, dtype=np.int64) * a.shape[1],
                                         stored(a.reshape(-1), out["dtype"])), None)
        if any(t != trails[0] for t in trails) or not same(nodes, ("lib", "dtype")):
            raise self.fail(f"field {name_of(path)!r} has shapes {trails} or dtypes in the shards")
        out["trail"] = trails[0]
        if not any(n.get("axis") == "last" or (n["kind"] == "sample" and "mask" not in n and self.groups[i]["src"]
                                                  == "attention_mask" and n["trail"][-1:] == [self.groups[i]["W"]]
                                                  and len(n["trail"]) > 1 and n["trail"][0] != self.groups[i]["W"])
                   for n in nodes):
            out["mask"] = i
        return out

    # -- mask groups (padded and masked batches)
    def mask_groups(self, specs: list[dict]) -> None:
        per = []
        for s in specs:
            if s["form"] == "padded":
                g = {"key": "", "src": "attention_mask", "lo": 0, "W": s["T"], "side": s.get("side")}
                per.append([g | ({"len_col": s["len_col"]} if "len_col" in s else {})])
            else:
                per.append(s["masks"])
        keys = [[(g["key"], g["src"]) for g in gs] for gs in per]
        if any(ks != keys[0] for ks in keys):
            raise self.fail(f"the batches' masks differ ({keys})")
        self.groups = [self.group(i, [gs[i] for gs in per], specs) for i in range(len(keys[0]))]

    def lengths(self, k: int, i: int, g: dict, spec: dict) -> np.ndarray | None:
        """Tokens per row of shard ``k``'s mask group ``i``: its ``__len__`` column, else a token
        column of the group (a table read for some fields only); None if the table has neither."""
        if g.get("len_col") in self.tables[k].column_names:
            return self.ints(k, g["len_col"])
        for node in _tensors(spec["keys"]):
            w = math.prod(node.get("trail", [0]))
            if node.get("kind") == "token" and node.get("mask", 0) == i and w and node["col"] in self.tables[k].column_names:
                off = Columns(self.tables[k], f"rank {self.ranks[k]}").list_parts(node["col"], node["dtype"])[0]
                return np.diff(off) // w
        return None

    def group(self, i: int, gs: list[dict], specs: list[dict]) -> dict:
        src = gs[0]["src"]
        Ws = [g["W"] for g in gs]
        W = max(Ws)
        sides = [g["side"] for g in gs]
        out = {"key": gs[0]["key"], "src": src, "lo": gs[0]["lo"], "W": W, "side": None}
        if any(g.get("holes") for g in gs):  # a declared mask with holes in some shard: kept in every row's run
            out["holes"] = True
        if len({g["lo"] for g in gs}) > 1:
            raise self.fail(f"mask {src!r} group {gs[0]['key']!r} starts at columns {[g['lo'] for g in gs]}")
        if "len_col" in gs[0]:
            out["len_col"] = self.col(list(enumerate(gs)), "len_col")
        out["_W"], out["_ext"], out["_lens"] = Ws, "right", None
        if None in sides:  # holes: every field of the group stored whole (``whole``)
            if len(set(Ws)) > 1:
                raise self.fail(f"mask {src!r} has holes and widths {Ws} in the shards; a mask with holes is "
                                "not widened (where its padding goes is unknown)")
            return out
        lens = [self.lengths(k, i, g, specs[k]) for k, g in enumerate(gs)]
        if any(x is None for x in lens):  # none of the group's fields was read: it is not decoded
            out["side"] = gs[0]["side"]
            if "start_col" in gs[0]:
                out["start_col"] = gs[0]["start_col"]
            return out
        own = []
        for k, g in enumerate(gs):
            if g["side"] == "span":
                own.append(self.ints(k, g["start_col"]))
            else:
                own.append(np.zeros_like(lens[k]) if g["side"] == "right" else Ws[k] - lens[k])
        loose = [bool(((lens[k] == 0) | (lens[k] == Ws[k])).all()) for k in range(len(gs))]  # fits either side
        left = "left" in sides and all(s == "left" or loose[k] for k, s in enumerate(sides))
        starts = [W - lens[k] if left else own[k] for k in range(len(gs))]
        st = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        ln = np.concatenate(lens)
        out["_ext"] = "left" if left else "right"
        out["_lens"] = lens
        if bool(((ln == 0) | (st == 0)).all()):
            out["side"] = "right"
        elif bool(((ln == 0) | (st == W - ln)).all()):
            out["side"] = "left"
        else:
            out["side"] = "span"
            have = [g for g in gs if "start_col" in g]
            name = have[0]["start_col"] if have else START_PREFIX + out.get("len_col", LEN_PREFIX + src)[len(LEN_PREFIX):]
            out["start_col"] = name
            for k, g in enumerate(gs):
                if g.get("start_col") != name or not np.array_equal(own[k], starts[k]):
                    s = np.where(lens[k] > 0, starts[k], 0).astype(np.int64)
                    self.patch[k][name] = (pa.array(s), pa.field(name, pa.int64(), nullable=False, metadata={
                        "trajstore.dtype": "int64", "trajstore.kind": "start"}))
        return out

    def masked_field(self, nodes: list[dict], out: dict, path: tuple) -> dict:
        """A field following a mask group: a token column, a ``[B, W, 0...]`` field stored whole
        (tokenlike), or one stored whole because its mask has holes."""
        i = nodes[0].get("mask", 0)
        if any(n.get("mask", 0) != i for n in nodes):
            raise self.fail(f"field {name_of(path)!r} follows other masks in some shards")
        g = self.groups[i]
        out["mask"] = i
        if nodes[0]["kind"] == "sample":
            trails = [n["trail"] for n in nodes]
            if nodes[0].get("tokenlike") and all(n.get("tokenlike") for n in nodes) \
                    and all(t[1:] == trails[0][1:] for t in trails):
                out["trail"] = [g["W"]] + trails[0][1:]  # no values: only the width changes
                return out
            if any(t != trails[0] for t in trails):
                raise self.fail(f"field {name_of(path)!r} has shapes {trails} after the batch dimension")
            return out
        if not same(nodes, ("trail",)):
            raise self.fail(f"field {name_of(path)!r} has per-token shapes {[n['trail'] for n in nodes]}")
        self.pads(nodes, out, g, path)
        return out

    def pads(self, nodes: list[dict], out: dict, g: dict, path: tuple) -> None:
        """One ``pad`` for every padded position of the joined field, or a ``__pad__`` column."""
        w, dtype, size = math.prod(out["trail"]), out["dtype"], dt.storage_numpy(out["dtype"]).itemsize
        W, Ws, lens = g["W"], g["_W"], g["_lens"]
        if lens is None:  # no column of the group tells its lengths: a field of no values per token
            if w:
                raise self.fail(f"field {name_of(path)!r}: the row lengths of mask {g['src']!r} were not read; "
                                "read its __len__ column too")
            out["pad"] = nodes[0].get("pad")
            out.pop("pad_col", None)
            return
        holes = [bool((lens[k] < W).any()) for k in range(len(nodes))]  # padded positions after the join
        own = [(norm_pad(n["pad"], size) if n.get("pad") is not None else None) for n in nodes]
        values = {own[k] for k, n in enumerate(nodes) if holes[k] and own[k] is not None}
        common = next((p for p in own if p is not None), 0)
        mixed = any("pad_col" in n for n in nodes) or len(values) > 1
        fills = [p if p is not None else common for p in own]
        out.pop("pad_col", None)
        if not mixed:
            out["pad"] = (values.pop() if values else common) if any(holes) else None
            return
        out["pad"] = None
        name = PAD_PREFIX + out["col"]
        out["pad_col"] = name
        last = out.get("axis") == "last"
        for k, n in enumerate(nodes):
            npad = (W - lens[k]) * w
            off = np.zeros(len(npad) + 1, np.int64)
            np.cumsum(npad, out=off[1:])
            if "pad_col" not in n:
                vals = pad_fill(int(off[-1]), fills[k], dtype)
            elif Ws[k] == W:
                if n["pad_col"] != name:
                    self.rename[k][n["pad_col"]] = name
                continue
            else:
                vals = self.widen_pads(k, n, dtype, lens[k], Ws[k], W, w, fills[k], g["_ext"], last)
            self.patch[k][name] = (pad_list(off, stored(vals, dtype)), pad_field(name, dtype))

    def widen_pads(self, k: int, node: dict, dtype: str, lens: np.ndarray, Wk: int, W: int, w: int, fill: int,
                   ext: str, last: bool) -> np.ndarray:
        """A shard's recorded padded values with the positions its narrower width lacked added on
        the padding side (each row's ``[npad, w]`` block, or ``[w, npad]`` channel by channel for a
        field whose token axis is last)."""
        cols = Columns(self.tables[k], f"rank {self.ranks[k]}")
        off, v = cols.list_parts(node["pad_col"], dtype)
        v = np.asarray(v)
        v = v.view(dt.storage_numpy(dtype)) if v.dtype.itemsize == dt.storage_numpy(dtype).itemsize \
            else dt.narrow(v, dtype)
        add = pad_fill((W - Wk) * w, fill, dtype)
        rows = []
        for i in range(len(lens)):
            r = v[off[i] - off[0]:off[i + 1] - off[0]]
            if last:
                r, a, ax = r.reshape(w, -1), add.reshape(w, -1), 1
            else:
                r, a, ax = r.reshape(-1, w) if w else r, add.reshape(-1, w) if w else add, 0
            rows.append(np.concatenate([a, r] if ext == "left" else [r, a], axis=ax).reshape(-1))
        return np.concatenate(rows) if rows else np.empty(0, dt.storage_numpy(dtype))
