"""Per-step statistics of a whole dump with Ray Data: reward mean, response length mean and max, and
the mismatch between the trainer's and the rollout engine's log-probabilities, for every step.

    pip install 'trajstore[ray]'
    python examples/ray_stats.py DUMP                        # local Ray, fields of trajstore's test dumps
    python examples/ray_stats.py DUMP --address auto         # on a running Ray cluster
    python examples/ray_stats.py dumps/demo                  # rl_loop.py's dump: its response_mask by default
    python examples/ray_stats.py DUMP --reward token_level_scores --tokens responses \\
        --mask response_mask --logprobs old_log_probs --rollout-logprobs rollout_log_probs   # a verl dump

It prints one line per step (``--json``: one JSON object per line):

* ``reward_mean``: the mean over the step's trajectories of ``--reward`` (a per-trajectory value, or a
  per-token one, summed over the trajectory's tokens);
* ``length_mean`` / ``length_max``: a trajectory's length: the tokens where its per-token ``--mask``
  is nonzero (default: the first of ``loss_mask``, ``response_mask``, ``completion_mask``,
  ``action_mask`` the dump has, as ``trajstore view``), or with ``--mask none`` (or no such field)
  all its tokens of ``--tokens``;
* ``mismatch_mean`` / ``mismatch_max``: ``|logprobs - rollout_logprobs|`` over those tokens, the mean
  over all of the step's tokens (each token weighs the same) and the largest.

How it runs: ``trajstore.ray.read_dump`` reads only the fields named (one read task per step file),
each trajectory is reduced to a few numbers where it was read (``map_batches``), and only those are
grouped by step (``groupby("step").map_groups``). Within a step the trajectories are taken in their
order in the batch, so the figures do not depend on how Ray scheduled the work. Steps without
trajectories do not appear. The group-by moves a few numbers per trajectory, so it uses Ray Data's
sort-based shuffle (tasks), not its default hash shuffle, whose aggregator actors take seconds to start
and hold CPUs of the cluster (on 2 cores, a small dump: 0.6-1.0 s against 5-8 s for the group-by).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

# the trajstore of the checkout this example is in (as examples/demo.py does); Ray's workers get it too
CHECKOUT = str(Path(__file__).resolve().parent.parent)
if not (Path(CHECKOUT) / "trajstore" / "__init__.py").is_file():
    CHECKOUT = None  # a copy of the example: the installed trajstore
else:
    sys.path.insert(0, CHECKOUT)
import trajstore  # noqa: E402
import trajstore.ray  # noqa: E402

STATS = ["step", "trajectories", "reward_mean", "length_mean", "length_max", "tokens", "mismatch_mean",
         "mismatch_max"]


def per_trajectory(batch: dict[str, np.ndarray], reward: str, tokens: str, mask: str | None,
                   pair: tuple[str, str] | None) -> dict[str, np.ndarray]:
    """A block of trajectories -> one row of sums per trajectory (rejected ones left out)."""
    keep = np.flatnonzero(~np.asarray(batch["rejected"], dtype=bool))
    out: dict[str, list] = {"step": [], "order": [], "reward": [], "length": [], "mismatch_sum": [],
                            "mismatch_max": []}
    rank = batch.get("rank")
    for i in keep:
        toks = np.asarray(batch[tokens][i])
        m = np.ones(len(toks), dtype=bool) if mask is None else np.asarray(batch[mask][i]) != 0
        r = np.asarray(batch[reward][i], dtype=np.float64)
        out["step"].append(int(batch["step"][i]))
        # (rank, index): the trajectory's place in the logical batch, also for a step dumped in shards
        out["order"].append((0 if rank is None else int(rank[i])) * 2**32 + int(batch["index"][i]))
        out["reward"].append(float(r.sum()) if r.ndim else float(r))
        out["length"].append(int(m.sum()))
        if pair is not None:
            d = np.abs(np.asarray(batch[pair[0]][i], dtype=np.float64) - np.asarray(batch[pair[1]][i], np.float64))[m]
            out["mismatch_sum"].append(float(d.sum()))
            out["mismatch_max"].append(float(d.max()) if d.size else 0.0)
        else:
            out["mismatch_sum"].append(np.nan)
            out["mismatch_max"].append(np.nan)
    return {k: np.array(v, dtype=np.float64 if k in ("reward", "mismatch_sum", "mismatch_max") else np.int64)
            for k, v in out.items()}


def per_step(group: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One step's trajectories (in any order) -> its statistics, computed in the batch's order."""
    o = np.argsort(group["order"], kind="stable")
    reward, length = group["reward"][o], group["length"][o]
    msum, mmax = group["mismatch_sum"][o], group["mismatch_max"][o]
    tokens = int(length.sum())
    stats = {"step": int(group["step"][0]), "trajectories": len(o), "reward_mean": float(np.mean(reward)),
             "length_mean": float(np.mean(length)), "length_max": int(length.max()), "tokens": tokens,
             "mismatch_mean": float(np.sum(msum) / tokens) if tokens else float("nan"),
             "mismatch_max": float(np.max(mmax)) if tokens else float("nan")}
    return {k: np.array([v]) for k, v in stats.items()}


def step_stats(path: str, split: str | None = None, *, reward: str = "rewards", tokens: str = "input_ids",
               mask: str | None = None, logprobs: str | None = "old_logprobs",
               rollout_logprobs: str | None = "logprobs", num_partitions: int | None = None,
               **read_args: Any) -> list[dict[str, Any]]:
    """The statistics of every step of ``split`` of the dump at ``path``, sorted by step (Ray must be
    initialized, or is started locally). ``logprobs`` or ``rollout_logprobs`` None: no mismatch
    (``mismatch_*`` are NaN). ``num_partitions``: of the group-by's shuffle (default: the number of steps, at most 200);
    ``read_args`` go to ``trajstore.ray.read_dump``."""
    pair = (logprobs, rollout_logprobs) if logprobs and rollout_logprobs else None
    fields = list(dict.fromkeys(f for f in (reward, tokens, mask, *(pair or ())) if f))
    ds = trajstore.ray.read_dump(path, split, columns=fields, **read_args)
    small = ds.map_batches(per_trajectory, batch_size=None, batch_format="numpy",
                           fn_kwargs={"reward": reward, "tokens": tokens, "mask": mask, "pair": pair})
    if num_partitions is None:  # no more shuffle partitions than steps
        num_partitions = max(1, min(200, len(trajstore.Reader(path, split).steps)))
    from ray.data import DataContext
    from ray.data.context import ShuffleStrategy

    ctx = DataContext.get_current()
    was = ctx.shuffle_strategy
    ctx.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED  # (module doc)
    try:
        out = small.groupby("step", num_partitions=num_partitions).map_groups(per_step, batch_format="numpy")
        rows = out.take_all()
    finally:
        ctx.shuffle_strategy = was
    return sorted(({k: v.item() if hasattr(v, "item") else v for k, v in r.items()} for r in rows),
                  key=lambda r: r["step"])


MASKS = ("loss_mask", "response_mask", "completion_mask", "action_mask")  # trajstore view's order (docs/CLI.md)


def default_mask(path: str, split: str | None = None) -> str | None:
    """The response mask of the dump's newest step (the first of ``MASKS`` among its fields), else None:
    lengths and the mismatch are then the response's, not the whole trajectory's."""
    r = trajstore.Reader(path, split)
    if not r.steps:
        return None
    names = {k for k, _ in r.info(r.steps[-1])["batch"].get("keys", ())}  # a dict batch's fields
    return next((m for m in MASKS if m in names), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump", help="the dump's path (or URL)")
    ap.add_argument("--split", default=None, help="default: train, else the dump's only split")
    ap.add_argument("--reward", default="rewards", help="per-trajectory (or per-token) reward field")
    ap.add_argument("--tokens", default="input_ids", help="per-token field whose length is a trajectory's")
    ap.add_argument("--mask", default=None, help="per-token mask the length and mismatch count (default: the "
                    f"first of {', '.join(MASKS)} the dump has, as trajstore view; none: every token)")
    ap.add_argument("--logprobs", default="old_logprobs", help="the trainer's per-token log-probabilities")
    ap.add_argument("--rollout-logprobs", default="logprobs", help="the rollout engine's")
    ap.add_argument("--no-mismatch", action="store_true", help="the dump has no pair of log-probabilities")
    ap.add_argument("--address", default=None, help="a Ray cluster to use (ray.init's address, e.g. auto); default: "
                    "$RAY_ADDRESS, else a new Ray on this machine")
    ap.add_argument("--num-cpus", type=int, default=None, help="CPUs of the new Ray on this machine")
    ap.add_argument("--json", action="store_true", help="one JSON object per step")
    a = ap.parse_args()
    mask = default_mask(a.dump, a.split) if a.mask is None else None if a.mask == "none" else a.mask
    import ray

    address = a.address or os.environ.get("RAY_ADDRESS") or "local"  # "local": a new Ray on this machine
    kw: dict[str, Any] = {}
    if address == "local":
        kw["num_cpus"] = a.num_cpus
        if CHECKOUT:
            kw["runtime_env"] = {"env_vars": {"PYTHONPATH": os.pathsep.join(
                filter(None, [CHECKOUT, os.environ.get("PYTHONPATH")]))}}
    ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False, **kw)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        rows = step_stats(a.dump, a.split, reward=a.reward, tokens=a.tokens, mask=mask,
                          logprobs=None if a.no_mismatch else a.logprobs,
                          rollout_logprobs=None if a.no_mismatch else a.rollout_logprobs)
    finally:
        ray.shutdown()
    for r in rows:
        if a.json:
            print(json.dumps(r))
        else:
            print(f"step {r['step']:>6}  trajectories {r['trajectories']:>5}  reward {r['reward_mean']:+.4f}  "
                  f"length {r['length_mean']:.1f} (max {r['length_max']})  "
                  f"logprob mismatch {r['mismatch_mean']:.3e} (max {r['mismatch_max']:.3e})")


if __name__ == "__main__":
    main()
