"""Precision check across parallel layouts, on CPU with gloo (docs/PRECISION.md).

A run is dumped on 4 ranks (uneven shards, 3 + 9 + 5 + 7 = 24 trajectories a step): each rank records
its rollout batch and the trainer's outputs for it (per-token logprobs, per-sample loss, entropy,
values; the step's loss and grad-norm reduced over the ranks). The dump is then replayed on 2 ranks,
token-balanced, which record their outputs into a dump of their own, each row with the trajectory id
of the row it came from. ``trajstore.diff`` compares the two runs' outputs by trajectory id.

    python examples/precision.py WORKDIR                   # identical: exit 0
    python examples/precision.py WORKDIR --perturb 1e-3    # entropy moved on every third trajectory: exit 1

The trainer here is a stand-in whose numbers depend only on each trajectory's own tokens (exact
float64 sums cast to float32), as a batch-invariant trainer's would: any difference is the layout's.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import trajstore

STEPS = (0, 1, 2)
SIZES = (3, 9, 5, 7)  # the 4 dumping ranks' trajectories of a step


def rollout(step: int, rank: int, n: int) -> dict:
    """Rank ``rank``'s rollouts of ``step``: ``n`` right-padded sequences of 1..9 tokens."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    lens = torch.randint(1, 10, (n,), generator=g)
    mask = torch.arange(int(lens.max()))[None, :] < lens[:, None]
    return {"input_ids": torch.randint(0, 1000, mask.shape, generator=g).masked_fill(~mask, 0),
            "attention_mask": mask.to(torch.int64)}


def train_step(batch: dict) -> tuple[dict, dict]:
    """Per-trajectory outputs and the step's scalars (reduced over the ranks) of one rank's batch."""
    m = batch["attention_mask"].bool()
    tok = batch["input_ids"].to(torch.float64)
    logprobs = (-(tok % 97) / 128).masked_fill(~m, 0)
    loss = -logprobs.sum(1) / 64
    out = {"logprobs": logprobs.to(torch.float32), "attention_mask": batch["attention_mask"],
           "loss": loss.to(torch.float32), "entropy": ((tok % 13) / 16).masked_fill(~m, 0).sum(1).to(torch.float32),
           "values": (tok[:, 0] / 1024).to(torch.float32)}
    sums = torch.stack([loss.sum(), (loss * loss).sum(), torch.tensor(float(len(loss)), dtype=torch.float64)])
    if dist.is_initialized():
        dist.all_reduce(sums)  # exact: sums of dyadic numbers in float64, in any order
    return out, {"loss": float(sums[0] / sums[2]), "grad_norm": float(sums[1].sqrt())}


def _init(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def dump_rank(rank: int, world: int, port: int, path: str) -> None:
    """One rank of the baseline run: dump its rollouts (split ``train``) and its outputs (``outputs``)."""
    _init(rank, world, port)
    with trajstore.Recorder(dump=True, path=path, strict=True) as rec:
        for s in STEPS:
            batch = rec.batch(s, lambda s=s: rollout(s, rank, SIZES[rank]))
            outputs, scalars = train_step(batch)
            rec.record(s, outputs, split="outputs", meta=scalars)
    dist.destroy_process_group()


def replay_rank(rank: int, world: int, port: int, path: str, runs: list[tuple[str, float]]) -> None:
    """One rank of the changed layout: replay its token-balanced slice and record its outputs, once per
    ``(out, perturb)`` of ``runs``, in ``out`` (``perturb``: added to ``entropy`` of the trajectories
    whose logical row is a multiple of 3)."""
    _init(rank, world, port)
    for out, perturb in runs:
        with trajstore.Recorder(replay=True, path=path, balance="tokens", outputs=out) as rec:
            for s in STEPS:
                batch = rec.batch(s, lambda: sys.exit("replay never samples"))
                outputs, scalars = train_step(batch)
                if perturb:
                    rows = torch.from_numpy(rec.ids(s)[:, 1])
                    outputs["entropy"][rows % 3 == 0] += perturb
                rec.record(s, outputs, split="outputs", meta=scalars)
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def spawn(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, port, *args)`` on ``world`` processes; raise if one fails."""
    ctx = mp.start_processes(fn, args=(world, _port(), *args), nprocs=world, join=False, start_method="spawn")
    while not ctx.join():
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workdir", help="where the two runs go (created)")
    ap.add_argument("--perturb", type=float, default=0.0, help="move entropy of every third trajectory by this")
    ap.add_argument("--atol", type=float, default=0.0)
    a = ap.parse_args(argv)
    base, replay = Path(a.workdir) / "base", Path(a.workdir) / "replay"
    spawn(dump_rank, 4, str(base))
    spawn(replay_rank, 2, str(base), [(str(replay), a.perturb)])
    rep = trajstore.diff(base, replay, split="outputs", atol=a.atol)
    for name, f in rep.fields().items():
        print(f"{name:12s} {f['status']:9s} max abs {f['max_abs']}")
    for e in rep.entries:
        if e.status not in ("identical", "close"):
            print(f"step {e.step} {e.field}: {e.status}, worst at {e.worst and e.worst.get('id')}, "
                  f"{len(e.beyond)} trajectories beyond tolerance")
    print("identical" if rep.identical else "within tolerance" if rep.ok else "differs")
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
