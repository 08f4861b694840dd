"""Compare two dumps (or two fields of one dump) step by step, field by field, token by token.

Values are compared per trajectory on its own tokens (padding removed, see ``trajstore.format.rows``),
so a token index is a position inside that trajectory. Numbers are compared as float64 (integers exactly up
to 2**53): a value is *within tolerance* when ``|a - b| <= atol + rtol * |b|`` (``b`` is the
reference, as in ``numpy.isclose``); two NaNs at the same place are equal. With the default
``atol=rtol=0`` any difference fails. Non-numeric values (strings, JSON) must be equal.

Each (step, field) gets a status:

``identical``  bit for bit the same (same dtype, same bits)
``close``      not identical but every value within tolerance (also: same values, other dtype)
``differs``    some value beyond tolerance; ``first`` says where
``mismatch``   shapes or trajectory counts differ, or a trajectory is rejected on one side only
``missing``    the step or field exists on one side only
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from .._text import parse_steps
from ..errors import ConfigError
from ..format.rows import row_mask
from ..reader import Reader
from ..tables import step_rows

__all__ = ["diff", "DiffReport", "FieldDiff"]

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
    # running sums for summary statistics (numeric fields)
    sums: dict = field(default_factory=dict, repr=False)


@dataclass
class DiffReport:
    """Result of :func:`trajstore.diff`; ``ok`` is False when anything is beyond tolerance."""

    a: str
    b: str
    atol: float
    rtol: float
    entries: list[FieldDiff]
    pair: tuple[str, str] | None = None
    abs_diffs: dict = field(default_factory=dict, repr=False)  # pair mode: field -> |a-b| (float32)

    @property
    def ok(self) -> bool:
        return all(e.status in OK for e in self.entries)

    @property
    def identical(self) -> bool:
        return all(e.status == "identical" for e in self.entries)

    @property
    def first_divergence(self) -> dict | None:
        """The first (step, field order) entry that is not within tolerance."""
        for e in self.entries:
            if e.status not in OK:
                return {"step": e.step, "field": e.field, "status": e.status, **(e.first or {}),
                        **({"note": e.note} if e.note else {})}
        return None

    def fields(self) -> dict[str, dict]:
        """Per-field summary over all steps: status counts, max differences, statistics."""
        out: dict[str, dict] = {}
        for e in self.entries:
            f = out.setdefault(e.field, {"steps": 0, "status": {}, "n": 0, "n_exceed": 0, "max_abs": None,
                                         "max_rel": None, "first": None, "_s": {}})
            f["steps"] += 1
            f["status"][e.status] = f["status"].get(e.status, 0) + 1
            f["n"] += e.n
            f["n_exceed"] += e.n_exceed
            for k in ("max_abs", "max_rel"):
                v = getattr(e, k)
                if v is not None and (f[k] is None or v > f[k] or math.isnan(v)):
                    f[k] = v
            if f["first"] is None and e.status not in OK:
                f["first"] = {"step": e.step, **(e.first or {}), **({"note": e.note} if e.note else {})}
            for k, v in e.sums.items():
                f["_s"][k] = f["_s"].get(k, 0.0) + v
        for name, f in out.items():
            f.update(_stats(f.pop("_s")))
            f["status"] = _overall(f["status"])
            if name in self.abs_diffs and len(self.abs_diffs[name]):
                d = np.concatenate(self.abs_diffs[name])
                d = d[~np.isnan(d)]
                if len(d):
                    for q in (50, 90, 99):
                        f[f"p{q}_abs"] = float(np.percentile(d, q))
        return out

    def to_dict(self) -> dict:
        return {
            "a": self.a, "b": self.b, "atol": self.atol, "rtol": self.rtol, "ok": self.ok,
            "identical": self.identical, "pair": list(self.pair) if self.pair else None,
            "first_divergence": self.first_divergence, "fields": self.fields(),
            "entries": [{k: v for k, v in asdict(e).items() if k != "sums"} for e in self.entries],
        }


def _overall(counts: dict) -> str:
    for s in ("missing", "mismatch", "differs", "close", "identical"):
        if counts.get(s):
            return s
    return "identical"


def _stats(s: dict) -> dict:
    n = s.get("n", 0)
    if not n:
        return {}
    out = {"mean_diff": s["d"] / n, "mean_abs": s["ad"] / n, "rmse": math.sqrt(s["d2"] / n)}
    va = s["a2"] / n - (s["a"] / n) ** 2
    vb = s["b2"] / n - (s["b"] / n) ** 2
    if va > 0 and vb > 0:
        out["corr"] = (s["ab"] / n - (s["a"] / n) * (s["b"] / n)) / math.sqrt(va * vb)
    return out


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
            s = e.sums
            xs, ys, ds = xf[fin], yf[fin], d[fin]
            for k, v in (("n", float(fin.sum())), ("d", ds.sum()), ("ad", np.abs(ds).sum()), ("d2", (ds * ds).sum()),
                         ("a", xs.sum()), ("b", ys.sum()), ("a2", (xs * xs).sum()), ("b2", (ys * ys).sum()),
                         ("ab", (xs * ys).sum())):
                s[k] = s.get(k, 0.0) + float(v)
            if self.keep_abs:
                self.abs.append(ad.astype(np.float32))
        nbad = int(bad.sum())
        if nbad:
            e.n_exceed += nbad
            if e.status != "differs":
                j = int(np.argmax(bad))
                flat = int(idx[j]) if idx is not None else j
                first = {"trajectory": traj}
                if x.ndim >= 1:
                    first["token"] = flat // width
                    if width > 1:
                        first["element"] = flat % width
                first.update(a=_num(xf[j]), b=_num(yf[j]), abs=_num(ad[j]))
                e.status, e.first = "differs", first
        elif not same and e.status == "identical":
            e.status = "close"


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


def _reader(x: Any, split: str) -> Reader:
    return x if isinstance(x, Reader) else Reader(x, split)


def diff(a: Any, b: Any = None, *, steps: Iterable[int] | str | None = None,
         fields: Iterable[str] | None = None, atol: float = 0.0, rtol: float = 0.0,
         split: str = "train", pair: tuple[str, str] | None = None, mask: str | None = None,
         progress: Callable[[Iterable], Iterable] | None = None) -> DiffReport:
    """Compare dump ``a`` with dump ``b`` (paths or Readers) and return a :class:`DiffReport`.

    ``steps``: steps to compare (default: every step of either dump; ``"0-9,12"`` accepted).
    ``fields``: fields to compare (default: every field of the step).
    ``pair=("logprobs", "old_logprobs")``: compare field ``pair[0]`` of ``a`` with field ``pair[1]``
    of ``b`` (``b`` defaults to ``a``: two fields of one dump), with summary statistics and
    percentiles of ``|a - b|``. ``mask``: a per-token field (of ``a``); only tokens where it is
    non-zero are compared (e.g. ``"loss_mask"``). ``progress`` wraps the step iterable (a progress bar).
    """
    if atol < 0 or rtol < 0 or math.isnan(atol) or math.isnan(rtol):
        raise ConfigError(f"atol={atol}, rtol={rtol}: tolerances must be >= 0")
    if b is None and pair is None:
        raise ConfigError("diff needs two dumps, or one dump and pair=(field_a, field_b)")
    ra = _reader(a, split)
    rb = ra if b is None else _reader(b, split)
    want = parse_steps(steps, "steps")
    all_steps = sorted(set(ra.steps) | set(rb.steps)) if want is None else want
    entries: list[FieldDiff] = []
    absd: dict[str, list] = {}
    it = progress(all_steps) if progress else all_steps
    for s in it:
        in_a, in_b = s in ra.steps, s in rb.steps
        if not (in_a and in_b):
            side = "b" if in_a else "a" if in_b else "either dump"
            entries.append(FieldDiff(s, "*", "missing", note=f"step {s} is not in {side}"))
            continue
        entries.extend(_step(ra, rb, s, fields, atol, rtol, pair, mask, absd))
    return DiffReport(str(ra.path), str(rb.path), atol, rtol, entries, tuple(pair) if pair else None, absd)


def _step(ra: Reader, rb: Reader, s: int, fields: Iterable[str] | None, atol: float, rtol: float,
          pair: tuple[str, str] | None, mask: str | None, absd: dict[str, list]) -> list[FieldDiff]:
    """The entries of step ``s``: one per compared field (``absd`` collects ``|a - b|`` in pair mode)."""
    xa = step_rows(ra, s)
    xb = xa if rb is ra else step_rows(rb, s)
    names_a = _names(xa)
    names_b = _names(xb)
    if pair:
        todo = [(pair[0], pair[1], f"{pair[0]} vs {pair[1]}")]
    else:
        order = list(names_a) + [n for n in names_b if n not in names_a]
        if fields is not None:
            order = list(fields)
        todo = [(n, n, n) for n in order]
    out = []
    for fa, fb, label in todo:
        acc = _Field(s, label, atol, rtol, keep_abs=bool(pair))
        if fa not in names_a or fb not in names_b:
            where = " and ".join(w for w, ok in (("a", fa in names_a), ("b", fb in names_b)) if not ok)
            name = fa if fa not in names_a else fb
            acc.e.status, acc.e.note = "missing", f"field {name!r} is not in {where} at step {s}"
            out.append(acc.e)
            continue
        if len(xa) != len(xb):
            acc.fail("mismatch", None, f"{len(xa)} trajectories vs {len(xb)}")
        for i in range(min(len(xa), len(xb))):
            ra_i, rb_i = xa[i], xb[i]
            if ra_i is None or rb_i is None:
                acc.add(i, ra_i, rb_i)
                continue
            m = ra_i.get(mask) if mask else None
            if mask and m is None and fa in ra_i:
                raise ConfigError(f"mask field {mask!r} is not in trajectory {i} of step {s} of {ra.path}")
            acc.add(i, ra_i.get(fa), rb_i.get(fb), m)
        if acc.abs:
            absd.setdefault(label, []).extend(acc.abs)
        out.append(acc.e)
    return out


def _names(rs: list) -> dict:
    names: dict = {}
    for r in rs:
        if r is not None:
            for k in r:
                names.setdefault(k, None)
    return names
