"""Issue 25's acceptance, with real processes and torch.distributed (gloo, CPU): a 4-rank dump with the
trainer's outputs; a 2-rank token-balanced replay records its outputs twice, once with ``entropy`` moved
by 1e-3 on the trajectories whose logical row is a multiple of 3, once as computed; ``trajstore diff``
against the 4-rank outputs, joined on trajectory ids, finds exactly that field and those trajectories on
every step and every other field (the per-step scalars included) identical; the unperturbed replay is
identical (exit 0). The run is examples/precision.py's (docs/PRECISION.md)."""

import json
import sys
from pathlib import Path

import trajstore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # spawned ranks import it too

import precision  # noqa: E402
from _dumps import run  # noqa: E402
from trajstore.cli import main  # noqa: E402

FIELDS = ["logprobs", "attention_mask", "loss", "entropy", "values", "meta.loss", "meta.grad_norm"]


def _cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    rc = main([*args])
    return rc, capsys.readouterr().out


def test_outputs_of_two_layouts_compared_by_trajectory_id(tmp_path, capsys):
    base, moved, same = (str(tmp_path / n) for n in ("base", "moved", "same"))
    precision.spawn(precision.dump_rank, 4, base)
    precision.spawn(precision.replay_rank, 2, base, [(moved, 1e-3), (same, 0.0)])
    B = sum(precision.SIZES)
    for s in precision.STEPS:  # the replay's rows are in another order, each with its id
        ids = trajstore.Reader(moved, "outputs").ids(s)
        assert sorted(ids[:, 1].tolist()) == list(range(B)) and ids[:, 1].tolist() != list(range(B))

    got = run("diff", base, moved, "--split", "outputs", "--json", check_rc=1)
    rep = json.loads(got.stdout)
    assert list(rep["fields"]) == FIELDS
    assert {k: f["status"] for k, f in rep["fields"].items()} == {k: "differs" if k == "entropy" else "identical"
                                                                  for k in FIELDS}
    bad = [e for e in rep["entries"] if e["status"] != "identical"]
    assert [(e["step"], e["field"]) for e in bad] == [(s, "entropy") for s in precision.STEPS]
    for e in bad:
        s = e["step"]
        assert e["beyond"] == [[s, r] for r in range(0, B, 3)]
        assert e["worst"]["id"] in e["beyond"] and abs(e["worst"]["abs"] - 1e-3) < 1e-5
        assert 9e-4 < e["max_abs"] < 1.1e-3 and 0 < e["mean_abs"] < e["max_abs"] and e["mean_rel"] > 0
    rc, text = _cli(capsys, "diff", base, moved, "--split", "outputs")
    assert rc == 1 and "entropy" in text and f"({precision.STEPS[-1]}, 3)" in text
    assert _cli(capsys, "diff", base, moved, "--split", "outputs", "--atol", "2e-3")[0] == 0  # within tolerance

    rc, clean = _cli(capsys, "diff", base, same, "--split", "outputs")
    assert rc == 0 and clean.rstrip().endswith("identical")
    assert trajstore.diff(base, same, split="outputs").identical
