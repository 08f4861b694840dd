"""``diff`` aligned on trajectory ids (docs/FORMAT.md 3.13, docs/PRECISION.md): two runs whose rows of a
step are sliced and ordered differently (outputs recorded by 4 ranks and by 2 token-balanced ranks)
are compared trajectory by trajectory.

* ``align``: when a compared step of either dump holds stored ids, both readers read every step in
  id order (``Reader._by_id``), so row ``i`` of both is the same trajectory; a step whose two sides
  hold other ids is one ``mismatch`` entry naming them (``id_mismatch``), its fields not compared.
* ``finish``: each entry's trajectories (first and worst value, those beyond tolerance) get their ids,
  and the mean absolute and relative differences are set from the running sums.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from ..format.shard import ids as idcol
from ..read.reader import Reader

__all__ = ["align", "id_mismatch", "finish", "meta_entries"]


def _stored(r: Reader, step: int) -> bool:
    return any(idcol.has_ids(r._open(step, check=False, f=f).doc) for f in r.files(step))


def align(ra: Reader, rb: Reader, steps: list[int]) -> tuple[Reader, Reader, bool]:
    """``(ra, rb, aligned)``: when a step of either dump holds stored ids, copies of both readers that read
    every step in id order (the caller's readers are left as they are), else the readers themselves."""
    if rb is ra or not any(_stored(r, s) for s in steps for r in (ra, rb) if s in r.steps):
        return ra, rb, False
    ra, rb = copy.copy(ra), copy.copy(rb)
    ra._by_id = rb._by_id = True
    return ra, rb, True


def _show(ids: np.ndarray, n: int = 5) -> str:
    return ", ".join(f"({s}, {r})" for s, r in ids[:n].tolist()) + (", ..." if len(ids) > n else "")


def id_mismatch(ra: Reader, rb: Reader, step: int) -> str | None:
    """Why step ``step`` cannot be compared row by row in id order (other trajectories on each side),
    or None."""
    a, b = ra.ids(step), rb.ids(step)
    if a.shape == b.shape and np.array_equal(a, b):
        return None
    sa, sb = {tuple(x) for x in a.tolist()}, {tuple(x) for x in b.tolist()}
    only_a, only_b = np.array(sorted(sa - sb)).reshape(-1, 2), np.array(sorted(sb - sa)).reshape(-1, 2)
    parts = [f"{len(x)} only in {w} ({_show(x)})" for x, w in ((only_a, "a"), (only_b, "b")) if len(x)]
    dup = [w for x, w in ((a, "a"), (b, "b")) if len({tuple(i) for i in x.tolist()}) != len(x)]
    parts += [f"{w} holds an id twice" for w in dup]
    return "trajectory ids differ: " + "; ".join(parts or ["other order"])


def finish(entries: list[Any], ra: Reader, aligned: bool) -> None:
    """Means of the entries, and when ``aligned`` the ids of their trajectories (see the module doc);
    otherwise a trajectory is its row of the step (its implicit id's row)."""
    cache: dict[int, np.ndarray | None] = {}

    def id_of(step: int, traj: Any) -> list[int] | None:
        if step not in cache:
            try:
                cache[step] = ra.ids(step)
            except Exception:  # noqa: BLE001 - a step not in a, or not readable: its entry says so
                cache[step] = None
        ids = cache[step]
        return None if ids is None or not isinstance(traj, int) or not 0 <= traj < len(ids) else ids[traj].tolist()

    for e in entries:
        n = e.sums.get("n", 0)
        if n:
            e.mean_abs, e.mean_rel = e.sums["ad"] / n, e.sums.get("rd", 0.0) / n
        if not aligned:
            continue
        for loc in (e.first, e.worst):
            if loc and "trajectory" in loc:
                i = id_of(e.step, loc["trajectory"])
                if i is not None:
                    loc["id"] = i
        if e.beyond:
            got = [id_of(e.step, t) for t in e.beyond]
            if all(g is not None for g in got):
                e.beyond = got


def _scalars(meta: dict) -> dict[str, np.ndarray]:
    """The numbers of a step's metadata (a number, or the list of the ranks' numbers where they differed)."""
    out = {}
    for k, v in meta.items():
        vals = v if isinstance(v, list) else [v]
        if vals and all(isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool) for x in vals):
            out[str(k)] = np.asarray(v, dtype=np.float64)
    return out


def meta_entries(ra: Reader, rb: Reader, step: int, make: Any) -> list[Any]:
    """One entry per per-step scalar of the step metadata (``meta.loss``, ``meta.grad_norm``): compared as
    numbers; a value the ranks of a run disagreed on is the list of their values (docs/FORMAT.md 3.12),
    compared where both runs have as many ranks. ``make(label)`` makes the accumulator."""
    ma, mb = _scalars(ra.meta(step)), _scalars(rb.meta(step))
    out = []
    for k in list(ma) + [k for k in mb if k not in ma]:
        acc = make(f"meta.{k}")
        a, b = ma.get(k), mb.get(k)
        if a is None or b is None:
            acc.e.status, acc.e.note = "missing", f"per-step scalar {k!r} is not in {'a' if a is None else 'b'}"
        elif a.shape != b.shape:
            acc.e.status = "mismatch"
            acc.e.note = (f"{k!r} holds {a.size} vs {b.size} value(s): a value that differs between ranks is kept "
                          "per rank; record a value reduced over the ranks (all-reduce) to compare runs of other layouts")
        else:
            acc.add(0, a, b)
            for loc in (acc.e.first, acc.e.worst):
                if loc:
                    loc.pop("trajectory", None)
                    if a.ndim and "token" in loc:
                        loc["rank"] = loc.pop("token")
            acc.e.beyond = []
        out.append(acc.e)
    return out
