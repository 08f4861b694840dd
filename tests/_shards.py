"""Helpers of the shard tests (tests/test_shards.py, tests/test_shards_cases.py): a batch encoded
as a rank's shard, decoded after a join, and cut into rows the way a framework's dispatch cuts it."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import torch
from hypothesis import strategies as st

from trajstore import schema
from trajstore.format.file import validate
from trajstore.format.batch.containers import DataProtoLike
from trajstore.format.shard.shards import RANK_COLUMN, join


def encode(batch, step: int = 7, meta: dict | None = None) -> tuple[dict, pa.Table]:
    t = schema.encode(batch, step=step, split="train", meta=meta)
    return json.loads(t.schema.metadata[b"trajstore"]), t


def shard(batch, r: int, n: int, meta: dict | None = None) -> tuple[dict, pa.Table]:
    """A rank's shard as the writer stores it: its envelope names it, its table has ``rank``."""
    doc, t = encode(batch, meta=meta)
    doc["shard"] = {"rank": r, "world_size": n}
    return doc, t.append_column(pa.field(RANK_COLUMN, pa.int32()), pa.array(np.full(t.num_rows, r, np.int32)))


def decode(doc: dict, table: pa.Table):
    validate.check(doc, table.schema, table.num_rows, "joined")
    assert doc["num_rows"] == table.num_rows and RANK_COLUMN not in table.column_names
    return schema.decode(table, doc["batch"], where="joined")


def batch_rows(batch) -> int:
    if isinstance(batch, list | tuple):
        return len(batch)
    if isinstance(batch, DataProtoLike):
        return len(batch)
    doc, _ = encode(batch)
    return doc["num_rows"]


def select(batch, rows: list[int]):
    """The trajectories ``rows`` of a batch, as a framework's dispatch cuts it: per-row fields
    indexed, per-token fields of a packed batch and image rows by their runs, ``cu_seqlens``
    rebuilt, batch-wide values (widths, ``max_seqlen``, ``meta_info``) kept."""
    if isinstance(batch, list):
        return [batch[i] for i in rows]
    if isinstance(batch, tuple):
        return tuple(batch[i] for i in rows)
    if isinstance(batch, DataProtoLike):
        idx = torch.tensor(rows, dtype=torch.int64)
        return DataProtoLike(batch=None if batch.batch is None else batch.batch[idx],
                             non_tensor_batch={k: v[rows] for k, v in batch.non_tensor_batch.items()},
                             meta_info=batch.meta_info)
    if hasattr(batch, "batch_size"):  # a TensorDict
        return batch[torch.tensor(rows, dtype=torch.int64)]
    spec = encode(batch)[0]["batch"]
    return {k: _cut(batch[k], node, rows, spec, batch, k) for k, node in spec["keys"]}


def _runs(counts: list[int], rows: list[int]) -> list[int]:
    start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return [j for i in rows for j in range(int(start[i]), int(start[i + 1]))]


def _cut(v, node: dict, rows: list[int], spec: dict, batch: dict, name: str):
    t = node["t"]
    if t == "group":
        return {k: _cut(v[k], n, rows, spec, batch, k) for k, n in node["keys"]}
    if t == "seq":
        return v[rows] if isinstance(v, np.ndarray) else type(v)(v[i] for i in rows)
    if t == "segtensor":
        return v[_runs(node["counts"], rows)]
    if t == "gtensor" and spec["form"] == "packed" and name == "cu_seqlens":
        lens = (v[1:] - v[:-1])[rows]
        out = torch.zeros(len(rows) + 1, dtype=v.dtype)
        out[1:] = lens.cumsum(0)
        return out
    if t == "tensor" and spec["form"] == "packed" and node["kind"] == "token":
        cu = batch["cu_seqlens"]
        return v[_runs((cu[1:] - cu[:-1]).tolist(), rows)]
    if t == "tensor":
        return v[rows] if isinstance(v, np.ndarray) else v[torch.tensor(rows, dtype=torch.int64)]
    return v  # a value of the whole batch


def cuts(draw, B: int) -> list[list[int]]:
    """N chunks of 0..B-1 in order: equal (DataProto.chunk) or uneven (each rank its own rollouts)."""
    n = draw(st.integers(1, 4))
    if draw(st.booleans()) and B % n == 0:
        bounds = [B * r // n for r in range(n + 1)]
    else:
        bounds = [0] + sorted(draw(st.lists(st.integers(0, B), min_size=n - 1, max_size=n - 1))) + [B]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def joined(batch, chunks: list[list[int]], metas: list | None = None):
    parts = [shard(select(batch, rows), r, len(chunks), None if metas is None else metas[r])
             for r, rows in enumerate(chunks)]
    return join(parts)
