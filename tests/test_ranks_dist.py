"""Issue 14's acceptance for ranks, with real processes and torch.distributed (gloo, CPU): 4 writer
ranks dump shards of the same steps (uneven: 3 + 9 + 5 + 7 = 24 trajectories), a rank killed mid-step
leaves no half step, and the dump is replayed on 1, 2, 3 and 8 processes, through the Reader and through
``Recorder.batch``. Every check runs in the processes themselves; a failure there fails the test."""

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trajstore  # noqa: E402
import trajstore.write.writer  # noqa: E402  (the package root loads its modules lazily)
from test_ranks import (SIZES, logical_trajectories, same, shard_batch, token_partition,  # noqa: E402
                        trajectories)

STEPS = (0, 1)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _dump(rank: int, world: int, port: int, path: str, die: int | None, recorder: bool) -> None:
    _init(rank, world, port)
    if rank == die:  # killed while committing step 1: its temporary is written, the shard never appears
        trajstore.write.writer.commit.commit = lambda *a, **k: os._exit(7) if "00000001" in str(a[1]) else _commit(*a, **k)
    if recorder:
        with trajstore.Recorder(dump=True, path=path) as rec:
            assert rec.split == "train"
            for s in STEPS:
                rec.batch(s, lambda s=s: shard_batch(s, rank, SIZES[rank]))
    else:
        with trajstore.Writer(path, rank=dist.get_rank(), world_size=dist.get_world_size()) as w:
            for s in STEPS:
                w.append(s, shard_batch(s, rank, SIZES[rank]))
    dist.destroy_process_group()


_commit = trajstore.write.writer.commit.commit


def _replay(rank: int, world: int, port: int, path: str, recorder: bool) -> None:
    _init(rank, world, port)
    for balance in ("contiguous", "tokens"):
        if recorder:
            rec = trajstore.Recorder(replay=True, path=path, balance=balance, prefetch=True)
            got = {s: rec.batch(s, lambda: pytest.fail("replay called fn")) for s in STEPS}
            rec.close()
        else:
            r = trajstore.Reader(path, rank=rank, world_size=world, balance=balance)
            assert r.steps == list(STEPS)
            got = dict(r.iter())
        for s in STEPS:
            logical = logical_trajectories(s)
            if world == 4 and balance == "contiguous":
                trajstore.testing.assert_batch_equal(got[s], shard_batch(s, rank, SIZES[rank]))
                continue
            if balance == "tokens":
                rows = token_partition([int(t["input_ids"].numel()) for t in logical], world)[rank]
            else:
                rows = range(rank * 24 // world, (rank + 1) * 24 // world)
            same(trajectories(got[s]), [logical[i] for i in rows])
    dist.destroy_process_group()


# the ranks are forked from a server that has imported torch and trajstore once (each spawned rank
# would import them anew: about a second and a half each on two cores)
mp.set_forkserver_preload(["torch", "trajstore", "trajstore.write.writer", "test_ranks", __name__])
START = "forkserver"


def _run(fn, world: int, *args) -> list[int]:
    ctx = mp.start_processes(fn, args=(world, _port(), *args), nprocs=world, join=False, start_method=START)
    while not ctx.join():
        pass
    return [p.exitcode for p in ctx.processes]


@pytest.mark.parametrize("recorder", [False, True], ids=["writer", "recorder"])
def test_four_ranks_dump_and_replay_on_any_world_size(tmp_path, recorder):
    path = str(tmp_path / "d")
    _run(_dump, 4, path, None, recorder)
    r = trajstore.Reader(path)
    assert r.steps == list(STEPS)
    for s in STEPS:
        same(trajectories(r[s]), logical_trajectories(s))  # the logical batch: the shards in rank order
    for m in (1, 2, 3, 8):
        _run(_replay, m, path, recorder)
    # the union of the slices is the logical batch, bit for bit (in this process, contiguous)
    for m in (1, 2, 3, 8):
        parts = [t for k in range(m) for t in trajectories(trajstore.Reader(path, rank=k, world_size=m)[1])]
        same(parts, logical_trajectories(1))
    assert trajstore.verify(path).ok


def test_a_rank_killed_mid_step_leaves_no_half_step(tmp_path):
    path = str(tmp_path / "d")
    ctx = mp.start_processes(_dump, args=(4, _port(), path, 2, False), nprocs=4, join=False, start_method=START)
    for p in ctx.processes:
        p.join(120)
    assert [p.exitcode for p in ctx.processes] == [0, 0, 7, 0]
    r = trajstore.Reader(path)
    assert r.steps == [0]
    with pytest.raises(trajstore.StepNotFoundError, match=r"rank\(s\) 2 are not committed"):
        r[1]
    rep = trajstore.verify(path)
    assert rep.ok and list(rep.incomplete) == [("train", 1)]
    assert len(list((Path(path) / "train").glob("step_00000001.*"))) == 3  # the others' shards are committed
    same(trajectories(r[0]), logical_trajectories(0))
