"""``benchmarks/ranks.py`` (the many-ranks benchmark of benchmarks/RESULTS.md) runs its write and replay phases with
real processes over gloo on the CPU (``--cpu``), and its replay checks each rank's slice against the rows trajstore's
partition gives the rank, contiguous or token-balanced: a slice that is not those rows makes it exit 1. No time is
asserted."""

import json
import os
import sys
from pathlib import Path

import torch.multiprocessing as mp
from _browser import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import ranks  # noqa: E402

ARGS = ["--steps", "2", "--batch", "8", "--max-len", "64", "--cpu", "--passes", "1"]


def _rank(rank: int, world: int, port: int, argv: list[str], out: str, wrong: bool) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if wrong:  # the benchmark's check (not the reader) takes the contiguous rows whatever the balance
        real = ranks.partition
        ranks.partition = lambda B, M, how, counts=None, what="": real(B, M, "contiguous")
    rc = ranks.main(argv)
    Path(f"{out}.{rank}").write_text(str(rc))


def _run(world: int, argv: list[str], out: Path, wrong: bool = False) -> list[int]:
    mp.start_processes(_rank, args=(world, free_port(), argv, str(out), wrong), nprocs=world, start_method="spawn")
    return [int(Path(f"{out}.{k}").read_text()) for k in range(world)]


def test_the_ranks_benchmark_writes_and_checks_every_slice(tmp_path, capfd):
    d = str(tmp_path / "d")
    assert _run(2, ["write", "--dump", d, *ARGS], tmp_path / "w") == [0, 0]
    for balance in ("contiguous", "tokens"):
        assert _run(2, ["replay", "--dump", d, "--dumped", "2", "--balance", balance, *ARGS],
                    tmp_path / f"r{balance}") == [0, 0]
    lines = [json.loads(x) for x in capfd.readouterr().out.splitlines() if x.startswith("{")]
    assert [(x["phase"], x.get("balance"), x.get("bit-exact")) for x in lines] == [
        ("write", None, None), ("replay", "contiguous", True), ("replay", "tokens", True)]
    # a check that took the contiguous rows of a token-balanced slice finds the difference
    assert _run(2, ["replay", "--dump", d, "--dumped", "2", "--balance", "tokens", *ARGS], tmp_path / "bad",
                wrong=True) == [1, 1]
