"""Strategies for the batch forms of tensor fields, each as an RL framework makes it: padded (AReaL), lists of
trajectories and of ``[g, T]`` groups, packed by ``cu_seqlens``, multimodal, verl's two-sided generation
output, TRL's prompt/completion batches and Qwen-VL image batches."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from .bits import TORCH_DTYPES, padded_values, run_mask, tensors


@st.composite
def padded_batches(draw: st.DrawFn, max_batch: int = 6) -> dict[str, Any]:
    """AReaL-style dicts of padded tensors: per-token [B, T] / [B, T, k], per-sample [B] / [B, ...]."""
    lengths = draw(st.lists(st.integers(0, 9), min_size=0, max_size=max_batch))
    B = len(lengths)
    T = max(lengths, default=0) + draw(st.integers(0, 3))  # pad-to-multiple leaves extra width
    side = draw(st.sampled_from(["right", "left"]))
    ar = torch.arange(T)
    L = torch.tensor(lengths, dtype=torch.int64).reshape(B)
    mask = ar[None, :] < L[:, None] if side == "right" else ar[None, :] >= (T - L)[:, None]
    mask_dtype = draw(st.sampled_from([torch.bool, torch.int32, torch.int64]))
    batch: dict[str, Any] = {}
    ids_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    pad_id = draw(st.integers(0, 100))
    ids = torch.randint(0, 152_000, (B, T), generator=torch.Generator().manual_seed(draw(st.integers(0, 999))))
    batch["input_ids"] = ids.to(ids_dtype).masked_fill(~mask, pad_id)
    batch["attention_mask"] = mask.to(mask_dtype)
    batch["loss_mask"] = (draw(tensors((B, T), [torch.bool])) & mask).to(torch.int32)
    lp = draw(tensors((B, T), [torch.float32, torch.bfloat16]))
    batch["logprobs"] = lp.masked_fill(~mask, 0.0)
    no_version = torch.full((B, T), -1, dtype=torch.int32)
    batch["versions"] = torch.where(mask, draw(tensors((B, T), [torch.int32])), no_version)
    if draw(st.booleans()):
        k = draw(st.integers(1, 3))
        batch["topk"] = draw(tensors((B, T, k)))  # pad region arbitrary: stored whole
    if draw(st.booleans()):  # token axis last ([B, C, T], mrope-like); C == T sometimes: dim 1 wins
        shape = (B, *draw(st.lists(st.integers(0, 3), min_size=1, max_size=2)), T)
        batch["rope"] = padded_values(draw, mask.reshape(B, *[1] * (len(shape) - 2), T).expand(shape), TORCH_DTYPES)
    batch["rewards"] = draw(tensors((B,), [torch.float32]))
    if draw(st.booleans()):
        batch["extra"] = draw(tensors((B, draw(st.integers(0, 3))), numpy=None))
    for name in draw(st.lists(st.sampled_from(["a", "b", "c"]), unique=True, max_size=2)):
        batch[f"tok_{name}"] = draw(tensors((B, T), numpy=None))
    return batch


@st.composite
def trajectory_lists(draw: st.DrawFn, max_batch: int = 6) -> list[dict[str, Any] | None]:
    """A list of per-trajectory dicts (tensors [1, T] or [T]) with ``None`` for rejected ones; rows
    may lack ``uid`` and hold their keys in an order of their own."""
    out: list = []
    two_d = draw(st.booleans())
    for _ in range(draw(st.integers(0, max_batch))):
        if draw(st.integers(0, 4)) == 0:
            out.append(None)
            continue
        T = draw(st.integers(0, 9))
        shape = (1, T) if two_d else (T,)
        row = {
            "input_ids": draw(tensors(shape, [torch.int32])),
            "attention_mask": torch.ones(shape, dtype=torch.bool),
            "logprobs": draw(tensors(shape, [torch.float32])),
            "rewards": draw(tensors((1,), [torch.float32])),
            "uid": draw(st.text(max_size=5)),
        }
        if draw(st.integers(0, 3)) == 0:
            del row["uid"]  # a key some rows lack
        order = draw(st.permutations(list(row))) if draw(st.booleans()) else list(row)
        out.append({k: row[k] for k in order})  # each row's own key order
    return out


@st.composite
def group_lists(draw: st.DrawFn, max_batch: int = 4) -> list[dict[str, Any] | None]:
    """AReaL-style groups (``GroupedRolloutWorkflow`` / ``concat_padded_tensors``): a list of dicts of
    ``[g, T]`` tensors whose ``attention_mask`` marks one run per trajectory (right-padded, sometimes
    left, anywhere, or with holes), per-token ``[g, T]`` / ``[g, T, k]`` fields whose padded positions
    hold one pad value or their own values, per-trajectory ``[g]`` rewards, and sometimes ``None``.
    Sometimes OpenRLHF's ``Experience`` fields too: ``sequences`` and ``[g, T-1]`` action fields
    following the mask's columns 1..T-1 (the tokens after the first)."""
    out: list = []
    side = draw(st.sampled_from(["right", "right", "left", "span"]))
    k = draw(st.integers(0, 2))
    action = draw(st.integers(0, 2)) == 0
    for _ in range(draw(st.integers(0, max_batch))):
        if draw(st.integers(0, 5)) == 0:
            out.append(None)
            continue
        g, T = draw(st.integers(1, 4)), draw(st.integers(0, 8))
        m = run_mask(draw, g, T, side)
        if draw(st.integers(0, 6)) == 0:
            m[0] = draw(tensors((T,), [torch.bool]))  # holes: the group is stored whole
        out.append({"input_ids": padded_values(draw, m, [torch.int32, torch.int64]),
                    "attention_mask": m.to(draw(st.sampled_from([torch.bool, torch.int32]))),
                    "logprobs": padded_values(draw, m, [torch.float32, torch.bfloat16]),
                    "topk": padded_values(draw, m[..., None].expand(g, T, k), [torch.float16]),
                    "rewards": draw(tensors((g,), [torch.float32])), "uid": draw(st.text(max_size=3))})
        if action and T:
            out[-1] |= {"sequences": padded_values(draw, m, [torch.int64]), "action_mask": m[:, 1:].clone(),
                        "action_log_probs": padded_values(draw, m[:, 1:], [torch.float32, torch.bfloat16])}
    return out


@st.composite
def packed_batches(draw: st.DrawFn, max_batch: int = 6) -> dict[str, Any]:
    """Packed layout: flat [N] per-token tensors plus ``cu_seqlens`` [B+1]."""
    lengths = draw(st.lists(st.integers(0, 9), min_size=0, max_size=max_batch))
    B, N = len(lengths), sum(lengths)
    cu = torch.zeros(B + 1, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(cu.dtype) if B else cu[1:]
    batch = {
        "input_ids": draw(tensors((N,), [torch.int64, torch.int32])),
        "logprobs": draw(tensors((N,), [torch.float32, torch.bfloat16])),
        "cu_seqlens": cu,
        "rewards": draw(tensors((B,), [torch.float32])),
    }
    if draw(st.booleans()):
        batch["max_seqlen"] = max(lengths, default=0)
    return batch


@st.composite
def multimodal_batches(draw: st.DrawFn, max_batch: int = 4) -> dict[str, Any]:
    """Per-sample tensors of per-sample shape, and AReaL's ``multi_modal_input`` list of dicts."""
    B = draw(st.integers(0, max_batch))
    T = draw(st.integers(1, 6))
    mm = []
    pv_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    for _ in range(B):
        n = draw(st.integers(0, 4))
        mm.append({"pixel_values": draw(tensors((n, 4), [pv_dtype])),
                   "image_grid_thw": draw(tensors((draw(st.integers(0, 2)), 3), [torch.int64]))})
    return {
        "input_ids": draw(tensors((B, T), [torch.int64])),
        "attention_mask": torch.ones(B, T, dtype=torch.bool),
        "pixel_values": [draw(tensors((draw(st.integers(0, 3)), 2), [torch.float16])) for _ in range(B)],
        "multi_modal_input": mm,
    }


@st.composite
def two_sided_batches(draw: st.DrawFn, max_batch: int = 5) -> dict[str, Any]:
    """verl-style generation output: ``prompts`` [B, P] left-padded, ``responses`` [B, R]
    right-padded, ``attention_mask`` [B, P + R] padded on both sides (sometimes with holes), the
    ``response_mask`` and per-token [B, R] fields of the response part."""
    B, P, R = draw(st.integers(0, max_batch)), draw(st.integers(1, 7)), draw(st.integers(1, 9))
    pm, rm = run_mask(draw, B, P, "left"), run_mask(draw, B, R, "right")
    am = torch.cat([pm, rm], 1)
    if B and draw(st.integers(0, 5)) == 0:  # a mask with holes: stored whole
        am[0] = draw(tensors((P + R,), [torch.bool]))
    mdt = draw(st.sampled_from([torch.int64, torch.int32, torch.bool]))
    ids = padded_values(draw, am, [torch.int64, torch.int32])
    out: dict[str, Any] = {"prompts": ids[:, :P], "responses": ids[:, P:], "response_mask": rm.to(mdt),
                           "input_ids": ids, "attention_mask": am.to(mdt),
                           "position_ids": torch.clamp(am.long().cumsum(1) - 1, min=0)}
    if draw(st.booleans()):  # Qwen2-VL mrope: [B, 4, P + R], token axis last
        out["position_ids"] = padded_values(draw, am[:, None].expand(B, 4, P + R), [torch.int64])
    for name in draw(st.lists(st.sampled_from(["old_log_probs", "advantages", "ref_log_prob"]),
                              unique=True, max_size=3)):
        out[name] = padded_values(draw, rm, [torch.float32, torch.bfloat16, torch.float16])
    out["token_level_rewards"] = padded_values(draw, rm, [torch.float32])
    return out


@st.composite
def prompt_completion_batches(draw: st.DrawFn, max_batch: int = 5) -> dict[str, Any]:
    """TRL-style ``_generate_and_score_completions`` output: ``prompt_ids`` / ``prompt_mask``
    left-padded [B, P], ``completion_ids`` / ``completion_mask`` right-padded [B, C] (the mask
    sometimes a span or with holes), per-token [B, C] logps, no ``attention_mask``."""
    B, P = draw(st.integers(0, max_batch)), draw(st.integers(1, 7))
    C = draw(st.integers(1, 9).filter(lambda c: c != P))
    pm = run_mask(draw, B, P, draw(st.sampled_from(["left", "right", "span"])))
    cm = run_mask(draw, B, C, draw(st.sampled_from(["right", "right", "span"])))
    if B and draw(st.integers(0, 5)) == 0:
        cm[-1] = draw(tensors((C,), [torch.bool]))
    out: dict[str, Any] = {"prompt_ids": padded_values(draw, pm, [torch.int64]),
                           "prompt_mask": pm.to(torch.int64),
                           "completion_ids": padded_values(draw, cm, [torch.int64, torch.int32]),
                           "completion_mask": cm.to(draw(st.sampled_from([torch.int64, torch.int32, torch.bool])))}
    for name in draw(st.lists(st.sampled_from(["old_per_token_logps", "ref_per_token_logps",
                                               "sampling_per_token_logps"]), unique=True, max_size=3)):
        out[name] = padded_values(draw, cm, [torch.float32, torch.bfloat16])
    if draw(st.booleans()):
        out["tool_mask"] = (cm & draw(tensors((B, C), [torch.bool]))).to(torch.int64)
    if draw(st.booleans()):  # a numpy field follows the mask as well
        out["completion_scores"] = np.where(cm.numpy(), draw(tensors((B, C), numpy=True)), 0)
    out["advantages"] = draw(tensors((B,), [torch.float32]))
    out["num_items_in_batch"] = torch.tensor(int(cm.sum()))
    return out


@st.composite
def image_batches(draw: st.DrawFn) -> dict[str, Any]:
    """A TRL/Qwen-VL batch: a padded, prompt/completion or plain batch of ``B`` trajectories plus
    ``pixel_values`` ``[sum_patches, d]`` (every image's ``t*h*w`` patch rows, sample by sample),
    ``image_grid_thw`` ``[n_images, 3]`` and ``num_images`` (images per sample; sometimes absent: one
    each), stored one run of rows per sample (docs/FORMAT.md ``segtensor``)."""
    plain = st.integers(0, 5).flatmap(lambda b: st.builds(lambda r: {"rewards": r}, tensors((b,), [torch.float32])))
    out = draw(st.one_of(prompt_completion_batches(), padded_batches(), plain))
    B = len(next(v for v in out.values() if isinstance(v, torch.Tensor | np.ndarray)))
    many = draw(st.booleans())
    n = draw(st.lists(st.integers(0, 3), min_size=B, max_size=B)) if many else [1] * B
    grid = draw(st.lists(st.tuples(*[st.integers(0 if many else 1, 3)] * 3), min_size=sum(n), max_size=sum(n)))
    pv = draw(tensors((sum(math.prod(g) for g in grid), draw(st.integers(0, 4))), numpy=None))
    out["pixel_values"] = pv
    out["image_grid_thw"] = torch.tensor(grid, dtype=torch.int64).reshape(-1, 3)
    if isinstance(pv, np.ndarray) and draw(st.booleans()):
        out["image_grid_thw"] = out["image_grid_thw"].numpy()
    if many:
        out["num_images"] = n
    return out
