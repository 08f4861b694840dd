"""Hypothesis strategies for every batch form trajstore stores, and an exact comparison.

Use them to test your own integration::

    from hypothesis import given
    from trajstore.testing import batches, assert_batch_equal

    @given(batches())
    def test_my_roundtrip(batch): ...

Needs ``hypothesis`` (``pip install trajstore[test]``).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from .format.batch.containers import DataProtoLike
from .format.dtypes import bits_view

__all__ = [
    "TORCH_DTYPES",
    "tensors",
    "padded_batches",
    "trajectory_lists",
    "group_lists",
    "packed_batches",
    "multimodal_batches",
    "non_tensor_values",
    "non_tensor_batches",
    "typed_values",
    "typed_batches",
    "two_sided_batches",
    "prompt_completion_batches",
    "image_batches",
    "batches",
    "assert_batch_equal",
]

TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64]
NUMPY_DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16, np.float32,
                np.float64, np.uint16, np.uint32, np.uint64]


def _random_bits(seed: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, -0.0, inf included) of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, size), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape) if shape else raw.view(dtype).reshape(())


@st.composite
def tensors(draw: st.DrawFn, shape: tuple, dtypes: Sequence[torch.dtype] = TORCH_DTYPES,
            numpy: bool | None = False) -> torch.Tensor | np.ndarray:
    """A tensor (or numpy array when ``numpy``) of ``shape`` holding arbitrary bits."""
    use_np = draw(st.booleans()) if numpy is None else numpy
    seed = draw(st.integers(0, 2**31 - 1))
    if use_np:
        dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
        rng = np.random.default_rng(seed)
        if dtype == np.bool_:
            return rng.integers(0, 2, shape).astype(bool)
        return rng.integers(0, 256, (*shape, dtype.itemsize), dtype=np.uint8).view(dtype).reshape(shape)
    return _random_bits(seed, tuple(shape), draw(st.sampled_from(list(dtypes))))


_lengths = st.lists(st.integers(0, 9), min_size=0, max_size=6)


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
        batch["rope"] = _padded_values(draw, mask.reshape(B, *[1] * (len(shape) - 2), T).expand(shape), TORCH_DTYPES)
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
        m = _run_mask(draw, g, T, side)
        if draw(st.integers(0, 6)) == 0:
            m[0] = draw(tensors((T,), [torch.bool]))  # holes: the group is stored whole
        out.append({"input_ids": _padded_values(draw, m, [torch.int32, torch.int64]),
                    "attention_mask": m.to(draw(st.sampled_from([torch.bool, torch.int32]))),
                    "logprobs": _padded_values(draw, m, [torch.float32, torch.bfloat16]),
                    "topk": _padded_values(draw, m[..., None].expand(g, T, k), [torch.float16]),
                    "rewards": draw(tensors((g,), [torch.float32])), "uid": draw(st.text(max_size=3))})
        if action and T:
            out[-1] |= {"sequences": _padded_values(draw, m, [torch.int64]), "action_mask": m[:, 1:].clone(),
                        "action_log_probs": _padded_values(draw, m[:, 1:], [torch.float32, torch.bfloat16])}
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


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=8,
)


def non_tensor_values(n: int) -> st.SearchStrategy[list]:
    """One per-sample value list of a single kind: str / int / float / bool / JSON / None mix."""
    leaf = st.sampled_from(["str", "int", "float", "bool", "json"])

    @st.composite
    def _one(draw: st.DrawFn) -> list:
        kind = draw(leaf)
        base = {"str": st.text(max_size=6), "int": st.integers(-(2**63), 2**63 - 1),
                "float": st.floats(), "bool": st.booleans(), "json": _json}[kind]
        return [draw(st.none() | base) for _ in range(n)]

    return _one()


@st.composite
def non_tensor_batches(draw: st.DrawFn, max_batch: int = 5) -> dict[str, Any]:
    """verl-style ``non_tensor_batch``: numpy object arrays, plus plain lists and scalars."""
    B = draw(st.integers(0, max_batch))
    batch: dict[str, Any] = {"rewards": draw(tensors((B,), [torch.float32]))}
    for i in range(draw(st.integers(1, 3))):
        vals = draw(non_tensor_values(B))
        if draw(st.booleans()):
            arr = np.empty(B, dtype=object)
            for j, v in enumerate(vals):
                arr[j] = v
            batch[f"nt{i}"] = arr
        else:
            batch[f"nt{i}"] = vals
    batch["uid"] = np.array([f"u{j}" for j in range(B)]) if B else np.array([], dtype="<U1")
    batch["global_flag"] = draw(st.none() | st.booleans() | st.integers(0, 9) | st.text(max_size=3))
    batch["temperature"] = torch.tensor(draw(st.floats(0, 2)), dtype=torch.float32)
    return batch


_NP_SCALAR_DTYPES = ["?", "u1", "i1", "<i2", "<i4", "<i8", "<u8", "<f2", "<f4", "<f8", "<c16", "<M8[ns]",
                     "<M8[D]", "<m8[s]", "S4", "<U3"]


@st.composite
def _np_arrays(draw: st.DrawFn, shape: tuple) -> np.ndarray:
    """A numpy array of a non-object dtype (datetime64, bytes, str, complex included), arbitrary bits
    for the fixed-width numeric ones."""
    d = np.dtype(draw(st.sampled_from(_NP_SCALAR_DTYPES)))
    n = math.prod(shape)
    if d.kind in "SU":
        chars = st.characters(min_codepoint=1, max_codepoint=0x7F if d.kind == "S" else 0x2FFF,
                              exclude_categories=("Cs",))
        text = st.text(chars, max_size=d.itemsize // (4 if d.kind == "U" else 1))
        vals = [draw(text) for _ in range(n)]
        return np.array([v.encode() if d.kind == "S" else v for v in vals], dtype=d).reshape(shape)
    raw = draw(st.binary(min_size=n * d.itemsize, max_size=n * d.itemsize))
    if d.kind == "b":
        return np.frombuffer(raw, dtype=np.uint8).reshape(shape) != 0
    return np.frombuffer(raw, dtype=d).reshape(shape).copy()


def typed_values(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    """Any non-tensor value a batch may hold: JSON scalars, bytes, numpy scalars and arrays of any
    dtype trajstore keeps (object arrays of any shape included), tensors, and lists, tuples and dicts
    with str, int, tuple or None keys (``"$t"`` too) nested in each other."""
    keys = st.text(max_size=4) | st.just("$t") | st.integers(-5, 5) | st.none() | st.tuples(st.integers(0, 3))
    scalar_arrays = st.builds(lambda a: a[()], _np_arrays(()))
    leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6)
            | st.binary(max_size=6) | scalar_arrays
            | st.lists(st.integers(0, 3), max_size=2).map(tuple).flatmap(_np_arrays)
            | tensors((2,), [torch.float32, torch.bfloat16, torch.int64]))

    def extend(children: st.SearchStrategy) -> st.SearchStrategy:
        def obj_array(items: list) -> np.ndarray:
            a = np.empty(len(items), dtype=object)
            for i, x in enumerate(items):
                a[i] = x
            return a.reshape((len(items) // 2, 2)) if len(items) % 2 == 0 and items else a

        return (st.lists(children, max_size=3) | st.lists(children, max_size=3).map(tuple)
                | st.dictionaries(keys, children, max_size=3) | st.lists(children, max_size=4).map(obj_array))

    return st.recursive(leaf, extend, max_leaves=max_leaves)


def _object_array(vals: list) -> np.ndarray:
    a = np.empty(len(vals), dtype=object)
    for i, v in enumerate(vals):
        a[i] = v
    return a


@st.composite
def typed_batches(draw: st.DrawFn, max_batch: int = 4, dataproto: bool = False) -> Any:
    """Batches whose non-tensor fields hold ``typed_values``: per trajectory (object arrays of one and
    two dimensions, lists, datetime64 / bytes / str arrays of any shape), batch-wide values, and
    with ``dataproto``, sometimes the ``meta_info`` of a DataProto-like batch (format/batch/containers.py)."""
    B = draw(st.integers(1, max_batch))
    vals = st.lists(typed_values(), min_size=B, max_size=B)
    batch: dict[str, Any] = {"rewards": draw(tensors((B,), [torch.float32])),
                             "nt": _object_array(draw(vals)), "lst": draw(vals),
                             "arr": draw(st.sampled_from([(B,), (B, 2), (B, 1, 2)]).flatmap(_np_arrays)),
                             "wide": draw(st.dictionaries(st.integers(0, 3), typed_values(), min_size=1, max_size=3)
                                          | st.binary(max_size=4)), "scalar": draw(st.builds(lambda a: a[()], _np_arrays(())))}
    obj2 = np.empty((B, 2), dtype=object)
    for i, v in enumerate(draw(st.lists(typed_values(), min_size=2 * B, max_size=2 * B))):
        obj2.reshape(-1)[i] = v
    batch["nt2"] = obj2
    if not dataproto or not draw(st.booleans()):
        return batch
    meta = draw(st.dictionaries(st.text(max_size=4) | st.integers(0, 3), typed_values(), max_size=3))
    return DataProtoLike(batch=None, non_tensor_batch={k: v for k, v in batch.items() if isinstance(v, np.ndarray)
                                                       and v.ndim and len(v) == B}, meta_info=meta)
# ----------------------------------------------------------------------------- several masks
def _padded_values(draw: st.DrawFn, mask: torch.Tensor, dtypes: Sequence[torch.dtype]) -> torch.Tensor:
    """A tensor shaped like ``mask`` of arbitrary bits whose padded positions hold one pad value, or (sometimes)
    values of their own (non-constant padding)."""
    x = draw(tensors(tuple(mask.shape), dtypes))
    if draw(st.booleans()):
        pad = draw(tensors((), [x.dtype]))
        x = torch.where(mask, x, pad)
    return x


def _run_mask(draw: st.DrawFn, B: int, W: int, side: str) -> torch.Tensor:
    """A [B, W] bool mask with one run of tokens per row, right / left aligned or anywhere."""
    ar = torch.arange(W)
    rows = []
    for _ in range(B):
        n = draw(st.integers(0, W))
        start = {"right": 0, "left": W - n}.get(side) if side != "span" else draw(st.integers(0, W - n))
        rows.append((ar >= start) & (ar < start + n))
    return torch.stack(rows) if rows else torch.zeros(0, W, dtype=torch.bool)


@st.composite
def two_sided_batches(draw: st.DrawFn, max_batch: int = 5) -> dict[str, Any]:
    """verl-style generation output: ``prompts`` [B, P] left-padded, ``responses`` [B, R]
    right-padded, ``attention_mask`` [B, P + R] padded on both sides (sometimes with holes), the
    ``response_mask`` and per-token [B, R] fields of the response part."""
    B, P, R = draw(st.integers(0, max_batch)), draw(st.integers(1, 7)), draw(st.integers(1, 9))
    pm, rm = _run_mask(draw, B, P, "left"), _run_mask(draw, B, R, "right")
    am = torch.cat([pm, rm], 1)
    if B and draw(st.integers(0, 5)) == 0:  # a mask with holes: stored whole
        am[0] = draw(tensors((P + R,), [torch.bool]))
    mdt = draw(st.sampled_from([torch.int64, torch.int32, torch.bool]))
    ids = _padded_values(draw, am, [torch.int64, torch.int32])
    out: dict[str, Any] = {"prompts": ids[:, :P], "responses": ids[:, P:], "response_mask": rm.to(mdt),
                           "input_ids": ids, "attention_mask": am.to(mdt),
                           "position_ids": torch.clamp(am.long().cumsum(1) - 1, min=0)}
    if draw(st.booleans()):  # Qwen2-VL mrope: [B, 4, P + R], token axis last
        out["position_ids"] = _padded_values(draw, am[:, None].expand(B, 4, P + R), [torch.int64])
    for name in draw(st.lists(st.sampled_from(["old_log_probs", "advantages", "ref_log_prob"]),
                              unique=True, max_size=3)):
        out[name] = _padded_values(draw, rm, [torch.float32, torch.bfloat16, torch.float16])
    out["token_level_rewards"] = _padded_values(draw, rm, [torch.float32])
    return out


@st.composite
def prompt_completion_batches(draw: st.DrawFn, max_batch: int = 5) -> dict[str, Any]:
    """TRL-style ``_generate_and_score_completions`` output: ``prompt_ids`` / ``prompt_mask``
    left-padded [B, P], ``completion_ids`` / ``completion_mask`` right-padded [B, C] (the mask
    sometimes a span or with holes), per-token [B, C] logps, no ``attention_mask``."""
    B, P = draw(st.integers(0, max_batch)), draw(st.integers(1, 7))
    C = draw(st.integers(1, 9).filter(lambda c: c != P))
    pm = _run_mask(draw, B, P, draw(st.sampled_from(["left", "right", "span"])))
    cm = _run_mask(draw, B, C, draw(st.sampled_from(["right", "right", "span"])))
    if B and draw(st.integers(0, 5)) == 0:
        cm[-1] = draw(tensors((C,), [torch.bool]))
    out: dict[str, Any] = {"prompt_ids": _padded_values(draw, pm, [torch.int64]),
                           "prompt_mask": pm.to(torch.int64),
                           "completion_ids": _padded_values(draw, cm, [torch.int64, torch.int32]),
                           "completion_mask": cm.to(draw(st.sampled_from([torch.int64, torch.int32, torch.bool])))}
    for name in draw(st.lists(st.sampled_from(["old_per_token_logps", "ref_per_token_logps",
                                               "sampling_per_token_logps"]), unique=True, max_size=3)):
        out[name] = _padded_values(draw, cm, [torch.float32, torch.bfloat16])
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


def batches() -> st.SearchStrategy[Any]:
    """Any batch form trajstore accepts."""
    return st.one_of(padded_batches(), trajectory_lists(), group_lists(), packed_batches(), multimodal_batches(),
                     non_tensor_batches(), typed_batches(), two_sided_batches(), prompt_completion_batches(),
                     image_batches())


# ----------------------------------------------------------------------------- comparison
def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def assert_batch_equal(a: Any, b: Any, path: str = "batch") -> None:
    """Assert ``a`` and ``b`` are the same structure with bit-identical contents."""
    assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if all(hasattr(a, k) for k in ("batch", "non_tensor_batch", "meta_info")) and not isinstance(a, Mapping):
        for k in ("batch", "non_tensor_batch", "meta_info"):  # a DataProto-like batch
            assert_batch_equal(getattr(a, k), getattr(b, k), f"{path}.{k}")
    elif hasattr(a, "batch_size") and hasattr(a, "to_dict"):  # a TensorDict
        assert list(a.batch_size) == list(b.batch_size), f"{path}: batch_size {a.batch_size} != {b.batch_size}"
        assert_batch_equal(dict(a.items()), dict(b.items()), path)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        ac, bc = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
        assert torch.equal(bits_view(ac), bits_view(bc)), f"{path}: values differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        if a.dtype == object:
            for i, (x, y) in enumerate(zip(a.reshape(-1), b.reshape(-1))):
                assert_batch_equal(x, y, f"{path}[{i}]")
        else:
            assert a.tobytes() == b.tobytes(), f"{path}: values differ"
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, Mapping):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_batch_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_batch_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert _float_bits(a) == _float_bits(b) or (math.isnan(a) and math.isnan(b)), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
