"""Tensor fields of a dict batch, encode and decode side by side (docs/FORMAT.md 3.3, 3.4, 3.7):

* ``gtensor``: an unbatched tensor (0-d, or ``cu_seqlens``), inline in the spec as base64;
* ``tensor`` kind ``sample``: one fixed-shape entry per trajectory (``tokenlike``: a ``[B, T, 0...]``
  field of a padded batch, stored whole);
* ``tensor`` kind ``token``: one entry per token, each row holding its trajectory's tokens; in a
  padded batch the padded positions hold one recorded ``pad`` value, or their own values in the
  ``pad_col`` column;
* ``segtensor``: a tensor whose leading dimension is cut into one run of rows per trajectory by
  ``counts`` (TRL/Qwen-VL ``pixel_values``, split by ``integrations.trl``; format version 3).

Decoding a token field padded allocates the output and returns the fill jobs; the decoder runs
them, every padded field at once, on the thread pool (``format/codec/decoder.py``).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from ...errors import FormatError
from .. import dtypes as dt
from ..arrow import Columns, TableBuilder, list_array
from ..numpy_view import empty
from .fill_job import FillJob
from ..batch.check import FLAT, GLOBAL, SEGMENTS, TOKENS, Tensor
from ..batch.layout import Layout
from ..batch.masks import MaskGroup, Selection, channel_major
from ..limits import padded_bytes
from ..spec import PAD_PREFIX, GTensorNode, SegTensorNode, TensorNode
from ..values import as_cpu, bits, describe, dumps, storage

__all__ = ["encode", "encode_selected", "decode_global", "decode_sample", "decode_flat", "decode_padded",
           "decode_segments", "FillJob", "as_lib", "alloc"]


# ----------------------------------------------------------------------------- encode
def encode(enc: TableBuilder, lay: Layout, f: Tensor, value: Any = None) -> TensorNode | GTensorNode | SegTensorNode:
    """The spec node of tensor field ``f`` (classified by ``format.check``; its values ``value`` where
    given, else ``f.value``); its columns go to ``enc``."""
    lib, name, x = as_cpu(f.value if value is None else value, f.path)
    if f.role == SEGMENTS:
        return _encode_segments(enc, f, lib, name, x)
    if f.role == GLOBAL:
        raw = np.ascontiguousarray(storage(x)).reshape(-1)
        g: Any = {"t": "gtensor", "lib": lib, "dtype": name, "shape": list(x.shape),
                  "data": base64.b64encode(raw.tobytes()).decode()}
        if lay.form == "packed" and f.path == ("cu_seqlens",):
            _encode_ends(enc, g, raw)
        return g
    node: Any = {"t": "tensor", "col": f.col, "lib": lib, "dtype": name}
    B = lay.B
    g = lay.groups[f.group] if f.role == TOKENS else None
    if f.last and g is not None:  # [B, C..., W]: each row's [C..., n] block (format version 3)
        if g.side is None or not math.prod(x.shape[1:-1]):  # holes, or nothing per token: stored whole
            return _encode_sample(enc, node, f.path, x, B)
        x = np.ascontiguousarray(np.moveaxis(x, -1, 1)) if isinstance(x, np.ndarray) else x.movedim(-1, 1).contiguous()
        node["axis"] = "last"  # x is now token-major: _encode_token / _encode_padvals store it channel-major
        enc.needs(3)
    if g is not None and lay.form == "masked":
        node["mask"] = f.group
    if g is not None and g.side:
        xt = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
        sel = _selection(enc, g)
        pad = None
        if sel.padded is not None:
            # every padded element must hold the bits of the first one: compared in place, without
            # extracting the padded region (which is most of a long-tail batch)
            b, w = bits(x), math.prod(x.shape[2:])
            if not w:
                return _encode_sample(enc, node, f.path, x, B, tokenlike=True)
            p = b.reshape(-1)[sel.first * w]
            if _is_mask(xt, g):  # the group's own bool mask: False wherever it pads
                pad = 0
            elif sel.differ(b, p):
                # padded positions hold different values (e.g. -0.0 and 0.0, or garbage computed
                # past the end): keep them, unpadded tokens stay a token column
                _encode_padvals(enc, node, f.path, xt[sel.padded] if lib == "torch" else xt[sel.padded].numpy(), B,
                                g.W - g.lengths, w)
            else:
                pad = int(p)
        return _encode_token(enc, node, f.path, sel.take(xt), g.lengths, list(x.shape[2:]), pad, lib)
    if f.role == FLAT:
        xt = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
        return _encode_token(enc, node, f.path, xt, lay.lengths, list(x.shape[1:]), None, lib)
    return _encode_sample(enc, node, f.path, x, B)


def encode_selected(enc: TableBuilder, lay: Layout, f: Tensor, values: Any, padvals: Any, pad: int | None,
                    w: int) -> TensorNode:
    """``encode``'s node and columns of a token field (not ``last``) of a group with a side, from its
    tokens already selected (``x[mask]``, ``w`` elements each) and ``padvals`` (``x[~mask]``, padded
    positions not one value) or ``pad`` (their one value's bits); ``format/codec/unpadded.py``."""
    g = lay.groups[f.group]
    lib, name = describe(f.value, f.path)
    node: Any = {"t": "tensor", "col": f.col, "lib": lib, "dtype": name}
    if lay.form == "masked":
        node["mask"] = f.group
    if padvals is not None:
        _encode_padvals(enc, node, f.path, padvals, lay.B, g.W - g.lengths, w)
    return _encode_token(enc, node, f.path, values, g.lengths, list(f.value.shape[2:]), pad, lib)


def _selection(enc: TableBuilder, g: MaskGroup) -> Selection:
    sel = enc.memo.get(("selection", g.key, g.src, g.lo))
    if sel is None:
        sel = enc.memo[("selection", g.key, g.src, g.lo)] = Selection(g.mask, g.side, g.lengths, g.starts)
    return sel


def _is_mask(x: torch.Tensor, g: MaskGroup) -> bool:
    """Whether ``x`` is the memory of group ``g``'s bool token mask itself (a plain ``[B, T]`` bool
    ``attention_mask``, whose padded positions are False by definition)."""
    m = g.mask
    return (m is not None and x.dtype == torch.bool and m.dtype == torch.bool and x.data_ptr() == m.data_ptr()
            and x.shape == m.shape and x.stride() == m.stride())


def _encode_segments(enc: TableBuilder, f: Tensor, lib: str, name: str, x: Any) -> SegTensorNode:
    """Row *i* holds rows ``sum(counts[:i]) ..`` of the leading dimension, flattened: the whole
    tensor's values cut at the trajectories' boundaries (no copy). Older readers refuse the node."""
    assert f.counts is not None  # plan(read=True) counted them
    enc.needs(3)
    trail = list(x.shape[1:])
    offsets = np.zeros(len(f.counts) + 1, dtype=np.int64)
    np.cumsum(np.asarray(f.counts, dtype=np.int64) * math.prod(trail), out=offsets[1:])
    enc.add(f.col, list_array(offsets, storage(x).reshape(-1)),
            {"dtype": name, "kind": "segment", "shape": dumps(["r"] + trail)}, f.path)
    return {"t": "segtensor", "col": f.col, "lib": lib, "dtype": name, "trail": trail,  # type: ignore[typeddict-item]
            "counts": list(f.counts)}


def _encode_ends(enc: TableBuilder, node: dict, raw: np.ndarray) -> None:
    """A packed step's ``cu_seqlens`` also as a plain column of its own name and dtype, row *i*
    holding ``cu_seqlens[i + 1]``: where trajectory *i*'s tokens end (docs/FORMAT.md 3.7). For
    readers without trajstore; trajstore decodes the inline tensor."""
    node["col"] = "cu_seqlens"
    enc.names.claim(node["col"], ("cu_seqlens",))
    enc.add(node["col"], pa.array(raw[1:]), {"dtype": node["dtype"], "kind": "cu_seqlens"}, ("cu_seqlens",))


def _encode_padvals(enc: TableBuilder, node: dict, path: tuple, padvals: Any, B: int, npad: torch.Tensor,
                    w: int) -> None:
    """The values ``padvals`` at padded positions, row by row in position order: column ``__pad__<col>``."""
    values = _stored_order(node, storage(padvals).reshape(-1), npad, w)
    offsets = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(np.asarray(npad, dtype=np.int64) * w, out=offsets[1:])
    node["pad_col"] = PAD_PREFIX + node["col"]
    enc.names.claim(node["pad_col"], path, companion=True)
    enc.add(node["pad_col"], list_array(offsets, values), {"dtype": node["dtype"], "kind": "pad"}, path)


def _encode_token(enc: TableBuilder, node: dict, path: tuple, vals: Any, lengths: Any, trail: list[int],
                  pad: int | None, lib: str) -> TensorNode:
    width = math.prod(trail)
    if isinstance(vals, torch.Tensor) and lib != "torch":
        vals = vals.numpy()
    values = _stored_order(node, storage(vals).reshape(-1), lengths, width)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64) * width, out=offsets[1:])
    node.update(kind="token", trail=trail, pad=pad)
    enc.add(node["col"], list_array(offsets, values),
            {"dtype": node["dtype"], "kind": "token", "shape": dumps(["n"] + trail)}, path)
    return node


def _stored_order(node: dict, values: np.ndarray, lengths: Any, w: int) -> np.ndarray:
    """Token-major values as stored: unchanged, or each row's ``[C..., n]`` block for a field
    whose token axis is last (``masks.channel_major``)."""
    if node.get("axis") != "last":
        return values
    out = np.empty_like(values)
    out[channel_major(lengths, w)] = values
    return out


def _encode_sample(enc: TableBuilder, node: dict, path: tuple, x: Any, B: int, tokenlike: bool = False) -> TensorNode:
    trail = list(x.shape[1:])
    values = storage(x)
    node.update(kind="sample", trail=trail)
    if tokenlike:
        node["tokenlike"] = True
    if not trail:
        arr = pa.array(values)
    else:
        w = math.prod(trail)
        arr = list_array(np.arange(B + 1, dtype=np.int64) * w, values.reshape(-1))
    enc.add(node["col"], arr, {"dtype": node["dtype"], "kind": "sample", "shape": dumps(trail)}, path)
    return node


# ----------------------------------------------------------------------------- decode
def as_lib(t: torch.Tensor, node: dict) -> Any:
    """A decoded tensor as the library the node names (a numpy view for numpy fields)."""
    return t if node["lib"] == "torch" else t.numpy()


def alloc(shape: list[int], node: dict, lazy: bool = False) -> torch.Tensor:
    """An uninitialized output of ``shape`` and the node's dtype, from Arrow's allocator (``empty``):
    a padded output is filled faster there than in ``np.empty`` or ``torch.empty``
    (benchmarks/RESULTS.md). ``lazy``: one the caller fills elsewhere (a GPU), most likely never
    touched here: ``np.empty``, whose untouched pages cost nothing."""
    if lazy:
        a = np.empty(shape, dt.storage_numpy(node["dtype"]))
    else:
        a = empty(math.prod(shape), dt.storage_numpy(node["dtype"])).reshape(shape)
    return dt.from_storage(a, node["dtype"])


def decode_global(node: GTensorNode) -> Any:
    """An inline tensor (``validate`` checked that its data is base64 of its shape and dtype)."""
    raw = base64.b64decode(node["data"], validate=True)
    a = np.frombuffer(raw, dtype=dt.storage_numpy(node["dtype"])).copy().reshape(node["shape"])
    return dt.as_value(a, node)


def decode_sample(cols: Columns, node: TensorNode, n: int) -> Any:
    """A sample field as stored: ``[n, *trail]``."""
    if not node["trail"]:
        return dt.as_value(cols.prim(node["col"], node["dtype"]), node)
    _, v = cols.list_parts(node["col"], node["dtype"])
    if len(v) != n * math.prod(node["trail"]):
        raise FormatError(f"{cols.where}: column {node['col']!r} holds {len(v)} values, "
                          f"not {n} rows of {node['trail']}")
    return dt.as_value(v, node).reshape([n] + node["trail"])


def decode_flat(cols: Columns, node: TensorNode, n: int, tokens: int = 0) -> Any:
    """A token field packed: every row's tokens in one ``[N, *trail]`` tensor. ``tokens`` is N for
    a field of zero width (its column holds no values, so it cannot tell N)."""
    trail = node["trail"]
    w = math.prod(trail)
    whole = node.get("axis") != "last"  # the values used as they are (a GPU read may convert them there)
    off, v = (cols.flat_parts if whole else cols.list_parts)(node["col"], node["dtype"])
    if len(off) != n + 1 or (len(v) and int(off[-1]) - int(off[0]) != len(v)) or (len(v) % w if w else len(v)):
        raise FormatError(f"{cols.where}: column {node['col']!r} has inconsistent offsets")
    if whole:
        return dt.as_value(v, node).reshape([-1 if w else tokens] + trail)
    rows = np.diff(off)
    if bool((rows % w).any()):
        raise FormatError(f"{cols.where}: column {node['col']!r} rows are not whole tokens of {trail}")
    x = dt.as_value(v[channel_major(rows // w, w)], node).reshape([-1] + trail)  # token-major
    return np.ascontiguousarray(np.moveaxis(x, 0, -1)) if isinstance(x, np.ndarray) else x.movedim(0, -1).contiguous()


def decode_segments(cols: Columns, node: SegTensorNode, n: int) -> Any:
    """A segmented field: its rows joined, ``[sum(counts), *trail]``; each row's values MUST be its
    ``counts[i]`` rows of ``trail``."""
    trail, counts = node["trail"], np.asarray(node["counts"], dtype=np.int64)
    off, v = cols.list_parts(node["col"], node["dtype"])
    want = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts * math.prod(trail), out=want[1:])
    if len(counts) != n or len(off) != n + 1 or not np.array_equal(off - off[0], want) or len(v) != want[-1]:
        raise FormatError(f"{cols.where}: column {node['col']!r} does not hold the rows its counts give")
    return dt.as_value(v, node).reshape([int(counts.sum())] + trail)


def decode_padded(cols: Columns, node: TensorNode, n: int, T: int | None, side: str,
                  mask_for: Callable[[np.ndarray, int, str], torch.Tensor],
                  charge: Callable[[int, str], None] | None = None) -> tuple[Any, list[FillJob]]:
    """A token field padded to ``[n, T, *trail]`` (``T`` None: the longest row): the output, still
    unfilled, and its fill jobs, scattered straight from each row group's values (no joined copy;
    one job of the joined values where the column was joined: ``decoder.Decoder.join_deferred``).
    ``charge(nbytes, what)`` is told what the output and its mask take before they are allocated."""
    trail = node["trail"]
    w = max(1, math.prod(trail))
    got = None if "pad_col" in node else cols.joined(node["col"], node["dtype"])  # joined: one job
    shift = -1 if got is None else cols.bitmap(node["col"])  # a bitmap: unpacked as it is placed (w == 1)
    if shift >= 0 and (math.prod(trail) != 1 or node.get("axis") == "last"):
        got, shift = cols.list_parts(node["col"], node["dtype"]), -1  # (converted on the host: codec/late.py)
    off, parts = (got[0], [(0, got[1])]) if got is not None else cols.chunks(node["col"], node["dtype"])
    rows = np.diff(off)
    if len(off) != n + 1 or bool((rows < 0).any()):
        raise FormatError(f"{cols.where}: column {node['col']!r} has inconsistent offsets")
    lengths = rows // w if w != 1 else rows
    if (w != 1 and bool((rows % w).any())) or (not math.prod(trail) and bool(rows.any())):
        raise FormatError(f"{cols.where}: column {node['col']!r} rows are not whole tokens of {trail}")
    longest = int(lengths.max()) if len(lengths) else 0
    T = longest if T is None else T
    if longest > T:
        raise FormatError(f"{cols.where}: column {node['col']!r} has a row of {longest} "
                          f"tokens, longer than the padded length {T}")
    if charge is not None:  # the output, its [n, T] bool mask and the mask's arange(T)
        charge(padded_bytes(n, T, math.prod(trail) * dt.storage_numpy(node["dtype"]).itemsize),
               f"field {node['col']!r} padded to [{n}, {T}]")
    starts = _starts(lengths, T, side)
    # deferred with known starts: no [n, T] mask (``decoder.fill`` builds the rows it fills from the starts)
    mask = None if cols.defer is not None and starts is not None else mask_for(lengths, T, side)
    last = node.get("axis") == "last"
    if last:  # [n, *trail, T], filled through its [n, T, *trail] view
        full = alloc([n] + trail + [T], node, cols.defer is not None)
        out = full.movedim(-1, 1)
    else:
        full = out = alloc([n, T] + trail, node, cols.defer is not None)
    pads = _padvals(cols, node, n, lengths, T, w, parts)
    jobs = []
    narrow = got is not None and got[1].dtype == np.int32 and node["dtype"] == "int64"  # codec/late.py: widened
    for i, ((r0, v), r1) in enumerate(zip(parts, [r for r, _ in parts[1:]] + [n])):  # where placed (device/plan.py)
        if narrow or shift >= 0:
            src = torch.from_numpy(v).reshape(-1)
        else:
            x = dt.as_value(v, node)
            src = bits(x if isinstance(x, np.ndarray) else x.contiguous()).reshape(-1)
        if last:  # each row's [C..., n] block -> token-major
            if cols.direct is not None:  # (read here: copied back from where they were taken to send)
                cols.direct.ready_for(v)
            src = src[torch.from_numpy(channel_major(lengths[r0:r1], w))]
        pv = None if pads is None else (pads[0] - pads[0][r0], pads[1][i])
        if pv is not None and last:
            pv = (pv[0], pv[1][torch.from_numpy(channel_major((T - lengths)[r0:r1], w))])
        jobs.append(FillJob(out, mask, src, off - off[r0], node.get("pad") or 0, r0, r1, pv, starts, shift))
    return as_lib(full, node), jobs


def _starts(lengths: np.ndarray, T: int, side: str) -> np.ndarray | None:
    """Each row's first valid position under a right or left padded mask (None for another side)."""
    if side == "right":
        return np.zeros(len(lengths), np.int64)
    if side == "left":
        return T - np.asarray(lengths, np.int64)
    return None


def ones_source(spec: Any) -> TensorNode | None:
    """For a padded dict batch (side right or left) whose ``attention_mask`` is a plain token field:
    the first other token field with values per token (``mask_of_ones`` takes the rows' lengths
    from its column), else None (the mask is decoded from its own column)."""
    if not isinstance(spec, dict) or spec.get("t") != "batch" or spec.get("form") != "padded" \
            or spec.get("side") not in ("right", "left"):
        return None
    keys = dict(spec["keys"])
    m = keys.get("attention_mask")
    if not (isinstance(m, dict) and m.get("t") == "tensor" and m.get("kind") == "token" and m.get("trail") == []
            and "pad_col" not in m and "axis" not in m):
        return None
    return next((n for k, n in spec["keys"] if k != "attention_mask" and isinstance(n, dict) and n.get("t") == "tensor"
                 and n.get("kind") == "token" and n.get("axis") is None and math.prod(n.get("trail") or [1])
                 and n.get("col") != m.get("col")), None)


def mask_of_ones(cols: Columns, node: TensorNode, by: TensorNode, n: int, T: int, side: str,
                 mask_for: Callable[[np.ndarray, int, str], torch.Tensor],
                 charge: Callable[[int, str], None] | None = None) -> tuple[Any, list[FillJob]]:
    """The ``attention_mask`` token field of a padded batch (side right or left), without its
    column: its values on the valid tokens are 1 (docs/FORMAT.md 3.4: a mask is 0/1 and a token is
    valid where it is non-zero), its rows as long as those of token field ``by`` (whose column is
    read). The output as ``decode_padded`` gives it, filled from one repeated value."""
    col = by["col"]
    w = math.prod(by["trail"])
    off = cols.offsets(col, by["dtype"])
    rows = np.diff(off)
    if len(off) != n + 1 or bool((rows < 0).any()) or bool((rows % w).any()):
        raise FormatError(f"{cols.where}: column {col!r} has inconsistent offsets")
    lengths = rows // w
    if len(lengths) and int(lengths.max()) > T:
        raise FormatError(f"{cols.where}: column {col!r} has a row of {int(lengths.max())} "
                          f"tokens, longer than the padded length {T}")
    if charge is not None:
        charge(n * T * (dt.storage_numpy(node["dtype"]).itemsize + 1) + 8 * T,
               f"field {node['col']!r} padded to [{n}, {T}]")
    starts = _starts(lengths, T, side)
    mask = None if cols.defer is not None else mask_for(lengths, T, side)
    out = alloc([n, T], node, cols.defer is not None)
    one = alloc([1], node).fill_(1)
    src = bits(one).reshape(-1).expand(int(lengths.sum()))  # one value, repeated (stride 0)
    toks = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=toks[1:])
    return as_lib(out, node), [FillJob(out, mask, src, toks, node.get("pad") or 0, 0, n, None, starts)]


def _padvals(cols: Columns, node: TensorNode, n: int, lengths: np.ndarray, T: int, w: int,
             parts: list) -> tuple[np.ndarray, list[torch.Tensor]] | None:
    """Offsets and per-chunk bits of the ``pad_col`` values, checked against the lengths."""
    if "pad_col" not in node:
        return None
    poff, pparts = cols.chunks(node["pad_col"], node["dtype"])
    if len(poff) != n + 1 or not np.array_equal(np.diff(poff), (T - lengths) * w):
        raise FormatError(f"{cols.where}: column {node['pad_col']!r} does not hold the padded positions of {node['col']!r}")
    if [r for r, _ in pparts] != [r for r, _ in parts]:  # chunked apart (shards' slices joined): cut as the values
        every = np.concatenate([v for _, v in pparts]) if pparts else parts[0][1][:0]  # (no chunk: no rows)
        pparts = [(r0, every[poff[r0]:poff[r1]]) for (r0, _), r1 in zip(parts, [r for r, _ in parts[1:]] + [n])]
    return poff, [bits(dt.as_value(v, node) if node["lib"] != "torch" else dt.as_value(v, node).contiguous()
                       ).reshape(-1) for _, v in pparts]
