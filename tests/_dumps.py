"""Small real dumps and a real tokenizer (trained here from text, nothing downloaded) for the
inspection tests (CLI, traces, diff, SQL), the small padded batch of the API tests, and the
write-then-read set-up the tests share (``write``, ``roundtrip``, ``encoded``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

import trajstore


def write(path: str | Path, steps: Mapping[int, Any], *, split: str = "train", meta: Any = None,
          **writer_kw: Any) -> trajstore.Reader:
    """Append ``steps`` (``{step: batch}``, in that order) to split ``split`` of the dump at ``path``,
    close the writer, and open that split for reading."""
    with trajstore.Writer(path, split=split, **writer_kw) as w:
        for s, batch in steps.items():
            w.append(s, batch, meta=meta)
    return trajstore.Reader(path, split)


def encoded(batch: Any, layout: str | None = None, masks: Mapping | None = None) -> tuple[Any, dict, Any]:
    """``batch`` encoded as one step's Arrow table (``masks`` declared as to ``Writer``), its description
    checked against the table as a reader checks a file, and decoded in ``layout``: ``(decoded, doc, table)``."""
    import json

    from trajstore import schema
    from trajstore.format.file import validate

    t = schema.encode_plain(batch, None, step=0, split="train", masks=masks)
    doc = json.loads(t.schema.metadata[b"trajstore"])
    validate.check(doc, t.schema, t.num_rows, "x")
    return schema.decode(t, doc["batch"], where="x", layout=layout), doc, t


def many_row_groups(mp: Any) -> None:
    """With the pytest ``MonkeyPatch`` ``mp``: every step written from now on is split into row
    groups, and read as one chunk per row group (so joins and fill jobs see several chunks)."""
    from trajstore.format.file import parquet

    mp.setattr(parquet, "ROW_GROUP_BYTES", 1)
    mp.setattr(parquet, "PARALLEL_READ_BYTES", 0)


@contextlib.contextmanager
def serial_thread():
    """Inside the block this thread decodes serially, as a deep prefetch's thread does (``Reader.iter`` from
    prefetch 4: columns joined in a few calls, ``Columns._combined``)."""
    from trajstore.base import threads

    threads.serial()
    try:
        yield
    finally:
        threads.serial(False)


def on_cuda_equal(cpu: Any, gpu: Any) -> None:
    """``gpu`` (a batch read to CUDA: all its tensors there) equals ``cpu`` bit for bit."""
    from trajstore.device import bridge
    from trajstore.testing import assert_batch_equal

    leaves = bridge._leaves(gpu)
    if any(t.is_cuda for t in leaves):
        assert all(t.is_cuda for t in leaves)
        torch.cuda.synchronize()
    assert_batch_equal(cpu, bridge.map_tensors(gpu, lambda t: t.cpu()))


def cuda_replay_equals_cpu(batch: Any, layout: str | None, prefetch: int) -> None:
    """``batch`` written as steps 0-2, replayed to CUDA (``Reader.iter`` on a consumer stream that is not the
    default one, and ``read(device=...)``), equals its CPU read bit for bit (nothing where the layout does not
    apply)."""
    with tempfile.TemporaryDirectory() as d:
        with trajstore.Writer(d) as w:
            for s in range(3):
                w.append(s, batch)
        r = trajstore.Reader(d)
        try:
            cpu = r.read(0, layout=layout)
        except trajstore.ConfigError:
            return
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            got = list(r.iter(device="cuda", prefetch=prefetch, layout=layout))
        s.synchronize()
        assert [k for k, _ in got] == [0, 1, 2]
        for _, b in got:
            on_cuda_equal(cpu, b)
        on_cuda_equal(cpu, r.read(0, layout=layout, device="cuda"))


def read_as(d: str | Path, batch: Any, layout: str | None) -> tuple[trajstore.Reader, Any] | None:
    """``batch`` written as step 0 of a dump at ``d``: its reader and the step read in ``layout``, or None where the
    batch has no such layout to convert to."""
    r = write(d, {0: batch})
    try:
        return r, r.read(0, layout=layout)
    except trajstore.ConfigError:
        return None


def roundtrip(batch: Any, meta: Any = None, step: int = 3) -> tuple[Any, Any]:
    """``batch`` (and ``meta``) written as step ``step`` of a fresh temporary dump and read back."""
    with tempfile.TemporaryDirectory() as d:
        r = write(d, {step: batch}, meta=meta)
        assert r.steps == [step]
        return r[step], r.meta(step)


def small_batch(B=3, T=5, seed=0, logprobs=True):
    """A right-padded dict batch: input_ids, attention_mask, (logprobs,) rewards."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    m = torch.arange(T)[None, :] < lengths[:, None]
    out = {"input_ids": torch.randint(0, 1000, (B, T), generator=g).masked_fill(~m, 0), "attention_mask": m}
    if logprobs:
        out["logprobs"] = torch.randn(B, T, generator=g).masked_fill(~m, 0.0)
    out["rewards"] = torch.randn(B, generator=g)
    return out


CORPUS = [
    "What is 2 + 3? Think step by step.",
    "The answer is 5. Let me check with the calculator.",
    "calculator(2 + 3) = 5",
    "Confirmed: 2 + 3 = 5, so the final answer is 5.",
    "Write a haiku about autumn leaves.",
    "Red leaves drift and fall / the wind hums a quiet song / winter waits nearby",
    "Translate 'bonjour' to English: hello — ça va? naïve café",
    "def add(a, b):\n    return a + b\n",
]

# multi-turn conversations: (role, text); "model" turns carry loss-mask 1
CONVERSATIONS = [
    [("prompt", "What is 2 + 3? Think step by step."),
     ("model", " The answer is 5. Let me check with the calculator."),
     ("env", "\ncalculator(2 + 3) = 5\n"),
     ("model", "Confirmed: 2 + 3 = 5, so the final answer is 5.")],
    [("prompt", "Write a haiku about autumn leaves."),
     ("model", "\nRed leaves drift and fall / the wind hums a quiet song / winter waits nearby")],
    [("prompt", "Translate 'bonjour' to English:"),
     ("model", " hello — ça va? naïve café")],
]
REWARDS = [1.0, 0.5, -0.25]


def make_tokenizer(tmp: Path, extra: tuple[str, ...] = ()) -> Path:
    """Train a byte-level BPE on CORPUS (and ``extra`` texts), save it as tmp/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<pad>"])
    tok.train_from_iterator(list(CORPUS) + list(extra), trainer)
    path = tmp / "tokenizer.json"
    tok.save(str(path))
    return path


def encode_conversation(tok, conv) -> tuple[list[int], list[int], list[int]]:
    """ids, loss mask, policy version (3 for the first model turn, 4 after) of one conversation."""
    ids, mask, ver = [], [], []
    turn = 0
    for role, text in conv:
        e = tok.encode(text).ids
        ids += e
        mask += [1 if role == "model" else 0] * len(e)
        if role == "model":
            turn += 1
        ver += [3 if turn <= 1 else 4] * len(e)
    return ids, mask, ver


def padded_dump(path: Path, tok_path: Path, steps=(0, 1, 2), perturb=None, pad_side="right") -> dict:
    """A dict-of-padded-tensors dump of CONVERSATIONS at each step; ``perturb=(step, traj, token, delta)``
    adds ``delta`` to one logprob. Returns what was written, for checks."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    enc = [encode_conversation(tok, c) for c in CONVERSATIONS]
    B, T = len(enc), max(len(e[0]) for e in enc) + 2
    written = {}
    with trajstore.Writer(path) as w:
        for s in steps:
            ids = torch.zeros(B, T, dtype=torch.int64)
            am = torch.zeros(B, T, dtype=torch.bool)
            lm = torch.zeros(B, T, dtype=torch.int32)
            ver = torch.full((B, T), -1, dtype=torch.int32)
            g = torch.Generator().manual_seed(1000 + s)
            lp = -torch.rand(B, T, generator=g)
            for i, (e, m, v) in enumerate(enc):
                n = len(e)
                sl = slice(0, n) if pad_side == "right" else slice(T - n, T)
                ids[i, sl] = torch.tensor(e)
                am[i, sl] = True
                lm[i, sl] = torch.tensor(m, dtype=torch.int32)
                ver[i, sl] = torch.tensor(v, dtype=torch.int32) + s
            lp = torch.where(am, lp, torch.zeros(()))
            old_lp = lp.clone()  # the trainer's recomputation: equal unless perturbed
            if perturb and perturb[0] == s:
                _, i, t, d = perturb
                pos = (0 if pad_side == "right" else T - len(enc[i][0])) + t
                lp[i, pos] += d
            rewards = torch.tensor(REWARDS, dtype=torch.float32) + s
            batch = {"input_ids": ids, "attention_mask": am, "loss_mask": lm, "logprobs": lp,
                     "old_logprobs": old_lp, "versions": ver, "rewards": rewards,
                     "uid": [f"s{s}-t{i}" for i in range(B)]}
            w.append(s, batch, meta={"lr": 1e-6})
            written[s] = batch
    return written


def list_dump(path: Path, tok_path: Path, steps=(0, 1), split="train") -> dict:
    """A list-of-trajectories dump (prompt_ids / response_ids) with a rejected (None) one per step."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    written = {}
    with trajstore.Writer(path, split=split) as w:
        for s in steps:
            batch = []
            for i, conv in enumerate(CONVERSATIONS[1:]):
                p = tok.encode(conv[0][1]).ids
                c = tok.encode(conv[1][1]).ids
                batch.append({"prompt_ids": torch.tensor(p, dtype=torch.int32),
                              "response_ids": torch.tensor(c, dtype=torch.int32),
                              "logprobs": -torch.arange(len(c), dtype=torch.float32) / 10,
                              "reward": float(i + s), "policy_version": s})
            batch.insert(1, None)
            w.append(s, batch)
            written[s] = batch
    return written



def check_inspection(dump: Path, per_step: list[int], capsys: Any) -> None:
    """Every inspection tool on ``dump`` (steps 0, 1, ... holding ``per_step`` trajectories each) counts
    them right: ``info`` rows, ``show`` of the last trajectory, ``export`` lines, ``diff`` of the dump
    with itself (CLI and ``trajstore.diff``), ``sql`` counts per step. Runs in-process (``cli.run``)."""
    import json

    from trajstore.cli import run as cli_run

    last = len(per_step) - 1
    assert cli_run(["info", str(dump), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["splits"]["train"]["rows"] == sum(per_step)
    assert cli_run(["show", str(dump), "--step", str(last), "--sample", str(per_step[-1] - 1), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["index"] == per_step[-1] - 1
    assert cli_run(["export", str(dump)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == sum(per_step)
    assert cli_run(["diff", str(dump), str(dump)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "identical"
    assert trajstore.diff(dump, dump).identical
    assert cli_run(["sql", str(dump), "SELECT step, count(*) AS n FROM train GROUP BY step ORDER BY step",
                    "--format", "json"]) == 0
    assert [json.loads(x)["n"] for x in capsys.readouterr().out.splitlines()] == per_step

def run_python(code: str, *args: Any) -> None:
    """Run ``code`` in a fresh Python process (the repository on its path, ``args`` as ``sys.argv[1:]``)
    and assert it printed ``ok`` and nothing failed: a replay in another process than the dump."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def cli() -> list[str]:
    """The installed console script."""
    exe = Path(sys.executable).parent / "trajstore"
    found = str(exe) if exe.exists() else shutil.which("trajstore")
    assert found, "the trajstore console script is not installed (pip install -e .)"
    return [found]


CLI_ENV = {"NO_COLOR": "1", "COLUMNS": "200"}  # plain text, wide enough that no table is stacked


def run(*args, check_rc: int | None = 0, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, **CLI_ENV, **(env or {})}
    p = subprocess.run(cli() + [str(a) for a in args], capture_output=True, text=True, env=env, **kw)
    if check_rc is not None:
        assert p.returncode == check_rc, f"rc {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


def run_here(*args, check_rc: int | None = 0) -> subprocess.CompletedProcess:
    """``run`` in this process (``trajstore.cli.run`` with its output captured, the same
    environment): for tests that run many commands once the console script itself is covered."""
    import contextlib
    import io
    from unittest import mock

    from trajstore import cli

    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, CLI_ENV), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.run([str(a) for a in args])
    p = subprocess.CompletedProcess(["trajstore", *map(str, args)], rc, out.getvalue(), err.getvalue())
    if check_rc is not None:
        assert p.returncode == check_rc, f"rc {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


def in_forked_child(target, *args, what: str = "its work"):
    """What ``target(*args, queue)`` puts on the queue, run in a forked child (a DataLoader-style
    worker); the child must end, with status 0, within a minute."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
        p.join()
    assert p.exitcode == 0, f"the child hung or failed {what}"
    return q.get(timeout=5)


def clone(x):
    """A deep copy of a batch (tensors, arrays, object arrays, containers)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, np.ndarray):
        if x.dtype != object:
            return x.copy()
        out = np.empty(x.shape, dtype=object)
        for i, v in enumerate(x.reshape(-1)):
            out.reshape(-1)[i] = clone(v)
        return out
    if isinstance(x, dict):
        return {k: clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clone(v) for v in x]
    if isinstance(x, tuple):
        return tuple(clone(v) for v in x)
    return x


@contextlib.contextmanager
def int64_tokens():
    """``conftest.int64_tokens`` for a block (inside a hypothesis test, which takes no function fixture)."""
    from trajstore.format import arrow

    before, arrow.NARROW_TOKENS = arrow.NARROW_TOKENS, False
    try:
        yield
    finally:
        arrow.NARROW_TOKENS = before
