"""One step's batch as one dict per trajectory: the common view behind traces, diff and to_pandas.

Whatever form a step was appended in (padded dict with ``attention_mask``, packed dict with
``cu_seqlens``, plain dict, list of per-trajectory dicts with ``None`` for rejected ones), ``rows``
returns ``[dict | None]`` with one entry per trajectory:

* nested dicts are flattened to dotted names (``{"a": {"b": x}}`` -> ``"a.b"``);
* per-token fields are cut to the trajectory's own tokens (padding removed, packed rows split),
  as numpy arrays whose first axis is the token axis; in a list batch, a field shaped like the
  row's ``attention_mask`` is cut by that mask (so ``[1, T]`` tensors become ``[n]``);
* verl-style batches (``prompts`` [B, P], ``responses`` [B, R], ``attention_mask`` [B, P + R]):
  every [B, P, ...] field is cut by the prompt part of the mask and every [B, R, ...] field
  (``response_mask``, ``old_log_probs``, ``advantages``...) by the response part;
* a segmented field (``segtensor``: TRL/Qwen-VL ``pixel_values``) gives each trajectory its own run
  of leading-dimension rows (its images' patch rows);
* a field whose token axis is its last dimension (``"axis": "last"``: verl's Qwen2-VL
  ``position_ids`` ``[B, 4, T]``) is cut on that axis: ``[4, n]`` per trajectory;
* a batch with several masks (form ``masked``: TRL's ``prompt_mask`` / ``completion_mask``, verl's
  two-sided ``attention_mask``): every per-token field is cut by the mask it follows in the spec;
* tensors become numpy arrays (bfloat16 becomes float32, which holds every bfloat16 exactly);
* batch-wide values (``cu_seqlens``, ``max_seqlen``, 0-d tensors, plain scalars) are left out;
* a rejected (``None``) trajectory is ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..batch.masks import extent, token_mask
from ..spec import is_tokenlike

__all__ = ["rows", "row_mask", "to_numpy"]

_LAYOUT = ("cu_seqlens", "max_seqlen")


def to_numpy(x: Any) -> Any:
    """A tensor as a numpy array (bfloat16 -> float32); other values unchanged."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.numpy()
    return x


def _flat(prefix: str, node: Any, out: dict) -> None:
    for k, v in node.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            _flat(name + ".", v, out)
        else:
            out[name] = v


def _names(spec_keys: list, pick: Callable[[dict], bool], prefix: str = "") -> set[str]:
    """Dotted names of the fields (nested groups included) whose spec node ``pick`` accepts."""
    out: set[str] = set()
    for k, node in spec_keys:
        name = f"{prefix}{k}"
        if node.get("t") == "group":
            out |= _names(node["keys"], pick, name + ".")
        elif pick(node):
            out.add(name)
    return out


def _mask_of(spec_keys: list, prefix: str = "") -> dict[str, int]:
    """Dotted names of a masked batch's fields -> the mask group each follows."""
    out: dict[str, int] = {}
    for k, node in spec_keys:
        name = f"{prefix}{k}"
        if node.get("t") == "group":
            out.update(_mask_of(node["keys"], name + "."))
        elif node.get("t") == "tensor" and "mask" in node:
            out[name] = node["mask"]
    return out


def _segments(spec_keys: list, prefix: str = "") -> dict[str, np.ndarray]:
    """Dotted names of the segmented fields -> each trajectory's first row (B + 1 boundaries)."""
    out: dict[str, np.ndarray] = {}
    for k, node in spec_keys:
        name = f"{prefix}{k}"
        if node.get("t") == "group":
            out.update(_segments(node["keys"], name + "."))
        elif node.get("t") == "segtensor":
            out[name] = np.concatenate([[0], np.cumsum(np.asarray(node["counts"], dtype=np.int64))])
    return out


def _group_masks(flat: dict, spec: dict) -> list[np.ndarray | None]:
    """Each mask group's [B, W] token mask, from its mask field as decoded (a declared mask with holes:
    each row's run from its first to its last valid token, as stored)."""
    full: dict[str, np.ndarray] = {}
    out: list[np.ndarray | None] = []
    for g in spec.get("masks", []):
        m = flat.get(g["src"])
        if m is None:
            out.append(None)
            continue
        if g["src"] not in full:
            full[g["src"]] = token_mask(to_numpy(m)).numpy()
        m = full[g["src"]][:, g["lo"]:g["lo"] + g["W"]]
        out.append(extent(torch.from_numpy(m)).numpy() if g.get("holes") else m)  # 3.4: a run, holes inside
    return out


def _is_global(node: dict) -> bool:
    return node.get("t") in ("json", "gtensor", "tvalue")


def row_mask(m: Any) -> np.ndarray:
    """The ``[T]`` bool mask of one trajectory's mask of shape ``[T, ...]`` (``token_mask`` of one row)."""
    return token_mask(np.asarray(m)[None] != 0)[0].numpy()


def _list_row(d: Mapping) -> dict:
    flat: dict = {}
    _flat("", d, flat)
    mask = flat.get("attention_mask")
    keep = None
    if isinstance(mask, torch.Tensor | np.ndarray) and np.ndim(mask) >= 1:
        keep = np.asarray(to_numpy(mask)) != 0
    out = {}
    for k, v in flat.items():
        v = to_numpy(v)
        if keep is not None and isinstance(v, np.ndarray) and v.shape[: keep.ndim] == keep.shape:
            v = v[keep]
        out[k] = v
    return out


def _list_rows(d: Mapping, element: int) -> list[dict]:
    """One element of a list batch: one trajectory, or, when its ``attention_mask`` is ``[g, T]``
    with ``g > 1`` (AReaL's grouped rollouts, ``concat_padded_tensors``), the ``g`` trajectories of
    the group, each with its own tokens and ``group`` (the element's index) added."""
    mask = d.get("attention_mask")
    m = np.asarray(to_numpy(mask)) if isinstance(mask, torch.Tensor | np.ndarray) else None
    if m is None or m.ndim != 2 or m.shape[0] < 2:
        return [_list_row(d)]
    flat: dict = {}
    _flat("", d, flat)
    g, keep = m.shape[0], token_mask(m).numpy()
    out: list[dict] = [{"group": element} for _ in range(g)]
    for k, v in flat.items():
        v = to_numpy(v)
        for j in range(g):
            if isinstance(v, np.ndarray) and v.ndim >= 2 and v.shape[:2] == keep.shape:
                out[j][k] = v[j][keep[j]]  # per token
            elif isinstance(v, np.ndarray | list | tuple) and len(v) == g and np.ndim(v) >= 1:
                out[j][k] = v[j]  # one per trajectory of the group
            else:
                out[j][k] = v  # the group's
    return out


def _split_widths(flat: dict, mask: np.ndarray | None) -> tuple[int, int]:
    """verl-style batches: ``prompts`` [B, P] and ``responses`` [B, R] with ``attention_mask`` [B, P + R].
    Then [B, P, ...] fields are cut by the prompt part of the mask, [B, R, ...] by the response part."""
    p, r = flat.get("prompts"), flat.get("responses")
    if mask is None or not all(isinstance(x, torch.Tensor | np.ndarray) and np.ndim(x) == 2 for x in (p, r)):
        return 0, 0
    P, R = int(p.shape[1]), int(r.shape[1])
    if P + R != mask.shape[1] or P == R:
        return 0, 0
    return P, R


def rows(batch: Any, spec: dict) -> list[dict | None]:
    """The trajectories of one decoded step (``spec`` is ``reader.info(step)["batch"]``)."""
    if spec.get("t") == "seq":
        out_rows: list[dict | None] = []
        for i, e in enumerate(batch):
            if isinstance(e, Mapping):
                out_rows += _list_rows(e, i)
            else:
                out_rows.append(None if e is None else {"value": e})
        return out_rows
    B = int(spec.get("B", 0))
    flat: dict = {}
    _flat("", batch, flat)
    tokens = _names(spec.get("keys", []), is_tokenlike)
    last = _names(spec.get("keys", []), lambda n: n.get("axis") == "last")  # [B, C..., T]: cut on the last axis
    skip = _names(spec.get("keys", []), _is_global)
    form = spec.get("form")
    out: list[dict] = [{} for _ in range(B)]
    mask = cu = None
    if form == "padded" and "attention_mask" in flat:
        mask = token_mask(flat["attention_mask"]).numpy()
    if form == "packed":
        cu = np.asarray(to_numpy(flat["cu_seqlens"]), dtype=np.int64)
    P, R = _split_widths(flat, mask)
    follows = _mask_of(spec.get("keys", [])) if form == "masked" else {}
    gmasks = _group_masks(flat, spec) if form == "masked" else []
    segs = _segments(spec.get("keys", []))
    for name, v in flat.items():
        if name in skip or (form == "packed" and name in _LAYOUT) or (
                "." in name and any(name.startswith(g + ".") for g in skip)):  # inside a batch-wide dict
            continue
        v = to_numpy(v)
        gm = gmasks[follows[name]] if name in follows else None
        if name in segs:
            for i in range(B):
                out[i][name] = v[segs[name][i]:segs[name][i + 1]]
        elif name in last and (gm is not None or mask is not None):
            m = gm if gm is not None else mask
            for i in range(B):
                out[i][name] = v[i][..., m[i]]
        elif gm is not None:
            for i in range(B):
                out[i][name] = v[i][gm[i]]
        elif mask is not None and (name in tokens or (isinstance(v, np.ndarray) and v.ndim >= 2
                                                    and v.shape[:2] == mask.shape)):
            for i in range(B):  # per-token ([B, T, ...]), also when the mask has holes
                out[i][name] = v[i][mask[i]]
        elif R and isinstance(v, np.ndarray) and v.ndim >= 2 and v.shape[1] in (P, R):
            part = mask[:, :P] if v.shape[1] == P else mask[:, P:]
            for i in range(B):
                out[i][name] = v[i][part[i]]
        elif name in tokens and cu is not None:
            for i in range(B):
                out[i][name] = v[cu[i]:cu[i + 1]]
        else:
            for i in range(B):
                out[i][name] = v[i]
    return out
