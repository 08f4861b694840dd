"""How the tokens of a dict batch are laid out (docs/FORMAT.md section 3.4): the batch form
(padded by ``attention_mask``, masked by several masks or a two-sided one, packed by ``cu_seqlens``,
or plain), the mask groups per-token fields follow (``MaskGroup``, ``group_of``), which positions of
a ``[B, T, ...]`` mask hold a token, and the ``[B, T]`` mask of given row lengths (and starts).

The form is decided in two steps: ``structure`` from names, dtypes and shapes alone (what
``Writer.append`` may look at), then ``read_cu_seqlens`` / ``read_groups`` from the values (the
encoder, which turns a padded batch into a masked one when a mask is a span or there are several).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...base.threads import run_parallel
from ...errors import BatchError
from ..spec import LEN_PREFIX, START_PREFIX
from ..values import as_cpu, describe, is_tensorlike

__all__ = ["Layout", "MaskGroup", "token_mask", "structure", "batch_size", "read_cu_seqlens", "read_groups",
           "padded_mask", "span_mask", "extent", "group_of", "len_col", "last_axis_group", "channel_major", "classify", "count_tokens",
           "is_flat", "PER_TRAJECTORY"]

# docs/FORMAT.md 3.4: in a packed batch with as many tokens as trajectories (N == B), fields of these
# names stay per-trajectory (every other field of leading size N is per-token)
PER_TRAJECTORY = ("rewards", "reward", "scores", "score", "seq_len", "seq_lens", "seqlen", "seqlens")

_CU_SEQLENS = "field 'cu_seqlens': must be a non-empty 1-D integer tensor starting at 0 and non-decreasing"


@dataclass
class Layout:
    """The form of a dict batch, filled in as far as it is known: ``form``, ``B`` and ``T`` from the
    structure; ``N`` and ``lengths`` once ``cu_seqlens`` is read; ``side``, ``mask`` and ``lengths``
    once the attention mask is read (``side`` None: the mask has holes)."""

    form: str  # "padded", "masked", "packed" or "plain"
    B: int
    T: int | None = None  # padded
    cu_seqlens: Any = None  # packed: the batch's value
    attention_mask: Any = None  # padded: the batch's value
    N: int | None = None  # packed: cu_seqlens[-1]
    side: str | None = None  # padded: "right", "left", "span", or None (holes: [B, T] fields stored whole)
    mask: torch.Tensor | None = None  # padded, side known: the [B, T] token mask
    lengths: torch.Tensor | None = None  # tokens per row
    groups: list[MaskGroup] = field(default_factory=list)  # padded / masked: the masks fields follow
    declared: dict[str, int] = field(default_factory=dict)  # field name -> group, from the user


@dataclass
class MaskGroup:
    """Columns ``lo:lo+W`` of the mask field ``src``: the token mask a set of ``[B, W, ...]`` fields
    follows (docs/FORMAT.md section 3.4). ``key`` names its ``<key>_cu_seqlens`` in packed output
    ("" for the attention mask: plain ``cu_seqlens``); ``inferred`` groups whose mask is not 0/1
    store their fields whole instead of failing."""

    key: str
    src: str
    lo: int
    W: int
    part: bool = False  # a part of the mask field (verl's prompt / response columns of attention_mask)
    inferred: bool = True
    side: str | None = None  # once read: "right", "left", "span", or None (holes: stored whole)
    mask: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    starts: torch.Tensor | None = None  # side "span": first valid position per row
    holes: bool = False  # a declared mask with holes: each row's run spans its first to last valid token

    def node(self) -> dict:
        """The group's spec node (docs/FORMAT.md section 3.7)."""
        d = {"key": self.key, "src": self.src, "lo": self.lo, "W": self.W, "side": self.side}
        if self.side == "span":
            d["start_col"] = start_col(self)
        if self.holes:
            d["holes"] = True
        return d


def start_col(g: MaskGroup) -> str:
    """The column of a span group's per-row starts."""
    return START_PREFIX + g.src + (f"__{g.key}" if g.part else "")


def len_col(g: MaskGroup) -> str:
    """The column of a mask group's per-row valid token counts (docs/FORMAT.md 3.4)."""
    return LEN_PREFIX + g.src + (f"__{g.key}" if g.part else "")


def token_mask(m: torch.Tensor | np.ndarray) -> torch.Tensor:
    """The ``[B, T]`` bool mask of an attention mask of shape ``[B, T, ...]``: a token is valid where
    every one of its entries is non-zero (the one rule the encoder, the recorder and the
    inspection tools share)."""
    t = torch.as_tensor(m) != 0
    while t.ndim > 2:
        t = t.all(dim=-1)
    return t


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


def structure(batch: Mapping, masks: Mapping[str, Any] | None = None) -> Layout:
    """The form, ``B``, ``T`` and mask groups of a dict batch from names, dtypes and shapes only (no
    value is read). ``masks`` declares ``{mask field: [fields that follow it]}`` (top-level names)."""
    cu = batch.get("cu_seqlens")
    if is_tensorlike(cu) and not isinstance(cu, np.generic) and np.ndim(cu) == 1:
        _, name = describe(cu, ("cu_seqlens",))
        if not name.startswith(("int", "uint")) or cu.shape[0] == 0:
            raise BatchError(_CU_SEQLENS)
        return Layout("packed", int(cu.shape[0]) - 1, cu_seqlens=cu)
    m = batch.get("attention_mask")
    if is_tensorlike(m) and np.ndim(m) >= 2:
        describe(m, ("attention_mask",))
        lay = Layout("padded", int(m.shape[0]), int(m.shape[1]), attention_mask=m)
        lay.groups.append(MaskGroup("", "attention_mask", 0, lay.T))
    else:
        lay = Layout("plain", batch_size(batch) or 0)
    _infer_groups(batch, lay, masks or {})
    if lay.form == "plain" and lay.groups:
        lay.form = "masked"
    return lay


def _is_mask(v: Any, B: int) -> bool:
    return is_tensorlike(v) and np.ndim(v) >= 2 and int(v.shape[0]) == B


def _add(lay: Layout, g: MaskGroup) -> int:
    keys = {x.key for x in lay.groups}
    base, i = g.key, 2
    while g.key in keys:
        g.key, i = f"{base}_{i}", i + 1
    lay.groups.append(g)
    return len(lay.groups) - 1


def _infer_groups(batch: Mapping, lay: Layout, masks: Mapping[str, Any]) -> None:
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


def _trainer_parts(batch: Mapping, lay: Layout) -> None:
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


def group_of(lay: Layout, path: tuple, shape: list[int]) -> int | None:
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


def last_axis_group(lay: Layout, shape: list[int]) -> int | None:
    """The mask group of a field whose token axis is its LAST dimension (verl's Qwen2-VL mrope
    ``position_ids`` ``[B, 4, T]``): at least 3 dims, ``[B, ..., T]`` with ``T`` the width of
    ``attention_mask``. Asked only of a field ``group_of`` found per-sample, so dim 1 wins where
    both match (docs/FORMAT.md 3.4); either way the field is restored exactly."""
    if lay.T is None or not lay.groups or lay.groups[0].src != "attention_mask" or lay.groups[0].part:
        return None
    if len(shape) >= 3 and shape[0] == lay.B and shape[-1] == lay.T:
        return 0
    return None


def channel_major(lengths: Any, w: int) -> np.ndarray:
    """For rows of ``lengths`` tokens of ``w`` channels each, laid out one after another: where each
    value of the token-major order (row by row, token by token, channel by channel) goes in the
    channel-major order (row by row, channel by channel, token by token), the order a field whose
    token axis is last stores each row's ``[C..., n]`` block in (docs/FORMAT.md 3.4)."""
    ln = np.asarray(lengths, dtype=np.int64).reshape(-1)
    o = np.zeros(len(ln), dtype=np.int64)
    np.cumsum(ln[:-1], out=o[1:])
    r = np.repeat(np.arange(len(ln)), ln)
    j = np.arange(int(ln.sum()), dtype=np.int64) - o[r]
    return ((o[r] * w + j)[:, None] + np.arange(w, dtype=np.int64)[None, :] * ln[r][:, None]).reshape(-1)


def is_flat(lay: Layout, path: tuple, shape: list[int]) -> bool:
    """Whether a tensor of a packed batch (``N`` known) is per-token: its leading size is ``N``, and
    when ``N == B`` its name is not one of ``PER_TRAJECTORY``."""
    return shape[0] == lay.N and not (lay.N == lay.B and path[-1] in PER_TRAJECTORY)


def read_cu_seqlens(lay: Layout) -> None:
    """Read a packed batch's ``cu_seqlens`` (B + 1 values, copied from the GPU if there): check that
    it starts at 0 and never decreases; set ``N`` and ``lengths``."""
    _, _, c = as_cpu(lay.cu_seqlens, ("cu_seqlens",))
    c = torch.as_tensor(c).to(torch.int64)
    if int(c[0]) != 0 or bool((c[1:] < c[:-1]).any()):
        raise BatchError(_CU_SEQLENS)
    lay.N, lay.lengths = int(c[-1]), c[1:] - c[:-1]


def _mask01(v: Any, src: str) -> torch.Tensor | None:
    """The ``[B, W]`` token mask of mask field ``src``; None if it holds other values than 0/1."""
    _, name, a = as_cpu(v, (src,))
    mb = torch.as_tensor(a) if isinstance(a, np.ndarray) else a
    if name != "bool" and not bool(((mb == 0) | (mb == 1)).all()):
        return None
    return token_mask(mb)


def classify(mask: torch.Tensor) -> tuple[str | None, torch.Tensor, torch.Tensor | None]:
    """``(side, lengths, starts)`` of a ``[B, W]`` token mask: right when every row's tokens are a
    prefix, left when a suffix, span when one contiguous run anywhere (``starts`` its first
    positions), None for holes."""
    W = mask.shape[1]
    lengths = mask.sum(1)
    if mask.shape[0] == 0:  # no rows: every side fits (and no [W] positions are built for a wide empty batch)
        return "right", lengths, None
    ar = torch.arange(W)
    if torch.equal(mask, ar[None, :] < lengths[:, None]):
        return "right", lengths, None
    if torch.equal(mask, ar[None, :] >= (W - lengths)[:, None]):
        return "left", lengths, None
    starts = torch.where(lengths > 0, mask.to(torch.uint8).argmax(1), 0)
    if torch.equal(mask, (ar[None, :] >= starts[:, None]) & (ar[None, :] < (starts + lengths)[:, None])):
        return "span", lengths, starts
    return None, lengths, None


def read_groups(lay: Layout, batch: Mapping) -> None:
    """Read every mask group's values (``attention_mask`` must be 0/1; another mask of other values
    stores its fields whole, unless the user declared it); the first group also sets the layout's
    ``side``, ``mask`` and ``lengths``."""
    full: dict[str, torch.Tensor | None] = {}
    for g in lay.groups:
        if g.src not in full:
            full[g.src] = _mask01(batch[g.src], g.src)
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
    if lay.form == "padded":
        g = lay.groups[0]
        lay.side, lay.mask, lay.lengths = g.side, g.mask, g.lengths


def extent(mask: torch.Tensor) -> torch.Tensor:
    """The ``[B, W]`` mask of each row's positions from its first valid token to its last (holes
    filled; an empty row stays empty): the run a mask with holes stores per row (docs/FORMAT.md 3.4)."""
    W = mask.shape[1]
    if not W:
        return mask.clone()
    m8 = mask.to(torch.uint8)
    first = m8.argmax(1)
    last = W - 1 - m8.flip(1).argmax(1)
    ar = torch.arange(W)[None, :]
    return (ar >= first[:, None]) & (ar <= last[:, None]) & mask.any(1, keepdim=True)


def span_mask(starts: np.ndarray, lengths: np.ndarray, W: int) -> torch.Tensor:
    """The [B, W] bool mask of rows holding ``lengths`` tokens from ``starts``."""
    if len(lengths) == 0:  # no rows: no [W] positions (a wide empty batch)
        return torch.zeros((0, W), dtype=torch.bool)
    ar = np.arange(W)
    s = np.asarray(starts, dtype=np.int64)[:, None]
    return torch.from_numpy((ar[None, :] >= s) & (ar[None, :] < s + np.asarray(lengths, np.int64)[:, None]))


def padded_mask(lengths: np.ndarray, T: int, side: str) -> torch.Tensor:
    """The [B, T] bool mask of ``lengths`` right- or left-aligned, built by row ranges in parallel."""
    L = np.asarray(lengths, dtype=np.int64).reshape(-1)
    out = np.empty((len(L), T), np.bool_)
    if not len(L):  # no rows: no [T] positions (a wide empty batch)
        return torch.from_numpy(out)
    ar = np.arange(T)

    def rows(ab: tuple[int, int]) -> None:
        a, b = ab
        if side == "right":
            np.less(ar[None, :], L[a:b, None], out=out[a:b])
        else:
            np.greater_equal(ar[None, :], (T - L[a:b])[:, None], out=out[a:b])

    bounds = np.linspace(0, len(L), max(1, min(len(L), out.nbytes // (1 << 20))) + 1).astype(np.int64)
    run_parallel(rows, [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a], out.nbytes)
    return torch.from_numpy(out)


def count_tokens(plain: Any) -> torch.Tensor | int | None:
    """The valid tokens of a plain batch, without reading GPU memory: a (possibly CUDA) 0-d tensor or
    an int; None where the batch does not say. A dict batch counts ``cu_seqlens[-1]`` or its
    ``attention_mask``; a list batch each element's ``attention_mask`` (``[T]``, ``[1, T]`` or a
    group's ``[g, T]``), else every ``input_ids`` entry."""
    if isinstance(plain, Mapping):
        cu, m = plain.get("cu_seqlens"), plain.get("attention_mask")
        if isinstance(cu, torch.Tensor) and cu.ndim == 1 and cu.numel():
            return cu[-1]
        if isinstance(m, torch.Tensor) and m.ndim >= 2:
            return token_mask(m).sum()
        return None
    if not isinstance(plain, list | tuple):
        return None
    n: torch.Tensor | int = 0
    for e in plain:
        if isinstance(e, Mapping):
            m, ids = e.get("attention_mask"), e.get("input_ids")
            if isinstance(m, torch.Tensor | np.ndarray):
                n = n + token_mask(m).sum()
            elif isinstance(ids, torch.Tensor | np.ndarray):  # no mask: every token counts
                n = n + (ids.size if isinstance(ids, np.ndarray) else ids.numel())
            else:
                return None
    return n
