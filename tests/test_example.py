"""The example RL loop: dump -> replay is bit-identical (loss, grad-norm, final weights)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trajstore
from trajstore.base import fingerprint

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--steps", "3", "--prompts", "3", "--group", "4", "--quiet"]


@pytest.fixture(scope="module")
def example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("rl_loop_example", ROOT / "examples" / "rl_loop.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def _restore_global_state():
    det, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    applied, threads = fingerprint._applied, torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(det, warn_only=warn)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
    fingerprint._applied = applied


def no_sampler(monkeypatch, example):
    def boom(*a, **k):
        raise AssertionError("the sampler was constructed during replay")
    monkeypatch.setattr(example.Sampler, "__init__", boom)


def test_the_policy_never_samples_special_tokens(tmp_path, example):
    """A response is letters and at most one <eos>, last: no <pad>, <bos> or the prompt's "=" sampled
    (they would show in `trajstore show` and the viewer as padding leaking into the data)."""
    d = str(tmp_path / "dump")
    example.run(["--dump", d, "--steps", "2", "--prompts", "4", "--group", "8", "--quiet"])
    r = trajstore.Reader(d)
    n = 0
    for s in r.steps:
        b = r[s]
        for ids, m, text in zip(b["input_ids"], b["response_mask"].bool(), b["response"]):
            resp = ids[m].tolist()
            assert not {example.PAD, example.BOS, example.SEP} & set(resp), resp
            assert example.EOS not in resp[:-1] and example.decode(resp) == text
            n += len(resp)
    assert n > 64  # responses were sampled (an untrained policy: most are several tokens long)


def test_dump_then_replay_is_bit_identical(tmp_path, example, monkeypatch):
    d = str(tmp_path / "dump")
    a = example.run(["--dump", d] + SMALL)
    with monkeypatch.context() as m:
        no_sampler(m, example)
        b = example.run(["--replay", d] + SMALL)
    assert [x.hex() for x in a["losses"]] == [x.hex() for x in b["losses"]]
    assert [x.hex() for x in a["grad_norms"]] == [x.hex() for x in b["grad_norms"]]
    assert a["batches"] == b["batches"] and a["digest"] == b["digest"]
    assert trajstore.Reader(d).steps == [0, 1, 2]
    # the comparison can fail: a changed training step (one PPO epoch instead of two) shows up at once
    orig = example.train_step
    monkeypatch.setattr(example, "train_step", lambda model, opt, batch, device: orig(model, opt, batch, device,
                                                                                      epochs=1))
    with monkeypatch.context() as m:
        no_sampler(m, example)
        c = example.run(["--replay", d] + SMALL)
    assert c["batches"] == a["batches"] and c["digest"] != a["digest"]


def test_command_line_runs_print_identical_lines(tmp_path):
    """Two separate processes, as in examples/demo.sh."""
    d = str(tmp_path / "dump")
    args = ["--steps", "2", "--prompts", "2", "--group", "4"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = lambda *a: subprocess.run([sys.executable, str(ROOT / "examples" / "rl_loop.py"), *a, *args],  # noqa: E731
                                    capture_output=True, text=True, env=env, timeout=300)
    p1 = run("--dump", d)
    assert p1.returncode == 0, p1.stderr
    p2 = run("--replay", d)
    assert p2.returncode == 0, p2.stderr
    assert p1.stdout == p2.stdout and p1.stdout.count("\nstep") + p1.stdout.startswith("step") == 2
    assert "final weights sha256=" in p1.stdout
    assert "WARNING" not in p2.stderr  # same machine, same settings: no fingerprint difference


@pytest.mark.cuda
def test_cuda_dump_replays_bit_identical_on_cuda_and_runs_on_cpu(tmp_path, example, monkeypatch):
    d = str(tmp_path / "dump")
    a = example.run(["--dump", d, "--device", "cuda"] + SMALL)  # calls trajstore.deterministic()
    env = trajstore.Reader(d).manifest["environment"]
    assert env["device"] != "cpu" and env["backends"]["deterministic_algorithms"] is True
    with monkeypatch.context() as m:
        no_sampler(m, example)
        b = example.run(["--replay", d, "--device", "cuda", "--strict"] + SMALL)
    assert [x.hex() for x in a["losses"]] == [x.hex() for x in b["losses"]]
    assert [x.hex() for x in a["grad_norms"]] == [x.hex() for x in b["grad_norms"]]
    assert a["digest"] == b["digest"] and a["batches"] == b["batches"]
    # replay on CPU: the recorded batches come back exactly; the training math is the CPU's
    with monkeypatch.context() as m:
        no_sampler(m, example)
        c = example.run(["--replay", d, "--device", "cpu"] + SMALL)
    assert c["batches"] == a["batches"]
    assert all(math.isfinite(x) for x in c["losses"] + c["grad_norms"])
    assert [round(x, 3) for x in c["losses"]] == [round(x, 3) for x in a["losses"]]
    print("cuda losses", [x.hex() for x in a["losses"]], "cpu losses", [x.hex() for x in c["losses"]])


@pytest.mark.cuda
def test_cuda_batches_come_back_on_cpu_or_on_the_mapped_device(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    g = torch.Generator(device="cuda").manual_seed(0)
    mask = torch.arange(5, device="cuda")[None] < torch.tensor([5, 1, 3], device="cuda")[:, None]
    b = {"input_ids": torch.randint(0, 9, (3, 5), device="cuda", generator=g).masked_fill(~mask, 0),
         "attention_mask": mask, "logp": torch.randn(3, 5, device="cuda", generator=g).masked_fill(~mask, 0)}
    td = tensordict.TensorDict(b, batch_size=[3], device="cuda")
    with trajstore.Recorder(dump=True, path=str(tmp_path / "d")) as rec:
        rec.batch(0, lambda: b)
        rec.batch(1, lambda: td)
    cpu = trajstore.Recorder(replay=True, path=str(tmp_path / "d"))
    gpu = trajstore.Recorder(replay=True, path=str(tmp_path / "d"), device="cuda")
    for k in b:
        assert cpu.load(0)[k].device.type == "cpu" and torch.equal(cpu.load(0)[k], b[k].cpu())
        assert gpu.load(0)[k].device.type == "cuda" and torch.equal(gpu.load(0)[k], b[k])
    back = gpu.load(1)
    assert isinstance(back, tensordict.TensorDict) and back.device.type == "cuda"
    assert back.batch_size == td.batch_size and torch.equal(back["logp"], td["logp"])
    assert cpu.load(1)["logp"].device.type == "cpu"


def test_demo_keeps_its_dump_and_replaces_only_an_earlier_dump(tmp_path, monkeypatch, capsys):
    """examples/demo.py leaves its dump (README.md's examples run on it, tests/test_docs.py); a second demo
    replaces the first one's dump, and a folder that is not a dump is never deleted."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_example", ROOT / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    assert demo.DEFAULT_OUT == ROOT / "dumps" / "demo"
    assert "/dumps/" in (ROOT / ".gitignore").read_text().split()
    out = tmp_path / "dumps" / "demo"
    calls = []
    monkeypatch.setattr(demo, "run", lambda mode, dump, args: calls.append((mode, dump, args)) or "step 0 x\n")
    monkeypatch.setattr(sys, "argv", ["demo.py", "--steps", "2", "--out", str(out)])
    trajstore.Writer(out).close()  # an earlier demo's dump: replaced
    (out / "train" / "old").write_text("x")
    demo.main()
    assert calls == [("dump", str(out), ["--steps", "2"]), ("replay", str(out), ["--steps", "2"])] and not out.exists()
    assert f"the dump is in {out}" in capsys.readouterr().out
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    monkeypatch.setattr(sys, "argv", ["demo.py", "--keep", str(other)])
    with pytest.raises(SystemExit, match="is not a trajstore dump"):
        demo.main()
    assert (other / "notes.txt").read_text() == "keep"
