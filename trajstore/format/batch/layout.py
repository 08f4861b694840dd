"""What a dict batch *is*, decided once (docs/FORMAT.md section 3.4): ``structure(batch)`` answers every
question of the batch's structure in one place and hands the answers on as a ``Layout``, which the
per-field checks (``check``) and the encoder (``format/codec/encoder.py``) consume without asking
again: the form (padded by ``attention_mask``, masked by several masks or a two-sided one, packed by
``cu_seqlens``, or plain), the mask groups per-token fields follow (``MaskGroup``), and which tensor
field follows which group or is per sample (``Layout.follows``: a ``Follow`` per field path).

From names, dtypes and shapes alone (what ``Writer.append`` may look at); with ``read`` also from the
values: a packed batch's ``cu_seqlens`` (``N``, row lengths) and each mask's sides and lengths (which
turns a padded batch into a masked one when a mask is a span or there are several). What the values
or a field's shape show is an error the walk raises in its turn (``Layout.error``, ``Follow.error``),
so a batch gives the same first error whatever is read. The masks' geometry is ``masks``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...errors import BatchError
from ..limits import MAX_SPEC_DEPTH
from ..spec import where
from ..values import as_cpu, describe, is_tensorlike
from .masks import MaskGroup, classify, extent, token_mask

__all__ = ["Layout", "MaskGroup", "Follow", "structure", "batch_size", "length_error",
           "PER_TRAJECTORY", "GLOBAL", "TOKENS", "FLAT", "SAMPLE", "SEGMENTS"]

# docs/FORMAT.md 3.4: in a packed batch with as many tokens as trajectories (N == B), fields of these
# names stay per-trajectory (every other field of leading size N is per-token)
PER_TRAJECTORY = ("rewards", "reward", "scores", "score", "seq_len", "seq_lens", "seqlen", "seqlens")

# what a tensor field becomes
GLOBAL = "global"  # 0-d, or a packed batch's cu_seqlens: inline in the spec (gtensor)
TOKENS = "tokens"  # [B, W, ...] following a mask group: a token column, or stored whole where the mask has holes
FLAT = "flat"  # leading dimension N of a packed batch: a token column
SAMPLE = "sample"  # leading dimension B: a sample column
SEGMENTS = "segments"  # rows of the leading dimension per trajectory given by counts (segtensor, version 3)

_CU_SEQLENS = "field 'cu_seqlens': must be a non-empty 1-D integer tensor starting at 0 and non-decreasing"

# names of fields that are per-token in every framework trajstore knows (input_ids, loss_mask,
# old_logprobs, old_per_token_logps, position_ids, labels, versions, advantages...): stored per sample
# because their width is not the attention mask's, they are probably a mistake (BatchWarning)
_TOKENISH = re.compile(r"(^|_)(ids|mask|masks|logprobs|log_probs|logps|labels|versions?|advantages|returns|tokens)$")


@dataclass(frozen=True)
class Follow:
    """What one tensor field of a dict batch is: its ``role`` (``TOKENS`` with the index of the mask
    ``group`` it follows, its token axis ``last`` or not; ``FLAT``; ``SAMPLE``, ``suspect`` when named
    like a per-token field of another width than ``attention_mask``; None: a packed batch's ``N`` is
    not read yet), or the ``error`` its shape is (raised by the walk when it comes to the field)."""

    role: str | None
    group: int | None = None
    last: bool = False
    suspect: bool = False
    error: BatchError | None = None


@dataclass(frozen=True, eq=False)
class Layout:
    """The structure of a dict batch, decided once by ``structure``: ``form``, ``B`` and ``T``; the
    mask ``groups`` and the fields ``declared`` to follow them; what each tensor field is
    (``follows``, by path). Where values were read: ``N`` and ``lengths`` of a packed batch; ``side``,
    ``mask`` and ``lengths`` of the attention mask (``side`` None: holes) and each group's; ``error``,
    what the values showed (raised after every field is checked)."""

    form: str  # "padded", "masked", "packed" or "plain"
    B: int
    T: int | None = None  # padded
    cu_seqlens: Any = None  # packed: the batch's value
    attention_mask: Any = None  # padded: the batch's value
    N: int | None = None  # packed: cu_seqlens[-1]
    side: str | None = None  # padded: "right", "left", "span", or None (holes: [B, T] fields stored whole)
    mask: torch.Tensor | None = None  # padded, side known: the [B, T] token mask
    lengths: torch.Tensor | None = None  # tokens per row
    groups: tuple[MaskGroup, ...] = ()  # padded / masked: the masks fields follow
    declared: Mapping[str, int] = field(default_factory=dict)  # field name -> group, from the user
    follows: Mapping[tuple, Follow] = field(default_factory=dict)  # tensor field path -> what it is
    error: BatchError | None = None


@dataclass
class _Draft:
    """A layout while ``structure`` builds it."""

    form: str
    B: int
    T: int | None = None
    groups: list[MaskGroup] = field(default_factory=list)
    declared: dict[str, int] = field(default_factory=dict)
    N: int | None = None


def batch_size(batch: Mapping) -> int | None:
    """A plain dict's batch size: the leading size of the first tensor or list found, depth first."""
    for v in batch.values():
        if isinstance(v, torch.Tensor | np.ndarray) and v.ndim >= 1:
            return int(v.shape[0])
        if isinstance(v, list | tuple):
            return len(v)
        if isinstance(v, Mapping):
            n = batch_size(v)
            if n is not None:
                return n
    return None


def _is_mask(v: Any, B: int) -> bool:
    return is_tensorlike(v) and np.ndim(v) >= 2 and int(v.shape[0]) == B


def _add(lay: _Draft, g: MaskGroup) -> int:
    keys = {x.key for x in lay.groups}
    base, i = g.key, 2
    while g.key in keys:
        g.key, i = f"{base}_{i}", i + 1
    lay.groups.append(g)
    return len(lay.groups) - 1


def _infer_groups(batch: Mapping, lay: _Draft, masks: Mapping[str, Any]) -> None:
    """The mask groups of docs/FORMAT.md section 3.4: verl's prompt / response parts of
    ``attention_mask``, ``X_mask`` next to ``X_ids``, and the masks the user declared."""
    B = lay.B
    if lay.form == "padded":
        for name, key, head in (("prompts", "prompt", True), ("responses", "response", False)):
            v = batch.get(name)
            if is_tensorlike(v) and np.ndim(v) == 2 and int(v.shape[0]) == B and int(v.shape[1]) < lay.T:
                W = int(v.shape[1])
                _add(lay, MaskGroup(key, "attention_mask", 0 if head else lay.T - W, W, part=True))
        _trainer_parts(batch, lay)
    for k, v in batch.items():
        if k != "attention_mask" and k.endswith("_mask") and _is_mask(v, B):
            ids = batch.get(k[:-5] + "_ids")
            if is_tensorlike(ids) and np.ndim(ids) >= 2 and list(ids.shape[:2]) == list(v.shape[:2]):
                _add(lay, MaskGroup(k[:-5], k, 0, int(v.shape[1])))
    lay.declared = {}
    if not isinstance(masks, Mapping):
        raise BatchError(f"masks must be a dict {{mask field: [fields]}}, got {type(masks).__name__}")
    for m, names in masks.items():
        v = batch.get(m)
        if not _is_mask(v, B):
            raise BatchError(f"masks: {m!r} is not a [{B}, W] tensor field of this batch")
        at = [i for i, g in enumerate(lay.groups) if g.src == m and not g.part]
        if at:
            lay.groups[at[0]].inferred = False
            i = at[0]
        else:
            i = _add(lay, MaskGroup(m[:-5] if m.endswith("_mask") else m, m, 0, int(v.shape[1]), inferred=False))
        for name in [m] + list(names):
            if type(name) is not str:
                raise BatchError(f"masks[{m!r}]: field names must be str, got {name!r}")
            lay.declared[name] = i


def _width(v: Any, B: int) -> int | None:
    """W of a ``[B, W]`` tensor field, else None."""
    return int(v.shape[1]) if _is_mask(v, B) and np.ndim(v) == 2 else None


def _trainer_parts(batch: Mapping, lay: _Draft) -> None:
    """The parts of ``attention_mask`` [B, T] the per-token fields of OpenRLHF's and SkyRL's batches
    follow (docs/FORMAT.md 3.4), from names and shapes: OpenRLHF's ``Experience`` (``sequences`` and an
    ``action_mask`` [B, T-1]): its action-width fields are the tokens after the first, columns 1..T-1
    (group ``action``); SkyRL's training batch (``response_mask`` [B, R]) and replay-buffer
    ``Experience`` (``action_mask`` [B, R] and ``num_actions``): its response fields are the last R
    columns (group ``response``). Nothing where verl's parts were found."""
    if any(g.part for g in lay.groups):
        return
    T, B = lay.T, lay.B
    act, resp = _width(batch.get("action_mask"), B), _width(batch.get("response_mask"), B)
    if resp is not None and resp < T:
        _add(lay, MaskGroup("response", "attention_mask", T - resp, resp, part=True))
    elif act is not None and act < T and "num_actions" in batch:
        _add(lay, MaskGroup("response", "attention_mask", T - act, act, part=True))
    elif act == T - 1 and is_tensorlike(batch.get("sequences")):
        _add(lay, MaskGroup("action", "attention_mask", 1, act, part=True))


def _prefix(src: str) -> str:
    return src[:-4] if src.endswith("_mask") else src + "_"


def group_of(lay: _Draft, path: tuple, shape: list[int]) -> int | None:
    """The mask group a ``[B, W, ...]`` tensor field follows, None for a per-sample field."""
    col = ".".join(path)
    i = lay.declared.get(col)
    if i is not None:
        W = lay.groups[i].W
        if shape[:2] != [lay.B, W]:
            raise BatchError(f"field {col!r}: shape {shape} does not follow mask {lay.groups[i].src!r} "
                             f"([{lay.B}, {W}, ...]) it was declared with")
        return i
    if len(shape) < 2 or shape[0] != lay.B:
        return None
    W, name = shape[1], path[-1]
    if lay.form == "padded" and W == lay.T:
        return 0
    parts = {g.key: i for i, g in enumerate(lay.groups) if g.part and len(shape) == 2}  # verl's [B, P], [B, R]
    head, tail, act = parts.get("prompt"), parts.get("response"), parts.get("action")
    if act is not None and W == lay.groups[act].W:
        return act
    if head is not None and W == lay.groups[head].W and (col == "prompts" or tail is None
                                                            or W != lay.groups[tail].W):
        return head
    if tail is not None and W == lay.groups[tail].W:
        return tail
    cands = [i for i, g in enumerate(lay.groups) if not g.part and g.W == W and g.src != "attention_mask"]
    named = [i for i in cands if col == lay.groups[i].src or name.startswith(_prefix(lay.groups[i].src))]
    if len(named) == 1:
        return named[0]
    return cands[0] if len(cands) == 1 else None


def last_axis_group(lay: _Draft, shape: list[int]) -> int | None:
    """The mask group of a field whose token axis is its LAST dimension (verl's Qwen2-VL mrope
    ``position_ids`` ``[B, 4, T]``): at least 3 dims, ``[B, ..., T]`` with ``T`` the width of
    ``attention_mask``. Asked only of a field ``group_of`` found per-sample, so dim 1 wins where
    both match (docs/FORMAT.md 3.4); either way the field is restored exactly."""
    if lay.T is None or not lay.groups or lay.groups[0].src != "attention_mask" or lay.groups[0].part:
        return None
    if len(shape) >= 3 and shape[0] == lay.B and shape[-1] == lay.T:
        return 0
    return None


_SIGNED_OR_BYTE = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)  # where torch.aminmax runs


def _mask01(v: Any, src: str) -> torch.Tensor | None:
    """The ``[B, W]`` token mask of mask field ``src``; None if it holds other values than 0/1."""
    _, name, a = as_cpu(v, (src,))
    mb = torch.as_tensor(a) if isinstance(a, np.ndarray) else a
    if name != "bool" and mb.numel():
        if mb.dtype in _SIGNED_OR_BYTE:  # integers within [0, 1] are 0 or 1: one pass, not three
            lo, hi = torch.aminmax(mb)
            if int(lo) < 0 or int(hi) > 1:
                return None
        elif not bool(((mb == 0) | (mb == 1)).all()):
            return None
    return token_mask(mb)


def structure(batch: Mapping, masks: Mapping[str, Any] | None = None, read: bool = False,
              known: Mapping[str, torch.Tensor | None] | None = None) -> Layout:
    """The ``Layout`` of a dict batch. ``masks`` declares ``{mask field: [fields that follow it]}``
    (top-level names). ``read``: read the values of ``cu_seqlens`` and of the masks wherever they are
    (the encoder); False reads only a ``cu_seqlens`` in CPU memory and no mask (``Writer.append``).
    ``known``: the ``[B, T]`` bool token masks of mask fields whose values are not in the batch (None:
    not 0/1), read instead (a batch unpadded on the GPU: ``format/codec/unpadded.py``)."""
    cu = batch.get("cu_seqlens")
    if is_tensorlike(cu) and not isinstance(cu, np.generic) and np.ndim(cu) == 1:
        _, name = describe(cu, ("cu_seqlens",))
        if not name.startswith(("int", "uint")) or cu.shape[0] == 0:
            raise BatchError(_CU_SEQLENS)
        lay = _Draft("packed", int(cu.shape[0]) - 1)
        lengths, error = None, None
        if read or not isinstance(cu, torch.Tensor) or cu.device.type == "cpu":
            try:
                lay.N, lengths = _read_cu_seqlens(cu)
            except BatchError as e:
                error = e
        return Layout("packed", lay.B, cu_seqlens=cu, N=lay.N, lengths=lengths,
                      follows=_follows(batch, lay), error=error)
    m = batch.get("attention_mask")
    if is_tensorlike(m) and np.ndim(m) >= 2:
        describe(m, ("attention_mask",))
        lay = _Draft("padded", int(m.shape[0]), int(m.shape[1]))
        lay.groups.append(MaskGroup("", "attention_mask", 0, lay.T))
    else:
        m, lay = None, _Draft("plain", batch_size(batch) or 0)
    _infer_groups(batch, lay, masks or {})
    if lay.form == "plain" and lay.groups:
        lay.form = "masked"
    follows, form, error = _follows(batch, lay), lay.form, None  # the fields follow the form of names and shapes
    if read and lay.groups:
        try:
            _read_groups(lay.groups, batch, known or {})
        except BatchError as e:
            error = e
        if form == "padded" and (len(lay.groups) > 1 or lay.groups[0].side == "span"):
            form = "masked"  # several masks, or a span: docs/FORMAT.md 3.4, format version 2
    g0 = lay.groups[0] if lay.form == "padded" else None
    return Layout(form, lay.B, lay.T, attention_mask=m, side=g0 and g0.side, mask=g0 and g0.mask,
                  lengths=g0 and g0.lengths, groups=tuple(lay.groups), declared=lay.declared, follows=follows,
                  error=error)


def _follows(batch: Mapping, lay: _Draft) -> dict[tuple, Follow]:
    """What each tensor field is, at every depth of the dicts the walk enters (a group of str keys;
    cycles and depths over the limit are the walk's errors, not followed here). Shapes alone: every
    array or tensor gets an answer, the walk asks only of those it finds tensor-like."""
    out: dict[tuple, Follow] = {}
    stack: list[tuple[Mapping, tuple, frozenset]] = [(batch, (), frozenset({id(batch)}))]
    while stack:
        d, at, open_ = stack.pop()
        for k, v in d.items():
            path = at + (k,)
            if isinstance(v, torch.Tensor | np.ndarray | np.generic):
                out[path] = _follow(lay, path, list(v.shape))
            elif (isinstance(v, Mapping) and id(v) not in open_ and len(path) < MAX_SPEC_DEPTH
                  and all(type(x) is str for x in v)):
                stack.append((v, path, open_ | {id(v)}))
    return out


def _follow(lay: _Draft, path: tuple, shape: list[int]) -> Follow:
    """What the tensor field at ``path`` of ``shape`` is (the walk decides 0-d and segmented fields)."""
    if not shape:
        return Follow(None)
    try:
        g = group_of(lay, path, shape) if lay.form in ("padded", "masked") else None
    except BatchError as e:
        return Follow(None, error=e)
    last = g is None and lay.form == "padded" and (g := last_axis_group(lay, shape)) is not None
    if g is not None:
        return Follow(TOKENS, g, last)
    if lay.form == "packed":
        if lay.N is None:
            return Follow(None)  # per-token if its leading dimension is N, once N is read
        if shape[0] == lay.N and not (lay.N == lay.B and path[-1] in PER_TRAJECTORY):
            return Follow(FLAT)
    if shape[0] != lay.B:
        return Follow(None, error=length_error(path, shape, lay))
    return Follow(SAMPLE, suspect=lay.form == "padded" and len(shape) >= 2 and shape[1] != lay.T
                  and bool(_TOKENISH.search(path[-1])))


def length_error(path: tuple, shape: list, lay: Any) -> BatchError:
    """A tensor whose leading dimension fits neither the batch size nor the token layout."""
    B = lay.B
    expect = f"{B} (the batch size)"
    if lay.form == "padded":
        expect += f", or [{B}, {lay.T}] per-token"
    if lay.form == "packed":
        expect += f", or {lay.N} (cu_seqlens[-1]) per-token"
    return BatchError(
        f"field {where(path)!r}: leading dimension is {shape[0]} (shape {shape}), expected "
        f"{expect}; every field must have one entry per trajectory"
    )


def _read_cu_seqlens(cu: Any) -> tuple[int, torch.Tensor]:
    """``N`` and the row lengths of a packed batch's ``cu_seqlens`` (B + 1 values, copied from the GPU
    if there), checked to start at 0 and never decrease."""
    _, _, c = as_cpu(cu, ("cu_seqlens",))
    c = torch.as_tensor(c).to(torch.int64)
    if int(c[0]) != 0 or bool((c[1:] < c[:-1]).any()):
        raise BatchError(_CU_SEQLENS)
    return int(c[-1]), c[1:] - c[:-1]


def _read_groups(groups: list[MaskGroup], batch: Mapping, known: Mapping[str, torch.Tensor | None]) -> None:
    """Read every mask group's values (``attention_mask`` must be 0/1; another mask of other values
    stores its fields whole, unless the user declared it): each group's side, mask and lengths."""
    full: dict[str, torch.Tensor | None] = {}
    for g in groups:
        if g.src not in full:
            full[g.src] = known[g.src] if g.src in known else _mask01(batch[g.src], g.src)
        m = full[g.src]
        if m is None:
            if g.src == "attention_mask" or not g.inferred:
                raise BatchError(f"field {g.src!r}: values must be 0 or 1 (found other values)")
            continue
        g.mask = m[:, g.lo:g.lo + g.W]
        g.side, g.lengths, g.starts = classify(g.mask)
        if g.side is None and not g.inferred and g.src != "attention_mask":
            g.mask, g.holes = extent(g.mask), True  # a declared multi-turn mask: one run per row, holes inside
            g.side, g.lengths, g.starts = classify(g.mask)
        if g.side is None:
            g.mask = None
