"""The shards of one step joined into the logical batch, and the logical batch cut into slices,
at the level of Arrow tables and specs (docs/FORMAT.md 3.12): the ordinary decoder then decodes
the result as it decodes one step file.

* ``join(parts)``: the ``(envelope, table)`` of each shard of a step, in rank order, become the
  ``(envelope, table)`` of the batch as it was before dispatch: rows concatenated in rank order,
  the spec merged (``format/shard/join.py``).
* ``take(doc, table, rows)``: the ``(envelope, table)`` of some rows of a step, in the order given;
  padded widths stay the step's (as ``DataProto.chunk`` keeps them).
* ``token_counts(doc, table)``: each row's token count, what token balancing weighs;
  ``count_columns(doc)`` the columns it reads.
* ``partition(B, M, how, counts)``: which rows each of ``M`` replaying ranks gets.
"""

from __future__ import annotations

import base64
import copy
import heapq
import math
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from ...base.threads import map_parallel
from ...errors import ConfigError, FormatError
from .. import dtypes as dt
from .. import typed
from ..arrow import Columns
from ..codec.sequences import decode_elems
from ..batch.masks import token_mask
from .join import Joiner, merge_meta
from ..spec import FORMAT_VERSION, RUNS_PREFIX, STEP_COLUMN, counted_masks, is_token, node_columns
from ..values import dumps

__all__ = ["RANK_COLUMN", "join", "uniform", "take", "token_counts", "count_columns", "partition", "HOW"]

RANK_COLUMN = "rank"  # the int32 column of a shard file naming its rank (docs/FORMAT.md 1)
HOW = ("contiguous", "tokens")


# ----------------------------------------------------------------------------- join
def join(parts: list[tuple[dict, pa.Table]], every: list[dict] | None = None) -> tuple[dict, pa.Table]:
    """The logical step of its shards ``parts`` (``(envelope, table)`` each, in rank order); a
    shard's ``rank`` column is dropped. FormatError when the shards cannot be one batch.
    ``every``: the envelopes of all the step's shards, where ``parts`` are some of them (``uniform``
    shards cut to a rank's slice): the step metadata is then merged from all of them.

    A table may hold only the columns of some fields (each shard read with ``columns_for`` of its
    own spec for those fields): the other fields' nodes are then the first shard's, not to be
    decoded (check each shard against its own file, not the joined spec against such a table).
    Widths are the widest of ``parts``: a slice of the logical batch that keeps its widths is
    ``take`` of the join of every shard, not the join of some."""
    if not parts:
        raise FormatError("no shards to join")
    docs = [d for d, _ in parts]
    tables = [t.drop_columns([RANK_COLUMN]) if RANK_COLUMN in t.column_names else t for _, t in parts]
    ranks = [(d.get("shard") or {}).get("rank", k) for k, d in enumerate(docs)]
    all_docs = docs if every is None else every
    every_j = Joiner(docs, tables, ranks, docs[0].get("step")) if every is None else \
        Joiner(every, [pa.table({})] * len(every), list(range(len(every))), docs[0].get("step"))
    for k, d in enumerate(docs):
        if d.get("step") != docs[0].get("step") or d.get("split") != docs[0].get("split"):
            raise every_j.fail(f"rank {ranks[k]}'s shard holds step {d.get('step')!r} of split {d.get('split')!r}",
                             [0, k])
    # a shard of no rows adds none: its spec (whose shapes said little) is left out, its metadata not
    keep = [k for k, t in enumerate(tables) if t.num_rows] or [0]
    j = Joiner([docs[k] for k in keep], [tables[k] for k in keep], [ranks[k] for k in keep], docs[0].get("step"))
    specs = [docs[k]["batch"] for k in keep]
    kinds = {s.get("t") for s in specs}
    if len(kinds) > 1:
        raise j.fail("some shards hold a dict batch and some a list of trajectories")
    if specs[0]["t"] == "seq":
        if any(s.get("container") != specs[0].get("container") for s in specs):
            raise j.fail("some shards hold a list and some a tuple")
        spec: dict = {"t": "seq", "container": specs[0]["container"], "elem": j.elem(specs, ())}
    else:
        spec = j.batch(specs)
        w = j.wrapper([s.get("wrapper") for s in specs], [d["batch"].get("wrapper") for d in docs])
        if w is not None:
            spec["wrapper"] = w
    doc = {k: v for k, v in docs[0].items() if k not in ("shard", "meta", "meta_t", "batch")}
    metas = [typed.step_meta(d, f"rank {every_j.ranks[k]}") for k, d in enumerate(all_docs)]
    meta = merge_meta(metas, every_j, "step meta", strict=False)
    version = max([j.version] + [d.get("format_version", 1) for d in all_docs])
    if typed.needs_typed(meta, "meta"):
        doc["meta_t"] = typed.encode(meta)
        version = max(version, 3)
    else:
        doc["meta"] = meta
    doc.update(format_version=min(version, FORMAT_VERSION), num_rows=j.B, batch=spec)
    return doc, _assemble(j, spec, doc)


def uniform(docs: list[dict]) -> bool:
    """Whether the shards' dict-batch specs differ only in their row counts and in how each stores its
    own rows' padding values (``pad``, ``pad_col``: per row, the same in any join), and hold nothing
    indexed by row (packed ``cu_seqlens``, segment counts, list elements): then a contiguous slice of
    the logical step is the join of the overlapping shards' rows, and the other shards need not be read."""
    def norm(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: (v[1:] if k == "batch_size" and isinstance(v, list) else norm(v))
                    for k, v in x.items() if k not in ("B", "pad", "pad_col")}
        return [norm(v) for v in x] if isinstance(x, list) else x
    specs = [d.get("batch") for d in docs]
    if not all(isinstance(s, dict) and s.get("t") == "batch" and s.get("form") != "packed" for s in specs):
        return False
    text = [dumps(norm(s)) for s in specs]
    return all(t == text[0] for t in text) and '"segtensor"' not in text[0] and '"seq"' not in text[0]


def _referenced(spec: dict) -> list[str]:
    """Every column the spec decodes from, ``step`` first."""
    out = [STEP_COLUMN]
    if spec["t"] == "seq":
        node_columns(spec["elem"], out)
        return out
    for key in ("len_col",):
        if key in spec:
            out.append(spec[key])
    for g in spec.get("masks", ()):
        out += [g[k] for k in ("start_col", "len_col") if k in g and g[k] not in out]
    for _, node in spec["keys"]:
        node_columns(node, out, spec.get("masks"))
    return out


def _unify(types: list[pa.DataType], name: str, j: Joiner) -> pa.DataType:
    """One type for a column the shards hold: list columns with and without nulls differ only in
    their item field, and take the nullable one; an int64 token column stored as int32 by some
    shards takes int64."""
    if all(t == types[0] for t in types):
        return types[0]
    lists = [pa.types.is_large_list(t) or pa.types.is_list(t) for t in types]
    if all(lists) and len({(pa.types.is_large_list(t), t.value_type) for t in types}) == 1:
        return pa.large_list(types[0].value_type) if pa.types.is_large_list(types[0]) else pa.list_(types[0].value_type)
    if all(pa.types.is_large_list(t) for t in types) and {t.value_type for t in types} == {pa.int32(), pa.int64()}:
        # an int64 token column that some shards store as int32 (format version 6, 3.2): int64, exactly
        return pa.large_list(pa.field("element", pa.int64(), nullable=any(t.value_field.nullable for t in types)))
    bad = [k for k, t in enumerate(types) if t != types[0]][:1]
    raise j.fail(f"column {name!r} has Arrow types {[str(t) for t in types]} in the shards (docs/FORMAT.md 3.11)",
                 [0] + bad)


def _assemble(j: Joiner, spec: dict, doc: dict) -> pa.Table:
    want = _referenced(spec)
    first = [j.rename[0].get(c, c) for c in j.tables[0].column_names]
    order = [c for c in first if c in want] + [c for c in want if c not in first]
    back = [{new: old for old, new in r.items()} for r in j.rename]
    arrays, fields = [], []
    for name in order:
        if not any(name in j.patch[k] or back[k].get(name, name) in t.column_names for k, t in enumerate(j.tables)):
            continue  # not read (a table of some fields only)
        cols, fields_k = [], []
        for k, t in enumerate(j.tables):
            if name in j.patch[k]:
                arr, f = j.patch[k][name]
            else:
                old = back[k].get(name, name)
                if old in t.column_names:
                    arr, f = t.column(old), t.schema.field(old).with_name(name)
                elif name.startswith(RUNS_PREFIX):  # a shard whose groups had no runs
                    arr, f = pa.nulls(t.num_rows, pa.list_(pa.int64())), None
                else:
                    raise j.fail(f"column {name!r} is missing from rank {j.ranks[k]}'s shard", [k])
            cols.append(arr)
            fields_k.append(f)
        typ = _unify([c.type for c in cols], name, j)
        found = next((f for f in fields_k if f is not None and f.type == typ), None) or next(
            (f for f in fields_k if f is not None), None)
        cols = [c if c.type == typ else c.cast(typ) for c in cols]
        if found is None or found.type != typ:
            meta = None if found is None else found.metadata
            found = pa.field(name, typ, metadata=meta)
        nullable = found.nullable or any(c.null_count for c in cols)
        fields.append(found.with_nullable(nullable))
        arrays.append(cols)
    schema = pa.schema(fields, metadata={"trajstore": dumps(doc)})
    tables = [pa.Table.from_arrays([a[k] for a in arrays], schema=schema) for k in range(len(j.tables))]
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


# ----------------------------------------------------------------------------- take
class _Rows:
    def __init__(self, rows: list[int]) -> None:
        self.pos: dict[int, list[int]] = {}
        for j, r in enumerate(rows):
            self.pos.setdefault(r, []).append(j)

    def map(self, old: Any) -> list[int]:
        return sorted(j for r in old for j in self.pos.get(r, ()))

    def elem(self, node: dict) -> None:
        for key in ("none", "missing"):
            if key in node:
                node[key] = self.map(node[key])
                if not node[key]:
                    del node[key]
        if isinstance(node.get("ints"), list):
            node["ints"] = self.map(node["ints"])
        if "orders" in node:
            node["orders"] = sorted([j, ks] for r, ks in node["orders"] for j in self.pos.get(r, ()))
            if not node["orders"]:
                del node["orders"]
        for _, child in node.get("keys", ()):
            self.elem(child)


def take(doc: dict, table: pa.Table, rows: list[int]) -> tuple[dict, pa.Table]:
    """The ``(envelope, table)`` of rows ``rows`` of a step, in that order (decodable as a step)."""
    n = table.num_rows
    rows = [int(r) for r in rows]
    if any(not 0 <= r < n for r in rows):
        raise ConfigError(f"step {doc.get('step')}: rows {[r for r in rows if not 0 <= r < n][:5]} are not rows "
                          f"of a batch of {n}")
    t = table.drop_columns([RANK_COLUMN]) if RANK_COLUMN in table.column_names else table
    t = _take_rows(t, pa.array(rows, pa.int64()))
    spec = copy.deepcopy(doc["batch"])
    rm = _Rows(rows)
    if spec["t"] == "seq":
        rm.elem(spec["elem"])
    else:
        spec["B"] = len(rows)
        t = _take_fields(spec, spec["keys"], rm, rows, t)
        w = spec.get("wrapper")
        if w is not None:
            _batch_size(w if w.get("type") == "tensordict" else w.get("td"), len(rows))
    out = {k: v for k, v in doc.items() if k != "shard"}
    out.update(num_rows=len(rows), batch=spec)
    return out, t.replace_schema_metadata({"trajstore": dumps(out)})


def _take_rows(t: pa.Table, idx: pa.Array) -> pa.Table:
    """``t.take(idx)``, its columns taken at once on the thread pool (Arrow's take releases the GIL), each
    joined first: pyarrow's take of a chunked list column is slower than a join and a take."""
    def one(c: pa.ChunkedArray) -> pa.Array:
        return (c.combine_chunks() if c.num_chunks > 1 else c).take(idx)
    return pa.Table.from_arrays(map_parallel(one, t.columns, t.nbytes), schema=t.schema)


def _take_fields(spec: dict, keys: list, rm: _Rows, rows: list[int], t: pa.Table) -> pa.Table:
    for name, node in keys:
        kind = node.get("t")
        if kind == "group":
            t = _take_fields(spec, node["keys"], rm, rows, t)
        elif kind == "seq":
            rm.elem(node["elem"])
        elif kind == "segtensor":
            node["counts"] = [node["counts"][r] for r in rows]
        elif kind == "gtensor" and spec["form"] == "packed" and name == "cu_seqlens" and keys is spec["keys"]:
            sd = dt.storage_numpy(node["dtype"])
            cu = np.frombuffer(base64.b64decode(node["data"]), sd).astype(np.int64)
            new = np.zeros(len(rows) + 1, np.int64)
            np.cumsum(np.diff(cu)[rows], out=new[1:])
            raw = new.astype(sd)
            node.update(shape=[len(rows) + 1], data=base64.b64encode(raw.tobytes()).decode())
            if "col" in node and node["col"] in t.column_names:
                i = t.column_names.index(node["col"])
                t = t.set_column(i, t.schema.field(i), pa.array(raw[1:]))
    return t


def _batch_size(tag: dict | None, n: int) -> None:
    if tag is None:
        return
    if tag.get("batch_size"):
        tag["batch_size"] = [n] + tag["batch_size"][1:]
    for sub in tag.get("nested", {}).values():
        _batch_size(sub, n)


# ----------------------------------------------------------------------------- token counts
def token_counts(doc: dict, table: pa.Table) -> np.ndarray:
    """Tokens per row (int64): a padded or masked row's valid tokens (its ``__len__`` columns: the
    attention mask's, else the sum of the whole masks', as ``counted_masks``), a packed row's
    ``cu_seqlens`` difference, a list batch's element's valid ``attention_mask`` entries (else its
    ``input_ids`` entries; 0 for a None element); 1 for every row of a batch without tokens."""
    spec, n = doc["batch"], table.num_rows
    if spec["t"] == "seq":
        return _list_counts(spec["elem"], table, n)
    form, keys = spec.get("form"), dict(spec["keys"])
    if form == "packed":
        cu = keys.get("cu_seqlens")
        raw = np.frombuffer(base64.b64decode(cu["data"]), dt.storage_numpy(cu["dtype"]))
        return np.diff(raw.astype(np.int64))
    if form == "padded":
        if "len_col" in spec:
            return _ints(table, spec["len_col"])
        return _token_rows(spec["keys"], table, n, None, spec.get("T", 0))
    if form == "masked":
        out = np.zeros(n, np.int64)
        for i in counted_masks(spec) or []:
            g = spec["masks"][i]
            out += _ints(table, g["len_col"]) if "len_col" in g else _token_rows(spec["keys"], table, n, i, g["W"])
        return out
    return np.ones(n, np.int64)


def count_columns(doc: dict) -> list[str] | None:
    """The Arrow columns of a step ``doc`` describes that count each row's tokens, for ``token_counts`` of
    the step or of its shards joined; None where it may read any (a list batch's elements). ``step`` (the
    rows), and: a padded or masked batch's length columns (else one token column of each counted group)
    with a span group's start column (the join places the group's rows with it); a packed batch's column
    ``cu_seqlens`` (the join rebuilds the spec's ``cu_seqlens`` from it; None where a file lacks it)."""
    spec = doc["batch"]
    if spec["t"] == "seq":
        return None
    if spec.get("form") == "packed":  # the join rebuilds cu_seqlens where its column is read
        col = (dict(spec["keys"]).get("cu_seqlens") or {}).get("col")
        return None if col is None else [STEP_COLUMN, col]
    groups = {"padded": [(None, spec)], "masked": [(i, spec["masks"][i]) for i in counted_masks(spec) or []]}
    out = [STEP_COLUMN]
    for i, g in groups.get(spec.get("form"), []):
        col = g.get("len_col") or next((node["col"] for _, node in spec["keys"] if is_token(node)
                                        and node.get("mask") == i and math.prod(node["trail"])), None)
        out += [c for c in (col, g.get("start_col")) if c is not None and c not in out]
    return out


def _ints(table: pa.Table, name: str) -> np.ndarray:
    return np.asarray(table.column(name).to_numpy(), dtype=np.int64)


def _token_rows(keys: list, table: pa.Table, n: int, mask: int | None, width: int) -> np.ndarray:
    """Row lengths from a token column (of mask group ``mask``), else every row ``width``."""
    for _, node in keys:
        if is_token(node) and node.get("mask") == mask and math.prod(node["trail"]):
            off = Columns(table, "").list_parts(node["col"], node["dtype"])[0]
            return np.diff(off) // math.prod(node["trail"])
    return np.full(n, width, np.int64)


def _list_counts(elem: dict, table: pa.Table, n: int) -> np.ndarray:
    keys = dict(elem.get("keys", [])) if elem.get("t") == "struct" else {}
    am, ids = keys.get("attention_mask"), keys.get("input_ids")
    out = np.ones(n, np.int64)
    skip = set(elem.get("none", ())) | set(elem.get("missing", ()))
    if am is not None and am.get("t") in ("cell", "value"):
        for i, v in enumerate(decode_elems(Columns(table, ""), am, n)):
            if isinstance(v, torch.Tensor | np.ndarray):
                out[i] = int(token_mask(v if v.ndim >= 2 else v.reshape(1, -1)).sum())
    elif ids is not None and ids.get("t") == "cell":
        shapes = table.column(ids["shape_col"]).to_pylist()
        out = np.array([0 if s is None else math.prod(s) for s in shapes], np.int64)
    for i in skip:
        out[i] = 0
    return out


# ----------------------------------------------------------------------------- partition
def partition(B: int, M: int, how: str = "contiguous", counts: Any = None, what: str = "") -> list[list[int]]:
    """The rows each of ``M`` ranks gets of a batch of ``B`` rows, each rank's in logical order.
    ``"contiguous"``: equal chunks in order (``DataProto.chunk``). ``"tokens"``: equal-size
    partitions balanced by ``counts`` (tokens per row): rows by count descending (ties: lower row
    first), each to the rank with the smallest total among those holding fewer than ``B/M`` rows
    (ties: lower rank). ``B % M`` must be 0; ``what`` starts the error message (the step)."""
    at = f"{what}: " if what else ""
    if how not in HOW:
        raise ConfigError(f"{at}balance must be one of {HOW}, got {how!r}")
    if type(M) is not int or type(B) is not int or M < 1 or B < 0 or (B and M > B) or B % M:
        raise ConfigError(f"{at}a batch of B={B} trajectories cannot be split into M={M} equal slices "
                          f"(B % M must be 0, 1 <= M <= B); replay on a world size that divides {B}, "
                          "or read the whole batch (rank=None, world_size=None) and split it yourself")
    size = B // M
    if how == "contiguous":
        return [list(range(r * size, (r + 1) * size)) for r in range(M)]
    c = np.asarray(counts if counts is not None else [], dtype=np.int64).reshape(-1)
    if len(c) != B or bool((c < 0).any()):
        raise ConfigError(f"{at}balance='tokens' needs {B} non-negative token counts, got {len(c)}")
    out: list[list[int]] = [[] for _ in range(M)]
    heap = [(0, r) for r in range(M)]
    for i in sorted(range(B), key=lambda i: (-int(c[i]), i)):
        total, r = heapq.heappop(heap)
        out[r].append(i)
        if len(out[r]) < size:
            heapq.heappush(heap, (total + int(c[i]), r))
    return [sorted(rows) for rows in out]
