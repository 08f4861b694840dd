"""The dumps the browser tests of ``trajstore view`` open (tests/test_view_browser.py), and what the pages
should show, computed here from ``trajstore.Reader`` alone (never from trajstore.view).

``view_dump``: split ``train`` (right-padded; steps 0, 1, 2, 4, 5, step 3 recorded as skipped; a float32
``old_logprobs`` and a bfloat16 ``rollout_logprobs``, per-token ``versions``, multi-turn loss masks, text
fields, trajectory ``XSS_INDEX`` of every step is the ``PAYLOAD`` as its completion text and tokens),
split ``ranks`` (2 SPMD shards a step, step ``INCOMPLETE`` of rank 0 only),
split ``packed`` (``cu_seqlens``, no mask) and split ``long`` (one trajectory of ``LONG`` tokens).
``diff_dumps``: two small dumps equal but for one logprob (``PLANT``) and the rewards of step ``PLANT_REWARDS``."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

import trajstore
import _dumps
from _dumps import CORPUS
from trajstore.store import commit

PAYLOAD = "<script>alert(1)</script><img src=x onerror=alert(1)>"
PROMPT = "Repeat exactly: "
XSS_INDEX = 2
STEPS, SKIPPED, INCOMPLETE = [0, 1, 2, 4, 5], 3, 2
B, LONG = 6, 16384
PLANT = {"step": 2, "field": "old_logprobs", "index": 1, "token": None, "delta": 0.25}  # token: 3rd response token
PLANT_REWARDS = 3  # b's rewards of this step differ too: a second field that differs, after the first
PAIR = ("old_logprobs", "rollout_logprobs")  # the first pair of the viewer's list that the dump has
PALETTE = ["rgb(255, 255, 255)", "rgb(198, 219, 239)", "rgb(158, 202, 225)", "rgb(107, 174, 214)",
           "rgb(66, 146, 198)", "rgb(33, 113, 181)", "rgb(8, 81, 156)", "rgb(8, 48, 107)"]
MASKED = "rgb(235, 235, 235)"


def make_tokenizer(tmp: Path) -> Path:
    """A byte-level BPE trained here on the test corpus and the payload (nothing downloaded)."""
    return _dumps.make_tokenizer(tmp, (PROMPT + PAYLOAD,))


def _turns(tok, g: torch.Generator, i: int) -> list[tuple[int, list[int]]]:
    """(loss mask, ids) runs of trajectory ``i``: a prompt, then 1 or 2 model turns with a tool reply."""
    def pick() -> list[int]:
        return tok.encode(CORPUS[int(torch.randint(len(CORPUS), (1,), generator=g))]).ids

    if i == XSS_INDEX:
        return [(0, tok.encode(PROMPT).ids), (1, tok.encode(PAYLOAD).ids)]
    runs = [(0, pick()), (1, pick())]
    if i % 2:
        runs += [(0, pick()), (1, pick())]
    return runs


def _padded_step(tok, s: int) -> dict:
    g = torch.Generator().manual_seed(100 + s)
    trajs = [_turns(tok, g, i) for i in range(B)]
    T = max(sum(len(r) for _, r in t) for t in trajs) + 3
    ids = torch.zeros(B, T, dtype=torch.int64)
    am = torch.zeros(B, T, dtype=torch.bool)
    lm = torch.zeros(B, T, dtype=torch.int32)
    ver = torch.zeros(B, T, dtype=torch.int32)
    for i, t in enumerate(trajs):
        pos, v = 0, 10 + s - int(torch.randint(3, (1,), generator=g))
        for k, (m, run) in enumerate(t):
            n = len(run)
            ids[i, pos:pos + n] = torch.tensor(run)
            am[i, pos:pos + n] = True
            lm[i, pos:pos + n] = m
            ver[i, pos:pos + n] = v + (k >= 2)  # the second model turn comes from the next policy
            pos += n
    old = -torch.rand(B, T, generator=g) * 3
    old = torch.where(am, old, torch.zeros(()))
    rollout = (old + torch.randn(B, T, generator=g) * 0.05).clamp(max=0).to(torch.bfloat16)
    rollout = torch.where(am, rollout, torch.zeros((), dtype=torch.bfloat16))
    texts = [PAYLOAD if i == XSS_INDEX else tok.decode(ids[i][lm[i] == 1].tolist()) for i in range(B)]
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm, "old_logprobs": old,
            "rollout_logprobs": rollout, "versions": ver,
            "rewards": torch.randn(B, generator=g) + s / 2, "kl": torch.rand(B, generator=g) / 10,
            "uid": [f"s{s}-t{i}" for i in range(B)], "completion": texts}


def view_dump(path: Path, tok_path: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    with trajstore.Writer(path) as w:
        for s in STEPS:
            w.append(s, _padded_step(tok, s), meta={"lr": 1e-6})
    assert commit.record_skipped(path / "train", SKIPPED, "No space left on device")
    for rank in (0, 1):  # split "ranks": two SPMD shards a step; rank 1 never wrote step INCOMPLETE
        with trajstore.Writer(path, split="ranks", rank=rank, world_size=2) as w:
            for s in range(INCOMPLETE + 1 - rank):
                w.append(s, _padded_step(tok, 10 * s + rank))
    with trajstore.Writer(path, split="packed") as w:
        for s in range(4):
            g = torch.Generator().manual_seed(200 + s)
            lens = torch.randint(5, 40, (4,), generator=g)
            n = int(lens.sum())
            w.append(s, {"cu_seqlens": torch.cat([torch.zeros(1), lens.cumsum(0)]).to(torch.int32),
                         "input_ids": torch.randint(1, 400, (n,), generator=g),
                         "logprobs": -torch.rand(n, generator=g), "rewards": torch.rand(4, generator=g)})
    g = torch.Generator().manual_seed(300)
    T = LONG + 16
    lens = [LONG, 300]
    am = torch.arange(T)[None, :] < torch.tensor(lens)[:, None]
    lm = (am & (torch.arange(T)[None, :] >= 384)).to(torch.int32)
    with trajstore.Writer(path, split="long") as w:
        w.append(0, {"input_ids": torch.randint(1, 400, (2, T), generator=g).masked_fill(~am, 0),
                     "attention_mask": am, "loss_mask": lm,
                     "old_logprobs": (-torch.rand(2, T, generator=g)).masked_fill(~am, 0),
                     "versions": torch.full((2, T), 7, dtype=torch.int32).masked_fill(~am, 0),
                     "rewards": torch.tensor([0.5, -0.5])})


def diff_dumps(a: Path, b: Path, tok_path: Path) -> dict:
    """Two dumps of steps 0..3, equal but for ``PLANT`` (``old_logprobs`` of one response token of one
    trajectory) and the rewards of step ``PLANT_REWARDS``. Returns ``PLANT`` with its token."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    for path, planted in ((a, False), (b, True)):
        with trajstore.Writer(path) as w:
            for s in range(4):
                batch = _padded_step(tok, s)
                if planted and s == PLANT["step"]:
                    j = int(batch["loss_mask"][PLANT["index"]].nonzero()[2])
                    batch[PLANT["field"]][PLANT["index"], j] += PLANT["delta"]
                if planted and s == PLANT_REWARDS:
                    batch["rewards"] = batch["rewards"] + 1
                w.append(s, batch)
    return {**PLANT, "token": j}


# -- what the pages should show, from the reader

def rows(batch: dict) -> list[dict]:
    """Each trajectory's own tokens: {field: 1-D float64/int64 numpy array} for the per-token fields
    (padding removed), plus the per-trajectory numbers, whatever the layout."""
    if "cu_seqlens" in batch:
        cu = batch["cu_seqlens"].tolist()
        sl = [slice(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
        tok = {k: v for k, v in batch.items() if torch.is_tensor(v) and v.dim() == 1 and len(v) == cu[-1]}
        out = [{k: v[s].double().numpy() if v.is_floating_point() else v[s].long().numpy()
                for k, v in tok.items()} for s in sl]
    else:
        am = batch["attention_mask"].bool()
        tok = {k: v for k, v in batch.items() if torch.is_tensor(v) and v.shape == am.shape}
        out = [{k: v[i][am[i]].double().numpy() if v.is_floating_point() else v[i][am[i]].long().numpy()
                for k, v in tok.items()} for i in range(am.shape[0])]
    for i, r in enumerate(out):
        r["reward"] = float(batch["rewards"][i])
        mask = r.get("loss_mask")
        r["length"] = int(mask.sum()) if mask is not None else len(r["input_ids"])
    return out


def step_stats(batch: dict) -> dict:
    """The run page's metrics for one step (the definitions of docs and trajstore/view/data.py)."""
    rs = rows(batch)
    rew = np.array([r["reward"] for r in rs])
    lens = np.array([r["length"] for r in rs], dtype=np.float64)
    out = {"reward_mean": rew.mean(), "reward_std": rew.std(), "reward_min": rew.min(), "reward_max": rew.max(),
           "length_mean": lens.mean(), "length_p95": float(np.percentile(lens, 95)),
           "tokens": sum(len(r["input_ids"]) for r in rs)}
    if "versions" in rs[0]:
        resp = [r["versions"][r["loss_mask"] == 1] for r in rs]
        top = max(int(v.max()) for v in resp if len(v))
        out["version_lag"] = max(top - int(v.min()) for v in resp if len(v))
    if all(p in rs[0] for p in PAIR):
        d = np.concatenate([np.abs(r[PAIR[0]] - r[PAIR[1]])[r["loss_mask"] == 1] for r in rs])
        out["logprob_mismatch"] = d.mean()
    return out


def curves(path: Path, split: str) -> dict[str, tuple[list[int], list[float]]]:
    """metric -> (steps, values) of ``split``, as the run page should plot them."""
    r = trajstore.Reader(path, split)
    per = {s: step_stats(r[s]) for s in r.steps}
    names = next(iter(per.values())).keys()
    return {m: (list(per), [per[s][m] for s in per]) for m in names}


def js_round(x: float) -> int:
    return math.floor(x + 0.5)


def colour(mode: str, mask: int, lp: float | None, other: float | None, v: int | None, maxv: int | None,
           top: float | None = None) -> str:
    """The background colour a token should have (the viewer's documented formula); ``top``: the
    largest ``|lp - other|`` of the trajectory's loss-mask tokens (the diff colouring's scale)."""
    if mask == 0:
        return MASKED
    if mode == "logprob" and lp is not None:
        p = min(max(math.exp(lp), 0.0), 1.0)
        return f"rgb(255, {js_round(255 * p)}, {js_round(255 * p)})"
    if mode == "diff" and lp is not None and other is not None and top:
        d = min(abs(lp - other), top) / top
        return f"rgb(255, {js_round(255 * (1 - d))}, {js_round(255 * (1 - d))})"
    if mode == "version" and v is not None and maxv is not None:
        return PALETTE[(maxv - v) % 8]
    return "rgb(255, 255, 255)"
