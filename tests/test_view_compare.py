"""The JSON behind ``trajstore view A B``'s pages of two runs (trajstore/view/compare.py), without a
browser: overlaid curves of both runs, every diverging (step, field) with trajectory ids, one trajectory
of both runs aligned by its id with the colour scale fitted to its differences, and clear errors.
tests/test_view_compare_browser.py drives the same pages in Chromium."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("plotly")

import trajstore  # noqa: E402
from test_view_compare_browser import B, STEPS, make_runs  # noqa: E402
from trajstore.view import compare  # noqa: E402
from trajstore.view.pages import View  # noqa: E402


@pytest.fixture(scope="module")
def view(tmp_path_factory):
    d = tmp_path_factory.mktemp("compare-json")
    want = make_runs(d / "base", d / "replay")
    return View(d / "base", "outputs", other=d / "replay"), want, d


def test_curves_of_both_runs(view):
    v, want, _ = view
    c = compare.curves(v)
    assert c["runs"] == ["base", "replay"] and c["steps"] == list(STEPS)
    assert c["series"]["entropy"][0] == pytest.approx([want["means"][s] for s in STEPS])
    assert c["series"]["entropy"][1][1] == pytest.approx(want["means"][1] + 0.5 / B)
    assert c["series"]["meta.loss"] == [[0.0, 0.25], [0.0, 0.25]]


def test_every_diverging_entry_with_ids(view):
    v, _, _ = view
    d = compare.diverging(v)
    assert not d["ok"] and [k for k, f in d["fields"].items() if f["status"] != "identical"] == ["logprobs", "entropy"]
    got = [(e["step"], e["field"], e["beyond"], e["worst"]["id"], e["worst"].get("token")) for e in d["entries"]]
    assert got == [(0, "logprobs", [[0, 1], [0, 6]], [0, 1], 4), (1, "logprobs", [[1, 5]], [1, 5], 1),
                   (1, "entropy", [[1, 2]], [1, 2], None)]
    assert compare.diverging(v, atol=1.0)["entries"] == []


def test_aligned_trajectory_and_its_scale(view):
    v, _, d = view
    t = compare.aligned(v, 0, 1, "logprobs")
    ids = trajstore.Reader(d / "replay", "outputs").ids(0)[:, 1].tolist()
    assert t["index"] == [1, ids.index(1)] and t["field"] == "logprobs"
    diffs = [x["diff"] for x in t["tokens"]]
    assert diffs[2] == pytest.approx(1e-3, rel=1e-3) and diffs[4] == pytest.approx(2e-3, rel=1e-3)
    assert all(x == 0 for j, x in enumerate(diffs) if j not in (2, 4))
    assert t["scale"] == {"min": 0.0, "max": max(diffs)}
    a = trajstore.Reader(d / "base")[0]
    assert [x["id"] for x in t["tokens"]] == a["input_ids"][1, :len(diffs)].tolist()  # text from the inputs
    with pytest.raises(trajstore.StepNotFoundError, match=r"no trajectory of id \(0, 99\)"):
        compare.aligned(v, 0, 99)
    with pytest.raises(trajstore.ConfigError, match="two dumps"):
        compare.curves(View(d / "base", "outputs"))
