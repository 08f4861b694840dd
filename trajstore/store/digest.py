"""Per-trajectory digests of a step's token columns: the figures ``trajstore view``'s run page plots
(definitions in ``view/data.py``), computed by one set of functions both where a step is written (kept
in the column index, docs/FORMAT.md section 6, ``derived``) and where a step file is read, so a curve
drawn from the index is the curve drawn from the files, bit for bit.

A digest is named by what it is and the fields it is computed from, ``(what, (field, ...))``:

* ``("tokens", (f,))``: the trajectory's token count, the row length of per-token field ``f``;
  ``("tokens", ())``: that of the step's first per-token field (spec order), else its ``len_col``;
* ``("length", (mask,))``: the count of the trajectory's non-zero ``mask`` tokens;
* ``("version_max", (v,))`` / ``("version_min", (v,))``: the largest / smallest value of per-token
  field ``v`` over the trajectory's tokens (float64, NaN for none); ``(v, mask)``: over its non-zero
  ``mask`` tokens;
* ``("absdiff", (a, b[, mask]))`` and ``("absdiff_n", (a, b[, mask]))``: the float64 sum of
  ``|float64(a) - float64(b)|`` over the trajectory's (non-zero ``mask``) tokens, summed as
  ``numpy.add.reduceat`` sums a row, and the number of tokens summed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ..format.spec import is_dict_batch, is_token

MASKS = ("loss_mask", "response_mask", "completion_mask", "action_mask")
VERSIONS = ("versions", "version")
PAIRS = (("old_logprobs", "rollout_logprobs"), ("logprobs", "rollout_logprobs"),
         ("old_logprobs", "logprobs"), ("logprobs", "ref_logprobs"))
WHAT = {"tokens": "int64", "length": "int64", "version_max": "float64", "version_min": "float64",
        "absdiff": "float64", "absdiff_n": "int64"}


def fast(doc: dict) -> bool:
    """A step read column by column straight from its file (a padded, packed or plain dict batch)."""
    spec = doc.get("batch")
    if not (is_dict_batch(spec) and spec.get("form") in ("padded", "packed", "plain")):
        return False
    old = doc.get("format_version", 1) < 3  # bf16/fp16 were stored as their bits before version 3
    return not (old and any(isinstance(n, dict) and n.get("dtype") in ("bfloat16", "float16") for _, n in spec["keys"]))


def lists(a: Any) -> tuple[np.ndarray, np.ndarray]:
    """A list column's offsets (int64) and values (numpy)."""
    a = a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a
    return a.offsets.to_numpy().astype(np.int64), a.values.to_numpy(zero_copy_only=False)


def rows(a: Any) -> tuple[np.ndarray, np.ndarray]:
    """A list column's offsets from 0 and the values they cover (as ``view/data.py`` joins a step)."""
    offs, vals = lists(a)
    return offs - offs[0], vals[offs[0]:offs[-1]]


def seg(offs: np.ndarray, vals: np.ndarray, fn: Any, fill: float) -> np.ndarray:
    """``fn`` (np.minimum / np.maximum / np.add) over each row's values, as float64; ``fill`` for empty
    rows. Min and max run in the values' own dtype (no float copy of a step's tokens)."""
    out = np.full(len(offs) - 1, fill, dtype=np.float64)
    lens = np.diff(offs)
    ne = lens > 0
    if ne.any():
        v = vals[offs[0]:offs[-1]]
        if fn is np.add and v.dtype.kind != "f":
            v = v.astype(np.int64)
        out[ne] = fn.reduceat(v, (offs[:-1] - offs[0])[ne])
    return out


# tokens per block of the row-wise passes below: a block's temporaries stay bounded (tens of MB) while a
# step's digests take a few numpy calls, each giving up the GIL once, which a writer worker waits to take back
# (the default step: ~160 hand-offs with 2^18-token blocks, ~25 with 2^22, the same time alone; RESULTS.md)
BLOCK = 1 << 22


def _blocks(offs: np.ndarray) -> Any:
    """``(first, end)`` row ranges of whole rows holding about ``BLOCK`` tokens each (a row's result
    depends on its own tokens only, so blocks change no value, only the memory touched)."""
    n, i = len(offs) - 1, 0
    while i < n:
        j = min(max(int(np.searchsorted(offs, offs[i] + BLOCK, side="right")) - 1, i + 1), n)
        yield i, j
        i = j


def count(offs: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The true values of each row of the bool tokens ``m`` (float64)."""
    out = np.zeros(len(offs) - 1, dtype=np.float64)
    for i, j in _blocks(offs):
        o = offs[i:j + 1]
        out[i:j] = np.diff(np.searchsorted(np.flatnonzero(m[o[0]:o[-1]]), o - o[0]))
    return out


def keep_of(m: np.ndarray) -> np.ndarray:
    return m if m.dtype == bool else m != 0


def extremes(offs: np.ndarray, v: np.ndarray, keep: np.ndarray | None,
             n: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Max and min of each row's values where ``keep`` (NaN for a row with none); ``n``: ``count(offs, keep)``
    where the caller has it. The kept values of a block are taken out once and reduced row by row."""
    if keep is None:
        n = np.diff(offs).astype(np.float64)
        hi, lo = seg(offs, v, np.maximum, np.nan), seg(offs, v, np.minimum, np.nan)
    else:
        n = count(offs, keep) if n is None else n
        hi, lo = np.empty(len(n)), np.empty(len(n))
        for i, j in _blocks(offs):
            o = offs[i:j + 1]
            kept, r = v[o[0]:o[-1]][keep[o[0]:o[-1]]], np.zeros(j - i + 1, np.int64)
            np.cumsum(n[i:j].astype(np.int64), out=r[1:])  # each row's kept values, in order
            hi[i:j], lo[i:j] = seg(r, kept, np.maximum, np.nan), seg(r, kept, np.minimum, np.nan)
    hi[n == 0] = np.nan
    lo[n == 0] = np.nan
    return hi, lo


def absdiff(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray],
            mask: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """Per row: the sum of ``|float64(a) - float64(b)|`` (float64, ``numpy.add.reduceat`` of the row)
    and the tokens summed (float64), over the tokens of ``mask`` where its rows are as long as
    ``a``'s; and whether the mask was applied. None when ``a`` and ``b`` have rows of different lengths."""
    (oa, va), (ob, vb) = a, b
    lens = np.diff(oa)
    if not np.array_equal(lens, np.diff(ob)):
        return None
    used = mask is not None and np.array_equal(np.diff(mask[0]), lens)
    sums, cnt = np.zeros(len(lens)), lens.astype(np.float64)
    for i, j in _blocks(oa):
        r = oa[i:j + 1] - oa[i]
        with np.errstate(all="ignore"):  # inf - inf: NaN, as intended
            d = np.subtract(va[oa[i]:oa[j]], vb[ob[i]:ob[j]], dtype=np.float64)  # each side as float64 first
            np.abs(d, out=d)
        if used:
            kk = keep_of(mask[1][mask[0][i]:mask[0][j]])
            np.copyto(d, 0.0, where=~kk)
            cnt[i:j] = count(r, kk)
        sums[i:j] = seg(r, d, np.add, 0.0)
    return sums, cnt, used


def derive(doc: dict, table: pa.Table) -> dict[tuple, np.ndarray]:
    """The digests of one encoded step (``doc``: its ``trajstore`` metadata) for the fields the run
    page picks by default (the first of ``MASKS`` and of ``VERSIONS``, every pair of ``PAIRS``);
    empty for a step the page does not read column by column. One array (one value per trajectory) each."""
    if not fast(doc):
        return {}
    keys = doc["batch"]["keys"]
    toks = {k: n for k, n in keys if is_token(n) and n.get("trail") == []}
    mask = next((m for m in MASKS if m in toks), None)
    ver = next((v for v in VERSIONS if v in toks), None)
    pairs = [p for p in PAIRS if p[0] in toks and p[1] in toks]
    col = {k: rows(table.column(toks[k]["col"])) for k in {mask, ver, *(x for p in pairs for x in p)} - {None}}
    out: dict[tuple, np.ndarray] = {}
    first = next((k for k in [mask, ver, *(pairs[0] if pairs else ())] if k), None)
    if first is not None:
        out[("tokens", (first,))] = np.diff(col[first][0])
    else:
        anyt = next((n for _, n in keys if is_token(n)), None)
        len_col = doc["batch"].get("len_col")
        if anyt is not None:
            out[("tokens", ())] = np.diff(lists(table.column(anyt["col"]))[0])
        elif len_col:
            out[("tokens", ())] = table.column(len_col).to_numpy().astype(np.int64)
        else:
            out[("tokens", ())] = np.zeros(table.num_rows, np.int64)
    keep = kept = None
    if mask is not None:
        keep = keep_of(col[mask][1])
        kept = count(col[mask][0], keep)
        out[("length", (mask,))] = kept.astype(np.int64)
    if ver is not None:
        (offs, v), ok = col[ver], keep is not None and np.array_equal(col[ver][0], col[mask][0])
        if ok or mask is None:  # a mask of other row lengths: left to the files
            by = (ver, mask) if ok else (ver,)
            out[("version_max", by)], out[("version_min", by)] = extremes(offs, v, keep if ok else None,
                                                                          kept if ok else None)
    for a, b in pairs:
        got = absdiff(col[a], col[b], col[mask] if mask else None)
        if got is not None and (got[2] or mask is None):
            by = (a, b, mask) if mask else (a, b)
            out[("absdiff", by)], out[("absdiff_n", by)] = got[0], got[1].astype(np.int64)
    return out
