"""Small fixed batches of every form trajstore stores, for the reader matrix (test_readers.py) and the
independent spec reader (test_spec_reader.py), each with the columns a Parquet reader should see:
``(label, kind, path, part, expected)`` where ``path`` names the field in the spec, ``part`` the
column of its node (``col``, ``pad_col``, ``shape_col``, ``start_col``) and ``expected`` the column's
rows as :func:`norm` gives them -- bf16 / fp16 as their real numbers (issue 13)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch


def norm(v: Any) -> Any:
    """A value read by any reader, in one comparable form: floats by their exact bits (``-0.0`` and
    ``0.0`` differ, ints and floats differ), arrays as lists, numpy scalars as Python values."""
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return ("f", float(v).hex())
    if isinstance(v, torch.Tensor):
        return norm(v.float().tolist() if v.dtype in (torch.bfloat16, torch.float16) else v.tolist())
    if isinstance(v, (np.ndarray, list, tuple)):
        return [norm(x) for x in v]
    if isinstance(v, dict):
        return {k: norm(x) for k, x in v.items()}
    if type(v).__name__ == "Decimal":  # Spark's uint64
        return int(v)
    return v


def rows(x: torch.Tensor, mask: torch.Tensor | None = None, valid: bool = True) -> list:
    """Row i of ``x`` (its positions where ``mask`` is ``valid``), flattened."""
    out = []
    for i in range(x.shape[0]):
        r = x[i] if mask is None else x[i][mask[i].bool() == valid]
        out.append(norm(r.reshape(-1)))
    return out


def _runs(lengths: list[int], W: int, side: str, starts: list[int] | None = None) -> torch.Tensor:
    ar = torch.arange(W)
    L = torch.tensor(lengths)[:, None]
    if side == "right":
        return ar[None, :] < L
    if side == "left":
        return ar[None, :] >= W - L
    S = torch.tensor(starts)[:, None]
    return (ar[None, :] >= S) & (ar[None, :] < S + L)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _noisy_pad(x: torch.Tensor, m: torch.Tensor, seed: int) -> torch.Tensor:
    """Padded positions holding different values (stored in a ``__pad__`` companion)."""
    return torch.where(m, x, torch.randn(x.shape, generator=_g(seed)).to(x.dtype))


def padded() -> tuple[Any, list]:
    B, T, m = 3, 6, _runs([4, 1, 6], 6, "right")
    ids = torch.randint(0, 150_000, (B, T), generator=_g(1)).masked_fill(~m, 7)
    lp = _noisy_pad(torch.randn(B, T, generator=_g(2)), m, 3)
    bf = torch.randn(B, T, generator=_g(4)).to(torch.bfloat16).masked_fill(~m, 0.0)
    bfp = _noisy_pad(torch.randn(B, T, generator=_g(5)).to(torch.bfloat16), m, 6)
    i32 = torch.randint(-99, 99, (B, T), generator=_g(7), dtype=torch.int32).masked_fill(~m, -1)
    u8 = torch.randint(0, 250, (B, T), generator=_g(8), dtype=torch.uint8).masked_fill(~m, 255)
    i16 = torch.randint(-999, 999, (B, T), generator=_g(9), dtype=torch.int16).masked_fill(~m, 0)
    lm = (torch.randint(0, 2, (B, T), generator=_g(10)).bool() & m)
    batch = {"input_ids": ids, "attention_mask": m, "logprobs": lp, "lp_bf16": bf, "old_bf16": bfp,
             "ids32": i32, "flags_u8": u8, "pos_i16": i16, "loss_mask": lm,
             "rewards": torch.tensor([1.5, -0.25, 3.0]), "adv": torch.tensor([0.1, 0.2, -0.3], dtype=torch.float64),
             "counts": torch.tensor([3, -4, 5]), "done": torch.tensor([True, False, True]),
             "topk": torch.tensor([[1, 2], [3, 4], [5, -6]], dtype=torch.int16),
             "rew_bf16": torch.tensor([0.5, -1.25, 2.0], dtype=torch.bfloat16),
             "prompt": ["a", "bé", "c"], "score_i": [1, 0, 1], "score_f": [1.0, 0.5, 0.0],
             "flag": [True, False, True], "info": [{"a": 1}, [1, 2], "x"], "uid": ["u0", None, "u2"],
             "pair": [(1, 2), (3,), ()], "temperature": 0.7}
    cells = [
        ("int64 token", "input_ids", "col", rows(ids, m)), ("bool token (mask)", "attention_mask", "col", rows(m, m)),
        ("fp32 token", "logprobs", "col", rows(lp, m)), ("fp32 pad companion", "logprobs", "pad_col", rows(lp, m, False)),
        ("bf16 token", "lp_bf16", "col", rows(bf, m)), ("bf16 token", "old_bf16", "col", rows(bfp, m)),
        ("bf16 pad companion", "old_bf16", "pad_col", rows(bfp, m, False)),
        ("int32 token", "ids32", "col", rows(i32, m)), ("uint8 token", "flags_u8", "col", rows(u8, m)),
        ("int16 token", "pos_i16", "col", rows(i16, m)), ("bool token", "loss_mask", "col", rows(lm, m)),
        ("fp32 sample", "rewards", "col", norm(batch["rewards"])), ("fp64 sample", "adv", "col", norm(batch["adv"])),
        ("int64 sample", "counts", "col", norm(batch["counts"])), ("bool sample", "done", "col", norm(batch["done"])),
        ("int16 sample [B,k]", "topk", "col", norm(batch["topk"])), ("bf16 sample", "rew_bf16", "col", norm(batch["rew_bf16"])),
        ("str value", "prompt", "col", batch["prompt"]), ("int value (a float64 column, FORMAT.md 3.3 num)", "score_i", "col",
                                                 norm([float(x) for x in batch["score_i"]])),
        ("float value", "score_f", "col", norm(batch["score_f"])), ("bool value", "flag", "col", batch["flag"]),
        ("json value", "info", "col", ("json", batch["info"])), ("str value with None", "uid", "col", batch["uid"]),
        ("typed (tjson) value", "pair", "col", ("json", [{"$t": "tuple", "v": list(p)} for p in batch["pair"]])),
    ]
    return batch, cells


def half() -> tuple[Any, list]:
    """fp16 fields apart, so that a reader refusing FLOAT16 does not hide the other cells."""
    m = _runs([2, 5, 0], 5, "left")
    h = torch.randn(3, 5, generator=_g(11)).half().masked_fill(~m, 0.0)
    hp = _noisy_pad(torch.randn(3, 5, generator=_g(12)).half(), m, 13)
    s = torch.tensor([0.5, -2.0, 65504.0], dtype=torch.float16)
    batch = {"input_ids": torch.arange(15).reshape(3, 5) * m, "attention_mask": m.long(), "lp16": h, "old16": hp, "r16": s}
    return batch, [("fp16 token", "lp16", "col", rows(h, m)), ("fp16 pad companion", "old16", "pad_col", rows(hp, m, False)),
                   ("fp16 sample", "r16", "col", norm(s))]


def two_sided() -> tuple[Any, list]:
    """verl's generation output: prompts left-padded, responses right-padded (masked form, a span)."""
    P, R = 4, 5
    pm, rm = _runs([2, 4, 1], P, "left"), _runs([3, 0, 5], R, "right")
    am = torch.cat([pm, rm], 1)
    ids = torch.randint(1, 1000, (3, P + R), generator=_g(14)).masked_fill(~am, 0)
    olp = torch.randn(3, R, generator=_g(15)).to(torch.bfloat16).masked_fill(~rm, 0.0)
    batch = {"prompts": ids[:, :P], "responses": ids[:, P:], "response_mask": rm.long(), "input_ids": ids,
             "attention_mask": am.long(), "position_ids": torch.clamp(am.long().cumsum(1) - 1, min=0),
             "old_log_probs": olp}
    starts = [(am[i].long().argmax().item() if am[i].any() else 0) for i in range(3)]
    return batch, [("int64 token (span)", "input_ids", "col", rows(ids, am)),
                   ("span start", ("masks", ""), "start_col", starts),
                   ("int64 token (prompt part)", "prompts", "col", rows(ids[:, :P], pm)),
                   ("bf16 token (response part)", "old_log_probs", "col", rows(olp, rm)),
                   ("int64 pad companion (span)", "position_ids", "pad_col", rows(batch["position_ids"], am, False))]


def several_masks() -> tuple[Any, list]:
    """TRL: prompt_ids / prompt_mask left-padded, completion_ids / completion_mask right-padded."""
    pm, cm = _runs([3, 1, 2], 3, "left"), _runs([4, 2, 0], 4, "right")
    pids = torch.randint(0, 99, (3, 3), generator=_g(16)).masked_fill(~pm, 0)
    cids = torch.randint(0, 99, (3, 4), generator=_g(17), dtype=torch.int32).masked_fill(~cm, 0)
    lp = torch.randn(3, 4, generator=_g(18)).masked_fill(~cm, 0.0)
    batch = {"prompt_ids": pids, "prompt_mask": pm.long(), "completion_ids": cids, "completion_mask": cm.long(),
             "old_per_token_logps": lp, "advantages": torch.tensor([0.5, -0.5, 0.0])}
    return batch, [("int64 token (prompt mask)", "prompt_ids", "col", rows(pids, pm)),
                   ("int32 token (completion mask)", "completion_ids", "col", rows(cids, cm)),
                   ("fp32 token (completion mask)", "old_per_token_logps", "col", rows(lp, cm)),
                   ("fp32 sample", "advantages", "col", norm(batch["advantages"]))]


def _packed(lengths: list[int], seed: int) -> tuple[dict, list]:
    N = sum(lengths)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    ids = torch.randint(0, 999, (N,), generator=_g(seed))
    lp = torch.randn(N, generator=_g(seed + 1)).to(torch.bfloat16)
    rew = torch.tensor([1.0, 2.0, 3.0][:len(lengths)])
    split = lambda x: [norm(x[a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]  # noqa: E731
    batch = {"input_ids": ids, "logprobs": lp, "cu_seqlens": cu, "rewards": rew}
    return batch, [("int64 token (packed)", "input_ids", "col", split(ids)),
                   ("bf16 token (packed)", "logprobs", "col", split(lp)), ("fp32 sample", "rewards", "col", norm(rew)),
                   ("int32 cu_seqlens ends (packed)", "cu_seqlens", "col", norm(cu[1:]))]


def packed() -> tuple[Any, list]:
    return _packed([3, 0, 2], 19)


def packed_n_eq_b() -> tuple[Any, list]:
    """N == B: rewards [B] must still read as one number per trajectory."""
    batch, cells = _packed([2, 0, 1], 21)
    return batch, [c if c[1] != "rewards" else ("fp32 sample (N == B)", *c[1:]) for c in cells]


def trajectory_list() -> tuple[Any, list]:
    """A list of per-trajectory dicts with a None slot: cells with their ``__shape__`` companions."""
    out: list = []
    for i, T in enumerate([3, None, 2]):
        if T is None:
            out.append(None)
            continue
        out.append({"input_ids": torch.randint(0, 99, (1, T), generator=_g(22 + i), dtype=torch.int32),
                    "attention_mask": torch.ones(1, T, dtype=torch.bool),
                    "logprobs": torch.randn(1, T, generator=_g(30 + i)).to(torch.bfloat16),
                    "rewards": torch.tensor([float(i)]), "uid": f"t{i}"})
    cell = lambda k: [None if d is None else norm(d[k].reshape(-1)) for d in out]  # noqa: E731
    return out, [("int32 cell (None slot)", ("*", "input_ids"), "col", cell("input_ids")),
                 ("cell shape companion", ("*", "input_ids"), "shape_col",
                  [None if d is None else list(d["input_ids"].shape) for d in out]),
                 ("bf16 cell", ("*", "logprobs"), "col", cell("logprobs")),
                 ("str value (None slot)", ("*", "uid"), "col", [None if d is None else d["uid"] for d in out])]


def holes() -> tuple[Any, list]:
    """A mask with holes: the fields are stored whole, at the padded width."""
    m = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    ids = torch.arange(12).reshape(3, 4)
    return {"input_ids": ids, "attention_mask": m}, [("int64 whole rows (holes)", "input_ids", "col", rows(ids))]


def tensordict_batch() -> tuple[Any, list]:
    from tensordict import TensorDict

    batch, cells = padded()
    td = TensorDict({k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}, batch_size=[3])
    return td, [c for c in cells if c[1] in td.keys()]


def dataproto() -> tuple[Any, list]:
    from tensordict import TensorDict

    from trajstore.format.batch.containers import DataProtoLike

    batch, cells = padded()
    td = TensorDict({k: batch[k] for k in ("input_ids", "attention_mask", "lp_bf16", "rewards")}, batch_size=[3])
    uid = np.array(["a", "b", "c"], dtype=object)
    extra = np.empty(3, dtype=object)
    for i, v in enumerate([{"k": 1}, {"k": 2.5}, {}]):
        extra[i] = v
    dp = DataProtoLike(batch=td, non_tensor_batch={"uid": uid, "extra": extra}, meta_info={"temperature": 1.0})
    return dp, [c for c in cells if c[1] in td.keys()] + [("str value (non_tensor_batch)", "uid", "col", list(uid)),
                                                           ("json value (non_tensor_batch)", "extra", "col", ("json", list(extra)))]


FORMS = {"padded": padded, "half": half, "two_sided": two_sided, "several_masks": several_masks, "packed": packed,
         "packed_n_eq_b": packed_n_eq_b, "list": trajectory_list, "holes": holes, "tensordict": tensordict_batch,
         "dataproto": dataproto}


def locate(spec: dict, path: Any, part: str) -> str:
    """The column name of ``part`` of the field at ``path`` in a step's spec (docs/FORMAT.md 3.7):
    a batch key (``"a.b"`` for nested groups), ``("*", key)`` for a key of a list's elements,
    ``("masks", key)`` for a mask group."""
    node = spec["batch"]
    if isinstance(path, tuple) and path[0] == "masks":
        return next(g for g in node["masks"] if g["key"] == path[1])[part]
    for name in (path[1:] if isinstance(path, tuple) else path.split(".")):
        node = dict((node["elem"] if "elem" in node else node)["keys"])[name]
    while part not in node and "elem" in node:
        node = node["elem"]  # a per-trajectory list of values: the column is its element's
    return node[part]


def assert_column(got: list, expected: Any, what: str) -> None:
    """``got`` (a column's rows as a reader returned them) is exactly ``expected`` (a cell's)."""
    if isinstance(expected, tuple) and expected[0] == "json":  # JSON text: compare the parsed values
        got, expected = [None if s is None else norm(json.loads(s)) for s in got], norm(expected[1])
    else:
        got = norm(list(got))
    assert got == expected, f"{what}: read {got!r}, the spec promises {expected!r}"


