"""The spec side of joining the shards of one step (``format/shard/shards.py``; docs/FORMAT.md 3.12):
every node of the shards' specs merged into the node of the logical batch, with the columns a
shard needs rewritten or added so that the shards' tables concatenate into that batch's table.

Rows concatenate in rank order; what a node says about rows (``none``, ``missing``, ``ints``,
``orders``, ``counts``, ``cu_seqlens``, ``B``) is shifted and joined; what it says about the batch
(padded widths, pad values, mask sides, value types) is made to hold for every row: the widest
shard's width (a narrower shard's rows get the extra positions on their padding side, holding its
pad value), one pad value where the shards agree and a ``__pad__`` column where they do not, a
mask group's side from its rows' starts, a ``tjson`` value column where the shards' value types
differ. What cannot be joined raises ``FormatError`` naming the step, the field and the ranks.
"""

from __future__ import annotations

import base64
import copy
import json
import math
from typing import Any

import numpy as np
import pyarrow as pa

from ...errors import FormatError
from .. import dtypes as dt
from ..codec import tensors
from .. import typed
from .masks import Masks, name_of, same, strip_masks
from .elements import Rows
from ..spec import RUNS_PREFIX, node_columns
from ..values import dumps

__all__ = ["Joiner", "merge_meta"]


class Joiner(Masks, Rows):
    """Merges the specs of one step's shards; ``patch[k]`` holds the columns shard ``k`` gets
    (name -> (array, field or None)), ``rename[k]`` its columns that take another name."""

    def __init__(self, docs: list[dict], tables: list[pa.Table], ranks: list[int], step: Any) -> None:
        self.docs, self.tables, self.ranks, self.step = docs, tables, ranks, step
        self.n = [t.num_rows for t in tables]
        self.base = [sum(self.n[:k]) for k in range(len(tables))]
        self.B = sum(self.n)
        self.patch: list[dict[str, tuple]] = [{} for _ in tables]
        self.rename: list[dict[str, str]] = [{} for _ in tables]
        self.version = 1
        self.groups: list[dict] = []  # merged mask groups, with the per-shard facts token fields need
        self.form = ""
        self.data_keys: set[str] = set()
        self.stacked: set[str] = set()

    # -- errors and columns
    def fail(self, what: str, ks: list[int] | None = None) -> FormatError:
        ranks = [self.ranks[k] for k in (range(len(self.ranks)) if ks is None else ks)]
        return FormatError(f"step {self.step}: the shards of ranks {ranks} cannot be joined into one batch: {what}; "
                           "read the shards one by one (Reader(..., rank=r, world_size=N) with the dump's N)")

    def col(self, pairs: list[tuple[int, dict]], key: str) -> str:
        """The merged name of the column ``key`` of these (shard, node) pairs: the first shard's;
        a shard that stored it under another name (docs/FORMAT.md 3.11) has it renamed."""
        name = pairs[0][1][key]
        for k, node in pairs[1:]:
            if node[key] != name:
                if name in self.tables[k].column_names:
                    raise self.fail(f"column {node[key]!r} would take the name {name!r}, which rank "
                                    f"{self.ranks[k]}'s shard already uses", [pairs[0][0], k])
                self.rename[k][node[key]] = name
        return name

    def column(self, k: int, name: str) -> pa.ChunkedArray:
        t = self.tables[k]
        if name not in t.column_names:
            raise self.fail(f"column {name!r} is missing from rank {self.ranks[k]}'s shard", [k])
        return t.column(name)

    def ints(self, k: int, name: str) -> np.ndarray:
        return np.asarray(self.column(k, name).to_numpy(), dtype=np.int64)

    def absent(self, nodes: list[dict]) -> bool:
        """Whether no shard's table holds a column of these nodes (the tables were read for other
        fields only: the field is not decoded, its node is left as it is); FormatError where some
        shards' tables hold them and some do not."""
        has = []
        for k, n in enumerate(nodes):
            cols: list[str] = []
            node_columns(n, cols)
            cols = [c for c in cols if not c.startswith(RUNS_PREFIX)]  # shared by a list batch's cells
            if cols:
                has.append(any(c in self.tables[k].column_names or c in self.patch[k] for c in cols))
        if any(has) and not all(has):
            raise self.fail(f"the tables of some shards hold the columns of a field ({cols}) and some do not")
        return bool(has) and not any(has)

    def shift(self, nodes: list[dict], key: str) -> list[int]:
        return [self.base[k] + i for k, n in enumerate(nodes) for i in n.get(key, ())]

    # -- top level
    def batch(self, specs: list[dict]) -> dict:
        forms = [s.get("form") for s in specs]
        if len(set(forms)) > 1 and not set(forms) <= {"padded", "masked"}:
            raise self.fail(f"batch forms differ ({dict(zip(self.ranks, forms))})")
        names = [[k for k, _ in s["keys"]] for s in specs]
        for k, ns in enumerate(names):
            if ns != names[0]:
                raise self.fail(f"rank {self.ranks[0]} has fields {names[0]}, rank {self.ranks[k]} {ns}", [0, k])
        self.form = "packed" if forms[0] == "packed" else "plain" if forms[0] == "plain" else "masked"
        if self.form == "masked":
            self.mask_groups(specs)
        w = specs[0].get("wrapper") or {}
        self.data_keys = {k for k, v in ((w.get("td") or {}) if w.get("type") == "dataproto" else w).get(
            "non_tensor", {}).items() if v == "data"}  # a TensorDict's NonTensorData entries
        keys = [[name, self.field([dict(s["keys"])[name] for s in specs], (name,))] for name in names[0]]
        out: dict = {"t": "batch", "form": forms[0], "B": self.B}
        if self.form == "masked":
            g0 = self.groups[0]
            if len(self.groups) == 1 and g0["key"] == "" and g0["src"] == "attention_mask" and g0["side"] != "span" \
                    and (g0["side"] is not None or all(f == "padded" for f in forms)):
                out.update(form="padded", T=g0["W"], side=g0["side"])
                if "len_col" in g0:
                    out["len_col"] = g0["len_col"]
                strip_masks(keys)
            else:
                out["form"] = "masked"
                out["masks"] = [{k: v for k, v in g.items() if not k.startswith("_")} for g in self.groups]
                self.version = max(self.version, 2)
        out["keys"] = keys
        return out

    def seq(self, nodes: list[dict], path: tuple) -> dict:
        if not same(nodes, ("container", "trail")):
            raise self.fail(f"field {name_of(path)!r} is a {nodes[0].get('container')} in one shard and a "
                            f"{[n.get('container') for n in nodes]} in others")
        out = {k: v for k, v in nodes[0].items() if k not in ("elem", "np_dtype")}
        if "np_dtype" in nodes[0]:
            out["np_dtype"] = self.np_dtype([n.get("np_dtype") for n in nodes], path)
        out["elem"] = self.elem(nodes, path)
        return out

    def np_dtype(self, names: list, path: tuple) -> str:
        if len(set(names)) == 1:
            return names[0]
        ds = [np.dtype(n) if isinstance(n, str) else None for n in names]
        if all(d is not None and d.kind == ds[0].kind and d.kind in "US" for d in ds):
            return max(ds, key=lambda d: d.itemsize).str  # np.concatenate's result
        raise self.fail(f"field {name_of(path)!r} is a numpy array of dtypes {names} in the shards")

    # -- dict batch fields
    def field(self, nodes: list[dict], path: tuple) -> dict:
        if self.absent(nodes):
            return copy.deepcopy(nodes[0])
        ts = {n.get("t") for n in nodes}
        if ts == {"segtensor", "tensor"}:  # 3.9: a shard whose image rows were one per sample
            nodes = [self.as_segments(k, n, path) if n["t"] == "tensor" else n for k, n in enumerate(nodes)]
            ts = {"segtensor"}
        if len(ts) > 1:
            raise self.fail(f"field {name_of(path)!r} is stored as {sorted(ts)} in different shards")
        t = nodes[0]["t"]
        if t == "group":
            names = [[k for k, _ in n["keys"]] for n in nodes]
            if any(ns != names[0] for ns in names):
                raise self.fail(f"group {name_of(path)!r} has other fields in some shards ({names})")
            return {**nodes[0], "keys": [[k, self.field([dict(n["keys"])[k] for n in nodes], path + (k,))]
                                          for k in names[0]]}
        if t == "seq":
            return self.seq(nodes, path)
        if t == "segtensor":
            if not same(nodes, ("lib", "dtype", "trail")):
                raise self.fail(f"field {name_of(path)!r} has other dtypes or shapes in some shards")
            pairs = list(enumerate(nodes))
            return {**nodes[0], "col": self.col(pairs, "col"), "counts": [c for n in nodes for c in n["counts"]]}
        if t == "tensor":
            return self.tensor(nodes, path)
        return self.batch_wide(nodes, path)

    def as_segments(self, k: int, node: dict, path: tuple) -> dict:
        """A per-sample field as the segmented field of one leading row per trajectory it is."""
        if node.get("kind") != "sample" or "mask" in node or node.get("tokenlike"):
            raise self.fail(f"field {name_of(path)!r} is segmented in some shards and per token in others", [k])
        if not node["trail"]:
            c = self.column(k, node["col"]).combine_chunks()
            self.patch[k][node["col"]] = (pa.LargeListArray.from_arrays(
                pa.array(np.arange(self.n[k] + 1, dtype=np.int64)), c,
                type=pa.large_list(pa.field("element", c.type, nullable=False))), None)
        return {"t": "segtensor", "col": node["col"], "lib": node["lib"], "dtype": node["dtype"],
                "trail": node["trail"], "counts": [1] * self.n[k]}

    def batch_wide(self, nodes: list[dict], path: tuple) -> dict:
        """A value of the whole batch (json, tvalue, gtensor): the same in every shard, except a
        packed batch's ``cu_seqlens`` (rebuilt from the rows) and ``max_seqlen`` (the largest)."""
        if self.form == "packed" and path == ("cu_seqlens",) and nodes[0]["t"] == "gtensor":
            return self.cu_seqlens(nodes)
        if self.form == "packed" and path == ("max_seqlen",) and all(
                n["t"] == "json" and type(n["v"]) is int for n in nodes):
            return {"t": "json", "v": max(n["v"] for n in nodes)}
        for k, n in enumerate(nodes):
            if n != nodes[0]:
                if len(path) == 1 and path[0] in self.data_keys:
                    return self.stack(nodes, path[0])
                raise self.fail(f"field {name_of(path)!r} is one value for the whole batch and differs between "
                                f"ranks {self.ranks[0]} and {self.ranks[k]}", [0, k])
        return nodes[0]

    def stack(self, nodes: list[dict], name: str) -> dict:
        """A TensorDict's ``NonTensorData`` that differs between the shards becomes the
        ``NonTensorStack`` of its rows' values, as ``TensorDict.cat`` (verl's ``DataProto.concat``)
        makes it: a per-row list of typed documents (3.8)."""
        for k, n in enumerate(nodes):
            v = n["v"] if n["t"] == "json" else typed.decode(n["v"], name) if n["t"] == "tvalue" \
                else tensors.decode_global(n)
            d = dumps(typed.encode(v))
            self.version = max(self.version, 2, typed.version(typed.encode(v)))
            self.patch[k][name] = (pa.array([d] * self.n[k], pa.string()),
                                   pa.field(name, pa.string(), metadata={"trajstore.kind": "json"}))
        self.stacked.add(name)
        return {"t": "seq", "container": "list", "elem": {"t": "value", "col": name, "ptype": "tjson"}}

    def cu_seqlens(self, nodes: list[dict]) -> dict:
        if not same(nodes, ("lib", "dtype")):
            raise self.fail("cu_seqlens has other dtypes in some shards")
        sd = dt.storage_numpy(nodes[0]["dtype"])
        cus = [np.frombuffer(base64.b64decode(n["data"]), sd).astype(np.int64) for n in nodes]
        lengths = np.concatenate([np.diff(c) for c in cus])
        cu = np.zeros(self.B + 1, np.int64)
        np.cumsum(lengths, out=cu[1:])
        raw = cu.astype(sd)
        out = {**nodes[0], "shape": [self.B + 1], "data": base64.b64encode(raw.tobytes()).decode()}
        if "col" in nodes[0]:
            for k in range(len(nodes)):
                ends = raw[self.base[k] + 1:self.base[k] + self.n[k] + 1]
                self.patch[k][out["col"]] = (pa.array(ends), None)
        return out

    def tensor(self, nodes: list[dict], path: tuple) -> dict:
        if self.form == "masked":
            follows = [n for n in nodes if "mask" in n or n.get("kind") == "token" or n.get("tokenlike")]
            if follows and self.groups[follows[0].get("mask", 0)]["side"] is None:
                return self.whole(nodes, follows[0].get("mask", 0), path)
        kinds = {n.get("kind") for n in nodes}
        if self.form == "packed" and kinds == {"token", "sample"}:
            nodes = self.packed_kinds(nodes, path)
            kinds = {n["kind"] for n in nodes}
        if len(kinds) > 1 or not same(nodes, ("lib", "dtype", "axis")):
            raise self.fail(f"field {name_of(path)!r} has other dtypes or kinds in some shards "
                            f"({[(n.get('dtype'), n.get('kind')) for n in nodes]})")
        pairs = list(enumerate(nodes))
        out = {**nodes[0], "col": self.col(pairs, "col")}
        if self.form == "masked" and ("mask" in nodes[0] or kinds == {"token"} or nodes[0].get("tokenlike")):
            return self.masked_field(nodes, out, path)
        if not same(nodes, ("trail",)):
            raise self.fail(f"field {name_of(path)!r} has shapes {[n['trail'] for n in nodes]} after the batch "
                            "dimension in the shards")
        return out

    def packed_kinds(self, nodes: list[dict], path: tuple) -> list[dict]:
        """A packed field per token in some shards and per trajectory in others: a shard with as
        many tokens as trajectories could not tell (docs/FORMAT.md 3.4), the others could; its
        column is rewritten to the kind they chose."""
        lens = []
        for d in self.docs:
            cu = dict(d["batch"]["keys"]).get("cu_seqlens") or {}
            raw = base64.b64decode(cu.get("data", ""))
            lens.append(np.diff(np.frombuffer(raw, dt.storage_numpy(cu["dtype"])).astype(np.int64)) if raw else None)
        sure = {n["kind"] for k, n in enumerate(nodes) if lens[k] is not None and int(lens[k].sum()) != self.n[k]}
        if len(sure) != 1:
            raise self.fail(f"field {name_of(path)!r} is per token in some shards and per trajectory in others")
        kind = sure.pop()
        out = []
        for k, n in enumerate(nodes):
            if n["kind"] == kind:
                out.append(n)
                continue
            w, c = math.prod(n["trail"]), self.column(k, n["col"]).combine_chunks()
            vals = c.flatten() if pa.types.is_large_list(c.type) else c
            typ = pa.large_list(pa.field("element", vals.type, nullable=False))
            if kind == "sample":
                arr = vals if not n["trail"] else pa.LargeListArray.from_arrays(
                    pa.array(np.arange(self.n[k] + 1, dtype=np.int64) * w), vals, type=typ)
            else:
                off = np.concatenate([[0], np.cumsum(lens[k])]).astype(np.int64) * w
                arr = pa.LargeListArray.from_arrays(pa.array(off), vals, type=typ)
            self.patch[k][n["col"]] = (arr, None)
            out.append({**n, "kind": kind})
        return out

    # -- containers and meta
    def wrapper(self, ws: list, every: list) -> dict | None:
        """The container of the joined batch; ``every``: the containers of all shards, those
        without rows included, whose ``meta_info`` is merged too."""
        if all(w is None for w in ws):
            return None
        if any(w is None for w in ws) or len({w.get("type") for w in ws}) > 1:
            raise self.fail("the batches are of other container types")
        if ws[0]["type"] == "tensordict":
            return {"type": "tensordict", **self.stacks(self.td([{k: v for k, v in w.items() if k != "type"}
                                                                 for w in ws]))}
        out = {k: v for k, v in ws[0].items() if k not in ("meta_info", "meta_info_t", "td")}
        if any(w.get("non_tensor_keys") != ws[0].get("non_tensor_keys") or w.get("cls") != ws[0].get("cls") for w in ws):
            raise self.fail("the DataProto batches have other non_tensor_batch keys or classes")
        tds = [w.get("td") for w in ws]
        if any((t is None) != (tds[0] is None) for t in tds):
            raise self.fail("some DataProto batches have a TensorDict batch and some have none")
        out["td"] = None if tds[0] is None else self.stacks(self.td(tds))
        metas = [typed.decode(w["meta_info_t"], "meta_info") if "meta_info_t" in w else w["meta_info"]
                 for w in every if isinstance(w, dict) and w.get("type") == "dataproto"]
        meta = merge_meta(metas, self, "meta_info", strict=True)
        if typed.needs_typed(meta, "meta_info"):
            out["meta_info_t"] = typed.encode(meta)
            self.version = max(self.version, typed.version(out["meta_info_t"]))
        else:
            out["meta_info"] = meta
        return out

    def stacks(self, tag: dict) -> dict:
        if self.stacked:
            tag["non_tensor"] = {k: "stack" if k in self.stacked else v for k, v in tag["non_tensor"].items()}
        return tag

    def td(self, tags: list[dict]) -> dict:
        sizes = [t["batch_size"] for t in tags]
        if any(len(s) != len(sizes[0]) or s[1:] != sizes[0][1:] for s in sizes):
            raise self.fail(f"the TensorDicts have batch sizes {sizes}")
        out = copy.deepcopy(tags[0])
        if sizes[0]:
            out["batch_size"] = [sum(s[0] for s in sizes)] + sizes[0][1:]
        if any(t.get("non_tensor") != tags[0].get("non_tensor") for t in tags):
            raise self.fail("the TensorDicts have other non-tensor entries")
        nested = [t.get("nested", {}) for t in tags]
        if any(set(x) != set(nested[0]) for x in nested):
            raise self.fail("the TensorDicts have other nested TensorDicts")
        if nested[0]:
            out["nested"] = {k: self.td([x[k] for x in nested]) for k in nested[0]}
        return out


def merge_meta(metas: list[dict], j: Joiner, what: str, strict: bool) -> dict:
    """verl's ``DataProto.concat`` rule: shards with the same dict keep it; otherwise the keys'
    union, each value the same in every shard that has it, and ``metrics`` gathered from every
    shard into a dict of lists (``list_of_dict_to_dict_of_list``). A key whose values differ
    fails (``strict``, as verl's assertion) or becomes the list of the shards' values in rank
    order (the step metadata, ``append(meta=...)``: each rank's own)."""
    docs = [json.dumps(typed.encode(m)) for m in metas]
    if all(d == docs[0] for d in docs):
        return metas[0]
    out: dict = {}
    seen: dict = {}
    metrics: list = []
    for k, m in enumerate(metas):
        for key, v in m.items():
            if key == "metrics":
                if v is not None:
                    metrics.extend(v if isinstance(v, list) else [v])
                continue
            d = json.dumps(typed.encode(v))
            if key not in out:
                out[key], seen[key] = v, d
            elif seen[key] != d:
                if strict:
                    raise j.fail(f"{what} key {key!r} differs between the shards (verl's DataProto.concat refuses "
                                 "that too)", [0, k])
                out[key] = [mm.get(key) for mm in metas]
                seen[key] = None
    if metrics:
        if not all(isinstance(x, dict) for x in metrics):
            raise j.fail(f"{what} 'metrics' of the shards are not dicts")
        out["metrics"] = {key: [x.get(key) for x in metrics if key in x] for key in metrics[0]}
    return out
