"""Trajectory ids (docs/FORMAT.md 3.13): every row of a logical step is trajectory ``(step, row)``, the
step and the row of the logical batch as it was dumped, whatever slice, shard or order it is read in.

* A step file without id columns holds implicit ids: ``(its step, its row)``; a shard's rows count on
  from the rows of the shards before it (rank order), so the ids are the logical batch's rows.
* A step file written with ids (``Writer.append(step, batch, ids=...)``: what a replaying rank records
  next to the rows it was given, e.g. their outputs) holds them in two int64 columns, ``traj_step``
  and ``traj_row``, named in its description (``"ids": {"step": "traj_step", "row": "traj_row"}``).

Ids are an ``int64`` numpy array of shape ``[B, 2]``: ``ids[i] == (step, row)`` of row ``i``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ...errors import BatchError

__all__ = ["STEP_COL", "ROW_COL", "ENVELOPE", "normalize", "add", "check_fields", "implicit", "of_table",
           "has_ids", "order"]

STEP_COL, ROW_COL = "traj_step", "traj_row"
ENVELOPE = {"ids": {"step": STEP_COL, "row": ROW_COL}}


def normalize(ids: Any, step: int, n: int | None) -> np.ndarray:
    """``ids`` as given to ``append`` (``Reader.ids``' ``[B, 2]`` array, a list of ``(step, row)`` pairs,
    or ``B`` rows of ``step``; numpy, torch or lists) as an int64 ``[B, 2]`` array; ``n``: the batch's
    row count when known. BatchError naming the step when they are not ids of these rows."""
    try:
        a = np.asarray(ids.detach().cpu() if hasattr(ids, "detach") else ids)
    except (TypeError, ValueError) as e:
        raise BatchError(f"step {step}: ids={type(ids).__name__} are not trajectory ids ({e})") from None
    if a.dtype.kind not in "iu" and not (a.dtype.kind == "O" and a.size == 0) and a.size:
        raise BatchError(f"step {step}: ids of dtype {a.dtype} are not trajectory ids; give integers: the rows "
                         "of the step, or (step, row) pairs as Reader.ids / Recorder.ids return them")
    if a.ndim == 1:
        a = np.stack([np.full(len(a), step, np.int64), a.astype(np.int64)], axis=1)
    if a.ndim != 2 or a.shape[1] != 2:
        raise BatchError(f"step {step}: ids of shape {list(a.shape)}; give B rows of the step, or a [B, 2] array "
                         "of (step, row) pairs as Reader.ids / Recorder.ids return them")
    a = a.astype(np.int64)
    if n is not None and len(a) != n:
        raise BatchError(f"step {step}: {len(a)} ids for a batch of {n} trajectories; give one id per trajectory "
                         "(Recorder.ids(step) / Reader.ids(step) of the rows this rank was given)")
    if len(a) and a.min() < 0:
        raise BatchError(f"step {step}: ids hold negative numbers; an id is (step, row) of the logical batch")
    if len(np.unique(a, axis=0)) != len(a):
        raise BatchError(f"step {step}: ids hold the same (step, row) twice; each trajectory has its own id")
    return np.ascontiguousarray(a)


def check_fields(names: Any, step: int) -> None:
    """A batch recorded with ids may not have a field named like an id column."""
    bad = [c for c in (STEP_COL, ROW_COL) if c in names]
    if bad:
        raise BatchError(f"step {step}: the batch has a field named {bad[0]!r}, the column a step file recorded "
                         "with ids keeps them in (docs/FORMAT.md 3.13); rename the field to record it with ids")


def add(table: pa.Table, ids: np.ndarray, step: int) -> pa.Table:
    """``table`` with its rows' ids appended as two int64 columns."""
    if table.num_rows != len(ids):
        raise BatchError(f"step {step}: {len(ids)} ids for a batch of {table.num_rows} trajectories")
    check_fields(table.column_names, step)
    for name, k in ((STEP_COL, 0), (ROW_COL, 1)):
        table = table.append_column(pa.field(name, pa.int64(), nullable=False), pa.array(ids[:, k]))
    return table


def has_ids(doc: dict) -> bool:
    """Whether a step file's description says it holds id columns."""
    return doc.get("ids") == ENVELOPE["ids"]


def implicit(step: int, start: int, n: int) -> np.ndarray:
    """The ids of ``n`` rows of ``step`` from logical row ``start`` on."""
    return np.stack([np.full(n, step, np.int64), np.arange(start, start + n, dtype=np.int64)], axis=1)


def of_table(doc: dict, table: pa.Table, step: int, start: int) -> np.ndarray:
    """The ids of a step file's (or shard's) rows: its id columns, else implicit from ``start``."""
    if not has_ids(doc):
        return implicit(step, start, table.num_rows)
    cols = [table.column(c).to_numpy() for c in (STEP_COL, ROW_COL)]
    return np.stack(cols, axis=1).astype(np.int64) if table.num_rows else np.zeros((0, 2), np.int64)


def order(ids: np.ndarray) -> np.ndarray | None:
    """The row order that sorts ``ids`` by (step, row), or None when they are in order already."""
    o = np.lexsort((ids[:, 1], ids[:, 0]))
    return None if np.array_equal(o, np.arange(len(ids))) else o
