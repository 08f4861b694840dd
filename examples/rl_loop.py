"""A small but real RL loop (GRPO-style) with a dump/replay switch.

A tiny causal transformer learns to reverse strings ("abc=" -> "cba<eos>").  Each step:

* rollout: sample G responses of variable length for each of P prompts (temperature 1,
  stop at <eos>; the policy never emits <pad>, <bos> or "="), keep each sampled token's
  log-probability, score them with a rule reward (characters in the right place, a bonus
  for the exact answer);
* train: group-relative advantages, then PPO-clip updates against the recorded
  log-probabilities; print the step's loss and grad-norm.

    python examples/rl_loop.py --dump /tmp/run      # records every step's rollout batch
    python examples/rl_loop.py --replay /tmp/run    # the sampler is never constructed

Each step's batch: input_ids, attention_mask, response_mask [B, T] (right-padded), old_logprobs
(float32, the sampler's), logprobs (bf16, the trainer's recomputation), rewards, group, prompt and
response (str); examples/tokenizer.json decodes input_ids.

Both print the same lines (per-step loss and grad-norm as exact float reprs, then a digest
of the final weights): the replay is bit-identical.  examples/demo.py runs both and compares.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import random
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import trajstore

PAD, BOS, EOS, SEP = 0, 1, 2, 3
LETTERS = "abcdefgh"
VOCAB = 4 + len(LETTERS)


def encode(s: str) -> list[int]:
    return [4 + LETTERS.index(c) for c in s]


def decode(ids: list[int]) -> str:
    return "".join(LETTERS[i - 4] if i >= 4 else "" for i in ids)


# ----------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / (D // self.heads) ** 0.5
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, max_len: int = 32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB)
        self.register_buffer("never", torch.tensor([PAD, BOS, SEP]), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        # a policy never emits <pad>, <bos> or the prompt's "=": their logits are -inf for sampler and
        # trainer alike, so a sampled response is letters and <eos> only
        return self.head(self.ln(x)).index_fill(-1, self.never.to(ids.device), float("-inf"))


# ----------------------------------------------------------------------------- rollout
def prompts_for(step: int, n: int, seed: int) -> list[str]:
    rng = random.Random(seed * 1_000_003 + step)
    return ["".join(rng.choice(LETTERS[:5]) for _ in range(rng.randint(2, 5))) for _ in range(n)]


def reward(prompt: str, response: str, finished: bool) -> float:
    target = prompt[::-1]
    hits = sum(a == b for a, b in zip(response, target))
    r = hits / len(target) - 0.1 * max(0, len(response) - len(target))
    return r + (1.0 if finished and response == target else 0.0)


class Sampler:
    """The 'inference engine': samples responses from the current policy weights."""

    def __init__(self, model: TinyLM, seed: int, device: torch.device, max_new: int = 7):
        self.model, self.device, self.max_new = model, device, max_new
        self.gen = torch.Generator(device=device).manual_seed(seed)

    @torch.no_grad()
    def rollout(self, prompts: list[str], group: int) -> dict:
        by_len: dict[int, list[int]] = {}  # prompts of one length are sampled together
        for gi, p in enumerate(prompts):
            by_len.setdefault(len(p), []).append(gi)
        done_rows = {}
        for _, gis in sorted(by_len.items()):
            prompt_ids = [[BOS] + encode(prompts[gi]) + [SEP] for gi in gis]
            P = len(prompt_ids[0])
            ids = torch.tensor([x for x in prompt_ids for _ in range(group)], device=self.device)
            n = ids.shape[0]
            logps = torch.zeros(n, 0, device=self.device)
            done = torch.zeros(n, dtype=torch.bool, device=self.device)
            for _ in range(self.max_new):
                logp = F.log_softmax(self.model(ids)[:, -1].float(), -1)
                tok = torch.multinomial(logp.exp(), 1, generator=self.gen).squeeze(1)
                tok = torch.where(done, torch.full_like(tok, PAD), tok)
                lp = torch.where(done, torch.zeros_like(tok, dtype=logp.dtype), logp.gather(1, tok[:, None])[:, 0])
                ids, logps = torch.cat([ids, tok[:, None]], 1), torch.cat([logps, lp[:, None]], 1)
                done |= tok == EOS
                if bool(done.all()):
                    break
            ids_l, logps_c = ids.tolist(), logps.cpu()
            for r in range(n):
                gi = gis[r // group]
                resp = ids_l[r][P:]
                m = resp.index(EOS) + 1 if EOS in resp else len(resp)
                done_rows[(gi, r % group)] = (ids_l[r][:P], resp[:m], logps_c[r, :m], prompts[gi],
                                              decode(resp[:m]), EOS in resp[:m], gi)
        rows = [done_rows[k] for k in sorted(done_rows)]
        T = max(len(r[0]) + len(r[1]) for r in rows)
        B = len(rows)
        input_ids = torch.full((B, T), PAD, dtype=torch.int64)
        attention_mask = torch.zeros(B, T, dtype=torch.int64)
        response_mask = torch.zeros(B, T, dtype=torch.int64)
        old_logprobs = torch.zeros(B, T, dtype=torch.float32)
        for i, (prompt, resp, lp, *_rest) in enumerate(rows):
            P, R = len(prompt), len(resp)
            input_ids[i, :P + R] = torch.tensor(prompt + resp)
            attention_mask[i, :P + R] = 1
            response_mask[i, P:P + R] = 1
            old_logprobs[i, P:P + R] = lp
        # the trainer's log-probs of the same tokens, one forward over the whole batch, kept in bf16 as a
        # bf16 trainer has them: `trajstore diff --pair logprobs old_logprobs` shows the engine/trainer gap
        ids = input_ids.to(self.device)
        lp = F.log_softmax(self.model(ids[:, :-1]).float(), -1).gather(-1, ids[:, 1:, None])[..., 0].cpu()
        logprobs = torch.zeros(B, T, dtype=torch.bfloat16)
        logprobs[:, 1:] = torch.where(response_mask[:, 1:].bool(), lp, 0.0).to(torch.bfloat16)
        return {
            "input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask,
            "old_logprobs": old_logprobs, "logprobs": logprobs,
            "rewards": torch.tensor([reward(r[3], r[4], r[5]) for r in rows], dtype=torch.float32),
            "group": torch.tensor([r[6] for r in rows], dtype=torch.int64),
            "prompt": [r[3] for r in rows], "response": [r[4] for r in rows],
        }


# ----------------------------------------------------------------------------- training
def group_advantages(rewards: torch.Tensor, group: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    n = int(group.max()) + 1
    count = torch.zeros(n, device=rewards.device).index_add_(0, group, torch.ones_like(rewards))
    mean = torch.zeros(n, device=rewards.device).index_add_(0, group, rewards) / count
    var = torch.zeros(n, device=rewards.device).index_add_(0, group, (rewards - mean[group]) ** 2) / count
    return (rewards - mean[group]) / (var[group].sqrt() + eps)


def train_step(model: TinyLM, opt: torch.optim.Optimizer, batch: dict, device, epochs: int = 2,
               clip: float = 0.2) -> tuple[float, float]:
    ids = batch["input_ids"].to(device)
    mask = batch["response_mask"][:, 1:].to(device).float()
    old = batch["old_logprobs"][:, 1:].to(device)
    adv = group_advantages(batch["rewards"].to(device), batch["group"].to(device))[:, None]
    for _ in range(epochs):
        logp = F.log_softmax(model(ids[:, :-1]).float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        ratio = (logp - old).exp()
        obj = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
        loss = -(obj * mask).sum() / mask.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return loss.item(), gnorm.item()


def weights_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- main
def options(ap: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The loop's options besides the mode (examples/demo.py passes them on and checks them first)."""
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (the model is tiny: 1 is fastest)")
    ap.add_argument("--strict", action="store_true", help="environment differences at replay are errors")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="log each dumped/replayed step (trajstore INFO)")


def run(argv: list[str] | None = None, out=None) -> dict:
    """Run the loop; returns {"losses", "grad_norms", "digest", "batches"} (batch sha256 per step)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--dump", metavar="DIR", help="record every step's rollout batch in DIR")
    mode.add_argument("--replay", metavar="DIR", help="train from the batches recorded in DIR")
    options(ap)
    a = ap.parse_args(argv)
    out = out or sys.stdout
    if a.verbose:
        logging.getLogger("trajstore").setLevel(logging.INFO)
    torch.set_num_threads(a.threads)  # recorded in the fingerprint: a replay should use the same
    trajstore.deterministic(seed=a.seed)  # before any CUDA work; recorded in the dump's fingerprint
    device = torch.device(a.device)

    rec = trajstore.Recorder(trajstore.DumpReplayConfig(
        dump=a.dump is not None, replay=a.replay is not None, path=a.dump or a.replay,
        device=str(device), strict=a.strict, total_steps=a.steps))
    torch.manual_seed(a.seed)
    model = TinyLM().to(device)  # seeded init on CPU generator, identical for every device
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = None if rec.replaying else Sampler(model, a.seed + 1, device)

    res = {"losses": [], "grad_norms": [], "batches": []}
    with rec:
        for step in range(a.steps):
            batch = rec.batch(step, lambda: sampler.rollout(prompts_for(step, a.prompts, a.seed), a.group))
            loss, gnorm = train_step(model, opt, batch, device)
            res["losses"].append(loss)
            res["grad_norms"].append(gnorm)
            res["batches"].append(batch_digest(batch))
            if not a.quiet:
                mean_r = batch["rewards"].float().mean().item()
                print(f"step {step:3d} loss={loss!r} grad_norm={gnorm!r} reward={mean_r:.3f}", file=out)
    res["digest"] = weights_digest(model)
    if not a.quiet:
        print(f"final weights sha256={res['digest']}", file=out)
    return res


def batch_digest(batch: dict) -> str:
    h = hashlib.sha256()
    for k, v in batch.items():
        h.update(k.encode())
        if isinstance(v, torch.Tensor):
            h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(v).encode())
    return h.hexdigest()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        run()
    except trajstore.errors.TrajstoreError as e:  # a wrong --dump / --replay path: one line, not a traceback
        sys.exit(f"rl_loop.py: error: {e}")
