"""One field of one step in ``diff``: the accumulator that compares values and keeps the entry.

``_Field.add`` compares one trajectory's values (the decode path, ``format.rows``); ``add_flat`` every
trajectory of a step at once, their values concatenated (the column path, ``diff_arrow``): both give
the same entry (status, counts, maxima, first divergence; the running sums of the statistics agree
to rounding). The rules are in ``diff``'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..format.codec.rows import row_mask
from . import diff_arrow

__all__ = ["FieldDiff", "OK"]

OK = ("identical", "close")


@dataclass
class FieldDiff:
    """The comparison of one field at one step."""

    step: int
    field: str
    status: str
    n: int = 0                      # values compared
    n_exceed: int = 0               # values beyond tolerance
    max_abs: float | None = None    # max |a - b|
    max_rel: float | None = None    # max |a - b| / |b|
    first: dict | None = None       # first value beyond tolerance: step, trajectory, token, a, b
    note: str = ""
    worst: dict | None = None       # the largest |a - b|: trajectory, token, a, b, abs, rel
    beyond: list = field(default_factory=list)  # the trajectories with a value beyond tolerance
    mean_abs: float | None = None   # mean |a - b| over the finite values (set when the report is made)
    mean_rel: float | None = None   # mean |a - b| / |b|
    # running sums for summary statistics (numeric fields)
    sums: dict = field(default_factory=dict, repr=False)



def _numeric(v: Any) -> bool:
    return isinstance(v, np.ndarray | np.generic | int | float | bool) and np.asarray(v).dtype.kind in "biuf"


def _same_bits(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


class _Field:
    """Accumulates the comparison of one field over the trajectories of one step."""

    def __init__(self, step: int, name: str, atol: float, rtol: float, keep_abs: bool) -> None:
        self.e = FieldDiff(step, name, "identical")
        self.atol, self.rtol, self.keep_abs = atol, rtol, keep_abs
        self.abs: list[np.ndarray] = []

    def fail(self, status: str, traj: int | None, note: str) -> None:
        if self.e.status not in ("mismatch", "missing"):
            self.e.status, self.e.note = status, note
            self.e.first = {"trajectory": traj} if traj is not None else None

    def add(self, traj: int, a: Any, b: Any, mask: Any = None) -> None:
        e = self.e
        if e.status in ("mismatch", "missing"):
            return
        if a is None or b is None:
            if (a is None) != (b is None):
                self.fail("mismatch", traj, f"trajectory {traj} is missing or rejected on one side only")
            return
        if not (_numeric(a) and _numeric(b)):
            if _numeric(a) != _numeric(b) or _jsonish(a) != _jsonish(b):
                e.n += 1
                e.n_exceed += 1
                e.beyond = sorted(set(e.beyond) | {traj})
                if e.status != "differs":
                    e.status, e.first = "differs", {"trajectory": traj, "a": _short(a), "b": _short(b)}
            else:
                e.n += 1
            return
        x, y = np.asarray(a), np.asarray(b)
        if x.shape != y.shape:
            self.fail("mismatch", traj, f"trajectory {traj}: shape {list(x.shape)} vs {list(y.shape)}")
            return
        same = _same_bits(x, y)
        if x.dtype != y.dtype:
            e.note = e.note or f"dtype {x.dtype} vs {y.dtype}"
        width = int(np.prod(x.shape[1:])) if x.ndim > 1 else 1
        with np.errstate(all="ignore"):
            xf = x.astype(np.float64).reshape(-1)
            yf = y.astype(np.float64).reshape(-1)
        if mask is not None:
            if np.ndim(mask) == 0:
                self.fail("mismatch", traj, f"trajectory {traj}: the mask field is not per-token")
                return
            m = row_mask(mask)
            if x.ndim == 0 or len(m) != x.shape[0]:
                self.fail("mismatch", traj, f"trajectory {traj}: mask has {len(m)} tokens, values {x.shape[:1]}")
                return
            keep = np.repeat(m, width)
            idx = np.flatnonzero(keep)
            xf, yf = xf[keep], yf[keep]
            same = x.dtype == y.dtype and x.reshape(-1)[keep].tobytes() == y.reshape(-1)[keep].tobytes()
        else:
            idx = None
        with np.errstate(all="ignore"):  # inf - inf, huge products: handled, no warnings
            self._numbers(traj, x, xf, yf, idx, width, same)

    def _numbers(self, traj: int, x: np.ndarray, xf: np.ndarray, yf: np.ndarray, idx: np.ndarray | None,
                 width: int, same: bool) -> None:
        """Compare the float64 values ``xf`` (of ``a``) and ``yf`` (of ``b``) of trajectory ``traj``
        (``x``: its original values; ``idx``: their flat positions when masked) and update the entry."""
        self._compare(xf, yf, idx, width, same, lambda pos: (traj, pos, x.ndim >= 1),
                      lambda pos: np.full(len(pos), traj, np.int64))

    def _compare(self, xf: np.ndarray, yf: np.ndarray, idx: np.ndarray | None, width: int, same: bool,
                 locate: Any, trajs: Any) -> None:
        """The entry updated with values ``xf`` / ``yf`` (float64; ``idx``: their flat positions when
        masked); ``locate(position)`` gives the first differing value's (trajectory, flat index in it,
        whether it has a token axis); ``trajs(positions)`` the trajectory of each."""
        e = self.e
        eq = (xf == yf) | (np.isnan(xf) & np.isnan(yf))  # same infinities and NaNs are equal
        d = np.where(eq, 0.0, xf - yf)
        ad = np.abs(d)
        rel = np.where(ad == 0, 0.0, ad / np.abs(yf))
        bad = ~(eq | (ad <= self.atol + self.rtol * np.abs(yf)))
        e.n += len(xf)
        if len(xf):
            e.max_abs = _max(e.max_abs, float(np.max(ad)))
            e.max_rel = _max(e.max_rel, float(np.max(rel)))
            fin = np.isfinite(xf) & np.isfinite(yf)
            xs, ys, ds = xf[fin], yf[fin], d[fin]
            e.sums["rd"] = e.sums.get("rd", 0.0) + float(rel[fin].sum())
            self._worst(xf, yf, ad, rel, idx, width, locate)
            for k, v in (("n", float(fin.sum())), ("d", ds.sum()), ("ad", np.abs(ds).sum()), ("d2", (ds * ds).sum()),
                         ("a", xs.sum()), ("b", ys.sum()), ("a2", (xs * xs).sum()), ("b2", (ys * ys).sum()),
                         ("ab", (xs * ys).sum())):
                e.sums[k] = e.sums.get(k, 0.0) + float(v)
            if self.keep_abs:
                self.abs.append(ad.astype(np.float32))
        nbad = int(bad.sum())
        if nbad:
            e.n_exceed += nbad
            pos = np.flatnonzero(bad)
            e.beyond = sorted(set(e.beyond) | set(trajs(idx[pos] if idx is not None else pos).tolist()))
            if e.status != "differs":
                j = int(np.argmax(bad))
                first = _place(locate, int(idx[j]) if idx is not None else j, width)
                first.update(a=_num(xf[j]), b=_num(yf[j]), abs=_num(ad[j]))
                e.status, e.first = "differs", first
        elif not same and e.status == "identical":
            e.status = "close"

    def _worst(self, xf: np.ndarray, yf: np.ndarray, ad: np.ndarray, rel: np.ndarray, idx: np.ndarray | None,
               width: int, locate: Any) -> None:
        """Keep where the largest ``|a - b|`` is (a NaN on one side counts as the largest)."""
        j = int(np.argmax(ad))
        v, w = float(ad[j]), self.e.worst
        if v == 0 or w is not None and not (v > w["abs"] or math.isnan(v) and not math.isnan(w["abs"])):
            return
        out = _place(locate, int(idx[j]) if idx is not None else j, width)
        out.update(a=_num(xf[j]), b=_num(yf[j]), abs=v, rel=float(rel[j]))
        self.e.worst = out

    def add_flat(self, x: np.ndarray, y: np.ndarray, dta: np.dtype, dtb: np.dtype, counts: np.ndarray,
                 width: int, has_token: bool, keep: np.ndarray | None, same_obj: bool) -> None:
        """``add`` for every trajectory of a step at once (``diff_arrow``): ``x`` / ``y`` the values of
        all trajectories concatenated, ``counts`` how many each has, ``keep`` the mask over them."""
        e = self.e
        if dta != dtb:
            e.note = e.note or f"dtype {dta} vs {dtb}"
        if same_obj:
            same = dta == dtb
        elif keep is None:
            same = dta == dtb and np.array_equal(diff_arrow.bits(x), diff_arrow.bits(y))
        else:
            same = dta == dtb and np.array_equal(diff_arrow.bits(x)[keep], diff_arrow.bits(y)[keep])
        with np.errstate(all="ignore"):
            xf = x.astype(np.float64)
            if keep is not None:
                xf = xf[keep]
            if same and not self.keep_abs:  # bit for bit: nothing differs, only the sums to take
                e.n += len(xf)
                if len(xf):
                    e.max_abs, e.max_rel = _max(e.max_abs, 0.0), _max(e.max_rel, 0.0)
                    xs = xf[np.isfinite(xf)]
                    a, a2 = float(xs.sum()), float((xs * xs).sum())
                    for k, v in (("n", float(len(xs))), ("d", 0.0), ("ad", 0.0), ("rd", 0.0), ("d2", 0.0), ("a", a),
                                 ("b", a), ("a2", a2), ("b2", a2), ("ab", a2)):
                        e.sums[k] = e.sums.get(k, 0.0) + v
                return
            yf = y.astype(np.float64) if keep is None else y.astype(np.float64)[keep]
            idx = np.flatnonzero(keep) if keep is not None else None
            starts = np.concatenate([[0], np.cumsum(counts)])
            self._numbers_flat(xf, yf, idx, starts, width, has_token, same)

    def _numbers_flat(self, xf: np.ndarray, yf: np.ndarray, idx: np.ndarray | None, starts: np.ndarray,
                      width: int, has_token: bool, same: bool) -> None:
        """``_numbers`` over the concatenated trajectories (``starts``: where each begins)."""
        def locate(pos: int) -> tuple[int, int, bool]:
            traj = int(np.searchsorted(starts, pos, side="right")) - 1
            return traj, pos - int(starts[traj]), has_token

        self._compare(xf, yf, idx, width, same, locate,
                      lambda pos: np.searchsorted(starts, pos, side="right").astype(np.int64) - 1)


def _max(cur: float | None, v: float) -> float:
    return v if cur is None or v > cur or math.isnan(v) else cur


def _num(v: float) -> float | int:
    return int(v) if float(v).is_integer() and abs(v) < 2**53 else float(v)


def _jsonish(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return ("nd", v.dtype.str, v.shape, v.tobytes()) if v.dtype != object else ("obj", repr(v.tolist()))
    return repr(v)


def _short(v: Any) -> Any:
    r = v if isinstance(v, str | int | float | bool) or v is None else repr(v)
    return r[:80] + "…" if isinstance(r, str) and len(r) > 80 else r


def _place(locate: Any, i: int, width: int) -> dict:
    """Where value ``i`` of a compared field is: its trajectory, and its token (and element, for
    ``width`` > 1 elements per token) where the field is per token."""
    traj, flat, has_token = locate(i)
    out: dict = {"trajectory": traj}
    if has_token:
        out["token"] = flat // width
        if width > 1:
            out["element"] = flat % width
    return out
