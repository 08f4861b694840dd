"""Arrow table -> batch: dispatch over the spec's nodes to each kind's decoder
(``format/codec/tensors.py``, ``format/codec/sequences.py``), conversion between the packed and padded
layouts, and the parallel fill of padded outputs.

The spec was checked against the file by ``format/file/validate.py`` before this runs. What the decoder
still finds inconsistent in the data (offsets, lengths, shapes, values of the wrong type) raises
``FormatError`` naming the file; what pyarrow raises is mapped the same way (``errors.foreign_errors``);
anything else is a bug of trajstore's and surfaces as itself.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from ...base.threads import run_parallel
from ...errors import ConfigError, FormatError
from ..batch import containers
from .. import limits
from .. import dtypes as dt
from . import sequences, tensors
from .. import typed
from ..arrow import Alloc, Columns
from .late import LateColumns
from ..batch.masks import padded_mask, span_mask
from ..spec import BatchNode, SeqNode, is_flat, is_token
from .fill_job import FillJob
from ..values import bits

__all__ = ["decode", "fill", "joined_first"]

_LAYOUT_KEYS = ("cu_seqlens", "max_seqlen", "attention_mask")  # replaced by a layout conversion


class Decoder:
    """Decodes one step's table along its spec; ``layout`` converts a dict batch to "padded" or
    "packed" (None: as stored)."""

    def __init__(self, cols: Columns, spec: BatchNode | SeqNode, layout: str | None,
                 defer: list | None = None) -> None:
        self.c, self.spec, self.layout, self.defer = cols, spec, layout, defer
        self.n: int = spec.get("B", 0)  # type: ignore[assignment]
        self._masks: dict = {}  # (T, side, lengths) -> [B, T] mask, shared by the padded fields
        self._jobs: list[FillJob] = []  # padded outputs still to fill
        self._spent = 0  # bytes of padded outputs and masks allocated so far (limits.MAX_DECODED_BYTES)

    def charge(self, nbytes: int, what: str) -> None:
        """Count a padded output (or mask) before it is allocated: over the decode limit, FormatError.
        ``validate.check`` bounded those the file describes; a layout conversion's are known here."""
        self._spent += nbytes
        if self._spent > limits.MAX_DECODED_BYTES:
            raise limits.over(self.c.where, self._spent, what)

    # -- dict batches
    def batch(self, keys: list[str] | None) -> Any:
        """The batch (its fields ``keys``, None: all), in the layout asked for."""
        spec: Any = self.spec
        if spec["t"] == "seq":
            if self.layout:
                raise ConfigError(f"{self.c.where}: layout conversion applies to dict batches, "
                                  "this step is a list of trajectories")
            return sequences.decode_seq(self.c, spec, self.c.table.num_rows, keys)
        chosen = [(k, n) for k, n in spec["keys"] if keys is None or k in keys]
        if spec["form"] == "masked":
            return self.masked(chosen)
        want = self.layout or spec["form"]
        if self.layout and spec["form"] not in ("padded", "packed"):
            raise ConfigError(
                f"{self.c.where}: layout={self.layout!r} needs a batch stored with attention_mask or "
                f"cu_seqlens; this one is {spec['form']!r}"
            )
        if want == "packed":  # every flat field joined in one parallel round
            self.c.join(_flat_columns(chosen))
        elif self.defer is not None:
            self.join_deferred(chosen)
        out = {}
        by = tensors.ones_source(spec) if want == "padded" else None
        for k, node in chosen:
            if want != spec["form"] and k in _LAYOUT_KEYS:
                continue
            if k == "attention_mask" and by is not None and not self.c.has(node["col"]) and self.c.has(by["col"]):
                # left out by the reader: its values are ones, its rows as long as ``by``'s
                o, jobs = tensors.mask_of_ones(self.c, node, by, self.n, spec["T"], spec["side"], self.mask,
                                               self.charge)
                self._jobs += jobs
                out[k] = o
                continue
            out[k] = self.field(node, want)
        if want != spec["form"]:
            lengths = self.lengths(chosen)
            if want == "packed":
                cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
                torch.cumsum(torch.as_tensor(lengths), 0, out=cu[1:])
                out["cu_seqlens"] = cu
                out["max_seqlen"] = int(max(lengths)) if len(lengths) else 0
            else:
                T = int(max(lengths)) if len(lengths) else 0
                self.charge(len(lengths) * T + 8 * T, f"the attention mask of [{len(lengths)}, {T}]")
                out["attention_mask"] = self.ones(np.asarray(lengths, dtype=np.int64), T)
        self.fill_padded()
        return out

    # -- several masks, or a span (docs/FORMAT.md 3.4)
    def masked(self, chosen: list) -> dict:
        """A masked batch: every field at its own padded width and sides (layout None or
        "padded"), or each mask group packed with its own ``<key>_cu_seqlens`` ("packed")."""
        groups: list = self.spec["masks"]  # type: ignore[typeddict-item]
        if self.layout != "packed":
            if self.defer is not None:
                self.join_deferred(chosen)
            out = {k: self.field(node, "padded") for k, node in chosen}
            self.fill_padded()
            return out
        drop = set(_LAYOUT_KEYS) | {g["src"] for g in groups if (g["key"] == "" or g["src"] != "attention_mask")
                                    and not g.get("holes")}  # a mask with holes is kept: it says which tokens count
        out, used = {}, set()
        for k, node in chosen:
            if k in drop:
                continue
            _mask_refs(node, used)
            out[k] = self.field(node, "packed")
        for i in sorted(used):
            key = groups[i]["key"]
            lengths = self.group_lengths(i)
            cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
            torch.cumsum(torch.as_tensor(lengths), 0, out=cu[1:])
            for name, v in (("cu_seqlens", cu), ("max_seqlen", int(max(lengths)) if len(lengths) else 0)):
                name = f"{key}_{name}" if key else name
                if name in out:
                    raise ConfigError(f"{self.c.where}: packing mask {groups[i]['src']!r} gives {name!r}, "
                                      "which is also a field of the batch; read it padded")
                out[name] = v
        return out

    def join_deferred(self, chosen: list) -> None:
        """Padded fields built elsewhere (``defer``): their token columns joined in one parallel
        round into the decode's memory (pinned staging: ``torch_bridge.Arena``), so the device
        copies their values from there (``device/plan.py``), as it does a packed batch's."""
        self.c.join([(n["col"], n["dtype"]) for n in _tensor_nodes(chosen) if is_token(n) and "pad_col" not in n
                     and n.get("axis") is None and self.c.has(n["col"])])

    def group_lengths(self, i: int) -> np.ndarray:
        """Tokens per row of mask group ``i``, from a token field of that group that was read."""
        for node in _tensor_nodes(self.spec["keys"]):  # type: ignore[typeddict-item]
            if node.get("mask") == i and is_token(node) and math.prod(node["trail"]) and self.c.has(node["col"]):
                off = self.c.offsets(node["col"], node["dtype"])
                return np.diff(off) // math.prod(node["trail"])
        raise ConfigError(f"{self.c.where}: packing needs a per-token field of mask "
                          f"{self.spec['masks'][i]['src']!r}; include one in columns")  # type: ignore[typeddict-item]

    def group_mask(self, i: int, lengths: np.ndarray, W: int) -> torch.Tensor:
        """The [B, W] mask of group ``i`` for a padded field: right/left by ``lengths``, or from the
        recorded starts (checked: each row's span lies within the width)."""
        g = self.spec["masks"][i]  # type: ignore[typeddict-item]
        if g["side"] != "span":
            return self.mask(lengths, W, g["side"])
        key = ("span", i, lengths.tobytes())
        m = self._masks.get(key)
        if m is None:
            starts = self.c.prim(g["start_col"], "int64")
            starts = np.asarray(starts, dtype=np.int64)
            if len(starts) != self.n or len(lengths) != self.n or bool((starts < 0).any()) \
                    or bool((starts + lengths > W).any()):
                raise FormatError(f"{self.c.where}: column {g['start_col']!r} puts rows of mask "
                                  f"{g['src']!r} outside its width {W}")
            m = self._masks[key] = span_mask(starts, lengths, W)
        return m

    def lengths(self, chosen: list) -> np.ndarray:
        """Tokens per row, for a layout conversion: from any per-token field that was read (the
        reader may leave out the attention_mask column when it converts a padded batch to
        packed), else from the stored ``cu_seqlens``."""
        for _, node in list(chosen) + list(self.spec["keys"]):  # type: ignore[typeddict-item]
            if is_token(node) and math.prod(node["trail"]) and self.c.has(node["col"]):
                off = self.c.offsets(node["col"], node["dtype"])
                return np.diff(off) // math.prod(node["trail"])
        cu = dict(self.spec["keys"]).get("cu_seqlens")  # type: ignore[typeddict-item]
        if cu is not None and cu.get("t") == "gtensor":
            return np.diff(np.asarray(tensors.decode_global(cu), dtype=np.int64))
        raise ConfigError(
            f"{self.c.where}: converting the layout needs a per-token field; include one in columns"
        )

    def field(self, node: Any, want: str) -> Any:
        """One field's value, its token fields in layout ``want``."""
        t = node["t"]
        if t == "json":
            return node["v"]
        if t == "gtensor":
            return tensors.decode_global(node)
        if t == "tvalue":
            return typed.decode(node["v"], self.c.where)
        if t == "group":
            return {k: self.field(n, want) for k, n in node["keys"]}
        if t == "seq":
            return sequences.decode_seq(self.c, node, self.n)
        if t == "segtensor":  # the same in every layout: not per-token
            return tensors.decode_segments(self.c, node, self.n)
        if t != "tensor":
            raise FormatError(f"{self.c.where}: unknown node type {t!r} in the spec")
        if node["kind"] == "sample":
            x = tensors.decode_sample(self.c, node, self.n)
            if "mask" in node and want == "packed":
                g = self.spec["masks"][node["mask"]]  # type: ignore[typeddict-item]
                if not node.get("tokenlike"):
                    raise ConfigError(f"{self.c.where}: mask {g['src']!r} has holes (not one run of "
                                      "tokens per row); read this step padded")
                mask = self.group_mask(node["mask"], self.group_lengths(node["mask"]), g["W"])
                b = bits(x if isinstance(x, np.ndarray) else x.contiguous())[mask].contiguous()
                return tensors.as_lib(b.view(tensors.alloc([0], node).dtype), node)
            if node.get("tokenlike") and want == "packed":
                mask = self.mask_from_rows()
                b = bits(x if isinstance(x, np.ndarray) else x.contiguous())[mask].contiguous()
                return tensors.as_lib(b.view(tensors.alloc([0], node).dtype), node)
            return x
        spec: Any = self.spec
        empty = not math.prod(node["trail"])  # a [N, 0, ...] field: its column cannot tell the lengths
        if "mask" in node and spec["form"] == "masked":
            i = node["mask"]
            if want == "packed":
                return tensors.decode_flat(self.c, node, self.n)
            W = spec["masks"][i]["W"]
            out, jobs = tensors.decode_padded(self.c, node, self.n, W, spec["masks"][i]["side"],
                                              lambda lengths, T, side: self.group_mask(i, lengths, T), self.charge)
            self._jobs += jobs
            return out
        if want == "packed":
            return tensors.decode_flat(self.c, node, self.n, int(self.lengths([]).sum()) if empty else 0)
        T = spec["T"] if spec["form"] == "padded" else None
        if T is None and empty:
            lengths = self.lengths([])
            T = int(lengths.max()) if len(lengths) else 0
        out, jobs = tensors.decode_padded(self.c, node, self.n, T, spec.get("side") or "right", self.mask,
                                          self.charge)
        self._jobs += jobs
        return out

    def ones(self, lengths: np.ndarray, T: int) -> torch.Tensor:
        """The attention mask of a packed batch read padded (right-aligned ``lengths``); with ``defer``
        a fill job of ones, so the caller's device builds it."""
        if self.defer is None or not T or not len(lengths):
            return torch.arange(T)[None, :] < torch.as_tensor(lengths)[:, None]
        off = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=off[1:])
        out = tensors.alloc([len(lengths), T], {"dtype": "bool"}, lazy=True)
        src = torch.ones(1, dtype=torch.uint8).expand(int(off[-1]))  # one value, repeated (stride 0)
        self._jobs.append(FillJob(out, self.mask(lengths, T, "right"), src, off, 0, 0, len(lengths), None,
                                  np.zeros(len(lengths), np.int64)))
        return out

    def mask(self, lengths: np.ndarray, T: int, side: str) -> torch.Tensor:
        """The [B, T] mask of ``lengths``, built once per step for every padded field alike."""
        key = (T, side, lengths.tobytes())
        m = self._masks.get(key)
        if m is None:
            m = self._masks[key] = padded_mask(lengths, T, side)
        return m

    def mask_from_rows(self) -> torch.Tensor:
        """The token mask of a padded batch, from the row lengths of a per-token field."""
        spec: Any = self.spec
        for _, node in spec["keys"]:
            if is_token(node) and math.prod(node["trail"]) and self.c.has(node["col"]):
                off = self.c.offsets(node["col"], node["dtype"])
                w = math.prod(node["trail"])
                return padded_mask(np.diff(off) // w, spec["T"], spec.get("side") or "right")
        raise ConfigError(f"{self.c.where}: cannot convert to packed without a per-token field")

    def fill_padded(self) -> None:
        """Fill every padded output (``fill``), or hand the fill jobs to ``defer`` (whoever asked for
        them fills the outputs, e.g. on a GPU: ``trajstore/device/pad.py``)."""
        jobs, self._jobs = self._jobs, []
        if self.defer is not None:
            self.defer += jobs
        else:
            fill(jobs)


def fill(jobs: list[FillJob]) -> None:
    """Fill padded outputs: pad value, then the row values (numpy boolean assignment in row-major
    order, as ``masked_scatter_`` but faster: benchmarks/RESULTS.md). Each output is split into row
    ranges, filled on the shared thread pool."""
    pieces, total = [], 0
    for out, mask, src, off, pad, r0, r1, pv, starts, _ in (j.unbits() for j in jobs):  # a bitmap: unpacked
        nbytes = out[r0:r1].numel() * out.element_size()
        total += nbytes
        k = max(1, min(r1 - r0, nbytes // (4 << 20)))
        bounds = np.linspace(r0, r1, k + 1).astype(np.int64)
        pieces += [(out, mask, src, off, pad, int(a), int(b), pv, starts)
                   for a, b in zip(bounds[:-1], bounds[1:]) if b > a]

    def one(job: tuple) -> None:
        out, mask, src, off, pad, a, b, pv, starts = job
        o = dt.bits_view(out[a:b]).numpy()  # numpy: one thread per job, no torch pool
        if mask is None:  # the rows' one run of tokens each, from their starts and lengths
            ar = np.arange(o.shape[1])
            s = np.asarray(starts[a:b], np.int64)[:, None]
            m = (ar >= s) & (ar < s + (np.diff(off[a:b + 1]) // max(1, math.prod(o.shape[2:])))[:, None])
        else:
            m = mask[a:b].numpy()
        mm = np.broadcast_to(m.reshape(m.shape + (1,) * (o.ndim - 2)), o.shape)
        if pv is None:
            o.fill(pad)
        else:  # the recorded padded values
            o[~mm] = pv[1][pv[0][a]:pv[0][b]].numpy()
        o[mm] = src[off[a]:off[b]].numpy()  # row-major order, as masked_scatter_

    run_parallel(one, pieces, total)


def _tensor_nodes(keys: list) -> list[dict]:
    """Every tensor node of a dict batch's fields, nested groups included."""
    out = []
    for _, node in keys:
        if node.get("t") == "group":
            out += _tensor_nodes(node["keys"])
        elif node.get("t") == "tensor":
            out.append(node)
    return out


def _mask_refs(node: dict, used: set) -> None:
    """The mask groups a field (and the fields nested in it) follows."""
    if node.get("t") == "group":
        for _, child in node["keys"]:
            _mask_refs(child, used)
    elif node.get("t") == "tensor" and "mask" in node:
        used.add(node["mask"])


def _late_columns(table: pa.Table, spec: Any, where: str, columns: list[str] | None, layout: str | None,
                  alloc: Alloc | None, defer: list | None, joined: dict | None, late: list, direct: Any = None) -> Columns:
    """The ``Columns`` of a decode for a GPU (``late``): a packed read's token columns, or a padded read's int64
    and bool token columns (``defer``), joined as stored where they can be (``format/codec/late.py``)."""
    chosen = [(k, n) for k, n in spec["keys"] if columns is None or k in columns] if spec.get("t") == "batch" else []
    if joined_first(spec, columns, layout):
        return LateColumns(table, where, alloc, joined, late, {n["col"] for _, n in chosen if is_token(n)}, direct)
    if defer is not None and chosen:
        only = {n["col"] for n in _tensor_nodes(chosen) if is_token(n) and "pad_col" not in n and n.get("axis") is None}
        return LateColumns(table, where, alloc, joined, late, only, direct)
    return Columns(table, where, alloc, joined, direct)


def _flat_columns(chosen: list) -> list[tuple[str, str]]:
    return [(n["col"], n["dtype"]) for _, n in chosen if is_flat(n)]


def joined_first(spec: Any, columns: list[str] | None, layout: str | None) -> list[tuple[str, str]]:
    """``[(column, dtype)]`` a decode of ``columns`` in ``layout`` joins before anything else (a dict
    batch read packed: every flat field), which a reader may join while it reads
    (``format/file/joining.py`` ``StreamJoin``); [] where the decode joins nothing up front."""
    if not isinstance(spec, dict) or spec.get("t") != "batch" or spec.get("form") not in ("padded", "packed"):
        return []
    if (layout or spec["form"]) != "packed":
        return []
    return _flat_columns([(k, n) for k, n in spec["keys"] if columns is None or k in columns])


def decode(table: pa.Table, spec: BatchNode | SeqNode, *, where: str, columns: list[str] | None = None,
           layout: str | None = None, alloc: Alloc | None = None, defer: list | None = None,
           joined: dict | None = None, late: list | None = None, direct: Any = None) -> Any:
    """Rebuild the batch from ``table`` (already restricted to the needed columns); ``alloc(n,
    numpy dtype)`` provides the buffers multi-chunk columns are joined into (see ``Columns``).
    ``defer``: a list the fill jobs of padded outputs are appended to, those outputs left unfilled
    (the caller fills them: ``fill``, or on a device). ``joined``: columns joined while the table
    was read (``StreamJoin.parts``). ``late``: a list the ``Late`` records of packed token fields joined as
    stored are appended to, their values left for the device to convert (``format/codec/late.py``; a padded
    read's int64 ids joined so are widened by the device's pad plan). ``direct``: see ``Columns``."""
    if layout not in (None, "padded", "packed"):
        raise ConfigError(f"layout must be 'padded', 'packed' or None, got {layout!r}")
    cols = Columns(table, where, alloc, joined, direct) if late is None else \
        _late_columns(table, spec, where, columns, layout, alloc, defer, joined, late, direct)
    cols.defer = defer  # a list batch's [g, T] groups too (format/codec/grouped.py)
    out = Decoder(cols, spec, layout, defer).batch(columns)
    return containers.wrap(out, spec.get("wrapper"), where=where, packed=layout == "packed")
