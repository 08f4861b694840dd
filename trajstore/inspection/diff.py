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

Rows are aligned on their trajectory ids (docs/FORMAT.md 3.13, ``diff_ids``) when a compared step of either
dump holds stored ids (outputs recorded at replay): whatever the row order or rank layout of each run, row
``i`` of both is one trajectory, and each entry names the trajectories (their ids) of its first and worst
value and of every value beyond tolerance; the outputs' per-step scalars (numbers of the step metadata,
``meta.loss``) are compared too. A step whose two sides hold other trajectories is a ``mismatch``.

Only the fields compared are read. Tensor fields of padded and packed dict batches are compared on
their stored Arrow columns, every trajectory of a step at once (``diff_arrow``); the others are decoded
and compared trajectory by trajectory (``format.rows``); both give the same entries (``diff_field``).

How each step was compared (``DiffReport.compared``): two step files whose recorded SHA-256 are equal
are both hashed and checked against it (cheap next to decoding), and then read once (``bytes``); a
file that does not match its recorded checksum is damaged and its step a ``mismatch``, never
``identical`` (``damaged``); other steps are read from both dumps (``values``). ``deep=True`` checks
every step file against its recorded checksum and reads both sides' values, whatever the checksums
say. A step in one dump only is ``one side``; two fields of one dump (``pair`` without ``b``), ``one dump``.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from ..base.text import format_ranges, parse_steps, runs
from ..errors import ChecksumError, ConfigError, StepNotFoundError
from ..format.batch import containers
from ..format.codec.rows import rows
from ..format.spec import is_dict_batch
from ..read.reader import Reader
from ..store import checksums
from . import diff_arrow, diff_ids
from .diff_field import OK, FieldDiff, _Field

__all__ = ["diff", "DiffReport", "FieldDiff"]

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
    compared: dict = field(default_factory=dict)  # step -> how it was compared (the module's doc)

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
            "compared": self.how(),
        }

    def how(self) -> dict[str, list[int]]:
        """The steps compared each way (``bytes``, ``values``, ``damaged``, ``one side``, ``one dump``)."""
        out: dict[str, list[int]] = {}
        for s, h in sorted(self.compared.items()):
            out.setdefault(h, []).append(s)
        return out


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


def _reader(x: Any, split: str) -> Reader:
    return x if isinstance(x, Reader) else Reader(x, split)


FAST = True  # compare tensor fields on their stored columns (diff_arrow); False: decode every step


def diff(a: Any, b: Any = None, *, steps: Iterable[int] | str | None = None,
         fields: Iterable[str] | None = None, atol: float = 0.0, rtol: float = 0.0,
         split: str = "train", pair: tuple[str, str] | None = None, mask: str | None = None,
         first: bool = False, deep: bool = False,
         progress: Callable[[Iterable], Iterable] | None = None) -> DiffReport:
    """Compare dump ``a`` with dump ``b`` (paths or Readers) and return a :class:`DiffReport`.

    ``steps``: steps to compare (default: every step of either dump; ``"0-9,12"`` accepted; a step
    in neither dump is left out).
    ``fields``: fields to compare (default: every field of the step).
    ``pair=("logprobs", "old_logprobs")``: compare field ``pair[0]`` of ``a`` with field ``pair[1]``
    of ``b`` (``b`` defaults to ``a``: two fields of one dump), with summary statistics and
    percentiles of ``|a - b|``. ``mask``: a per-token field (of ``a``); only tokens where it is
    non-zero are compared (e.g. ``"loss_mask"``). ``first``: stop at the first entry beyond
    tolerance (the report ends there). ``deep``: check every step file against its recorded checksum
    and read the values of both, also where the two files' checksums are equal (the module's doc).
    ``progress`` wraps the step iterable (a progress bar).

    Only the fields compared are read. Raises ``StepNotFoundError`` when none of ``steps`` is in
    either dump, ``ConfigError`` when a field of ``fields`` (or of ``pair``) is in no compared step.
    """
    if atol < 0 or rtol < 0 or math.isnan(atol) or math.isnan(rtol):
        raise ConfigError(f"atol={atol}, rtol={rtol}: tolerances must be >= 0")
    if b is None and pair is None:
        raise ConfigError("diff needs two dumps (A B), or one dump and two of its fields to compare "
                          "(--pair FIELD_A FIELD_B; pair= in Python)")
    ra = _reader(a, split)
    rb = ra if b is None else _reader(b, split)
    want = parse_steps(steps, "steps")
    both = set(ra.steps) | set(rb.steps)
    if want is not None and not set(want) & both:
        raise StepNotFoundError(
            f"steps {format_ranges(runs(sorted(want)))}: none is in {ra.path} (steps {format_ranges(runs(ra.steps))})"
            + ("" if rb is ra else f" or {rb.path} (steps {format_ranges(runs(rb.steps))})"), step=want[0])
    all_steps = sorted(both) if want is None else [s for s in want if s in both]  # in neither: no difference
    fields = None if fields is None else list(fields)
    _check_fields(ra, rb, all_steps, fields, pair, mask)
    entries: list[FieldDiff] = []
    absd: dict[str, list] = {}
    how: dict[int, str] = {}
    it = progress(all_steps) if progress else all_steps
    ra, rb, aligned = diff_ids.align(ra, rb, all_steps)  # rows joined on their trajectory ids
    for s in it:
        in_a, in_b = s in ra.steps, s in rb.steps
        if not (in_a and in_b):
            side = "b" if in_a else "a"
            how[s] = "one side"
            entries.append(FieldDiff(s, "*", "missing", note=f"step {s} is not in {side}"))
        elif aligned and (why := diff_ids.id_mismatch(ra, rb, s)):
            how[s] = "values"
            entries.append(FieldDiff(s, "*", "mismatch", note=why))
        else:
            how[s], damaged = _how(ra, rb, s, deep)
            if damaged:
                entries.append(FieldDiff(s, "*", "mismatch", note=damaged))
            else:
                entries.extend(_step(ra, rb, s, fields, atol, rtol, pair, mask, absd, first, how[s] == "bytes"))
                if aligned and fields is None:  # outputs: their per-step scalars too
                    entries.extend(diff_ids.meta_entries(ra, rb, s, lambda k: _Field(s, k, atol, rtol, False)))
        if first and entries and entries[-1].status not in OK:
            break
    diff_ids.finish(entries, ra, aligned)
    return DiffReport(str(ra.path), str(rb.path), atol, rtol, entries, tuple(pair) if pair else None, absd, how)


def _how(ra: Reader, rb: Reader, s: int, deep: bool) -> tuple[str, str | None]:
    """How step ``s`` is compared (the module's doc), and why it is damaged (None if it is not)."""
    if rb is ra:
        return "one dump", None
    same = diff_arrow.same_file(ra, rb, s)
    if not (same or deep):
        return "values", None
    for side, r in (("a", ra), ("b", rb)):
        for f in r.files(s):
            if not same and not checksums.recorded(f):
                continue  # written without checksums: nothing to check it against
            try:
                checksums.check_file(f, s)
            except ChecksumError as e:
                return "damaged", f"{side}'s step file {e}"
    return ("bytes" if same and not deep else "values"), None


def _names_of(r: Reader, s: int, spec: dict) -> dict:
    """The field names of step ``s`` (from its spec; a list batch's by decoding it)."""
    names = diff_arrow.field_names(spec)
    return names if names is not None else _names(_rows(r, s, spec, None))


def _check_fields(ra: Reader, rb: Reader, steps: list[int], fields: list[str] | None,
                  pair: tuple[str, str] | None, mask: str | None = None) -> None:
    """A field asked for (or the mask, of A) that no compared step holds is a mistake, not a difference."""
    if pair:
        ask = [(pair[0], (ra,)), (pair[1], (rb,))]
    else:
        ask = [(f, (ra, rb)) for f in fields or ()]
    ask += [(mask, (ra,))] if mask else []
    if not ask:
        return
    seen: dict[str, None] = {}
    todo = dict(ask)
    for s in steps:
        for r in dict.fromkeys((ra, rb)):
            if s not in r.steps:
                continue
            names = _names_of(r, s, r.info(s)["batch"])
            seen.update(dict.fromkeys(names))
            for f, where in list(todo.items()):
                if f in names and r in where:
                    del todo[f]
        if not todo:
            return
    f, where = next(iter(todo.items()))
    dumps = " or ".join(str(r.path) for r in dict.fromkeys(where))
    have = ", ".join(list(seen)[:30]) + (", ..." if len(seen) > 30 else "")
    close = difflib.get_close_matches(f, list(seen), n=1)
    raise ConfigError(f"{'mask ' if f == mask and not (pair and f in pair) else ''}field {f!r} is in no compared "
                      f"step of {dumps}{f'; did you mean {close[0]}?' if close else ''}; fields: {have or 'none'}")


def _rows(r: Reader, s: int, spec: dict, want: set[str] | None) -> list[dict | None]:
    """The trajectories of step ``s`` (``format.rows``), decoding only the top-level fields that the
    dotted names ``want`` (None: all) and the cutting of their rows need."""
    cols = None
    if want is not None and is_dict_batch(spec):
        top = [k for k, _ in spec["keys"]]
        need: set[str] | None = set()
        for n in want:
            t = next((k for k in top if n == k or n.startswith(f"{k}.")), None)
            if t is None:
                need = None
                break
            need.add(t)
        if need is not None:
            need |= {"attention_mask", "cu_seqlens", "max_seqlen", "prompts", "responses"}
            need |= {g["src"] for g in spec.get("masks", [])}
            cols = [k for k in top if k in need]
    return rows(containers.unwrap(r.read(s, columns=cols))[0], spec)


def _step(ra: Reader, rb: Reader, s: int, fields: list[str] | None, atol: float, rtol: float,
          pair: tuple[str, str] | None, mask: str | None, absd: dict[str, list], first: bool,
          same_bytes: bool = False) -> list[FieldDiff]:
    """The entries of step ``s``: one per compared field (``absd`` collects ``|a - b|`` in pair mode)."""
    spec_a, spec_b = ra.info(s)["batch"], rb.info(s)["batch"]
    na, nb = diff_arrow.field_names(spec_a), diff_arrow.field_names(spec_b)
    fast = (FAST and na is not None and nb is not None and diff_arrow.plan(spec_a) and diff_arrow.plan(spec_b)
            and spec_a["B"] == spec_b["B"] and ra._slice is None and rb._slice is None)
    xa = xb = None
    if na is None or nb is None:  # a list batch: its names come from its rows
        want = None if fields is None and not pair else set(fields or ()) | set(pair or ()) | {mask} - {None}
        xa = _rows(ra, s, spec_a, want)
        xb = xa if rb is ra else _rows(rb, s, spec_b, want)
        na, nb = _names(xa), _names(xb)
    if pair:
        todo = [(pair[0], pair[1], f"{pair[0]} vs {pair[1]}")]
    else:
        todo = [(n, n, n) for n in (fields if fields is not None else list(na) + [n for n in nb if n not in na])]
    done: dict[str, _Field] = {}
    if fast:
        done = _fast(ra, rb, s, spec_a, spec_b, na, nb, todo, mask, atol, rtol, bool(pair), same_bytes)
    out = []
    for fa, fb, label in todo:
        acc = done.get(label)
        if acc is None:
            acc = _Field(s, label, atol, rtol, keep_abs=bool(pair))
            if fa not in na or fb not in nb:
                where = " and ".join(w for w, ok in (("a", fa in na), ("b", fb in nb)) if not ok)
                name = fa if fa not in na else fb
                acc.e.status, acc.e.note = "missing", f"field {name!r} is not in {where} at step {s}"
            else:
                if xa is None:  # decode path: only the fields not compared on their columns
                    left = [(f_a, f_b) for f_a, f_b, lab in todo if lab not in done and f_a in na and f_b in nb]
                    want_a = {f_a for f_a, _ in left} | ({mask} & set(na))
                    want_b = {f_b for _, f_b in left}
                    xa = _rows(ra, s, spec_a, want_a | want_b if rb is ra else want_a)
                    xb = xa if rb is ra else _rows(rb, s, spec_b, want_b)
                _slow(acc, ra, s, xa, xb, fa, fb, mask)
        if acc.abs:
            absd.setdefault(label, []).extend(acc.abs)
        out.append(acc.e)
        if first and acc.e.status not in OK:
            break
    return out


def _fast(ra: Reader, rb: Reader, s: int, spec_a: dict, spec_b: dict, na: dict, nb: dict, todo: list,
          mask: str | None, atol: float, rtol: float, keep_abs: bool, same_bytes: bool) -> dict[str, _Field]:
    """The fields of ``todo`` compared on their stored columns (``diff_arrow``), read in one go."""
    def cols(spec: dict, names: dict, fs: list[str]) -> tuple[list[str], list[str]]:
        """The columns of the fields ``fs`` taken on this path, and their top-level fields."""
        out, tops = [], []
        for f in fs:
            node = names.get(f)
            c = None if node is None else node["col"] if diff_arrow.eligible(spec, node) else diff_arrow.strings(node)
            if c:
                out.append(c)
                tops += [k for k, _ in spec["keys"] if f == k or f.startswith(f"{k}.")][:1]
        return out, tops

    cols_a, tops_a = cols(spec_a, na, [f for f, _, _ in todo] + ([mask] if mask else []))
    cols_b, tops_b = cols(spec_b, nb, [f for _, f, _ in todo])
    if not cols_a or not cols_b:
        return {}
    if ra is rb or same_bytes:  # the same bytes (both files checked against their checksum): read once
        xa = xb = diff_arrow.read_columns(ra, s, cols_a + cols_b, tops_a + tops_b)
    else:
        xa, xb = diff_arrow.read_columns(ra, s, cols_a, tops_a), diff_arrow.read_columns(rb, s, cols_b, tops_b)
    if xa is None or xb is None:
        return {}
    return diff_arrow.fast_step(lambda label: _Field(s, label, atol, rtol, keep_abs), xa, xb, spec_a, spec_b,
                                todo, na, nb, mask)


def _slow(acc: _Field, ra: Reader, s: int, xa: list, xb: list, fa: str, fb: str, mask: str | None) -> None:
    """Compare field ``fa`` of the rows ``xa`` with ``fb`` of ``xb``, trajectory by trajectory."""
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


def _names(rs: list) -> dict:
    names: dict = {}
    for r in rs:
        if r is not None:
            for k in r:
                names.setdefault(k, None)
    return names
