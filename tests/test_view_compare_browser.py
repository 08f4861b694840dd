"""``trajstore view A B`` with two runs of other layouts, in real headless Chromium (tests/_browser.py):
run A's outputs written by one process, run B's by 2 token-balanced ranks with their trajectory ids,
``logprobs`` moved on some tokens of some trajectories and ``entropy`` on others. The run page overlays
both runs' curves with a legend naming them; the diff page lists every diverging field and every
(step, field) beyond tolerance with the trajectories' ids; a worst trajectory opens both runs aligned by
its id, each token coloured by ``|a - b|`` on a scale fitted to the data, with that scale's legend."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import trajstore
from _browser import ViewServer, make_driver, need_viewer, save_shot
from test_view_browser import open_page, wait_js

pytestmark = pytest.mark.browser

STEPS, B, T = (0, 1), 8, 7
MOVED = {0: {1: [2, 4], 6: [0]}, 1: {5: [1]}}  # step -> logical row -> tokens of logprobs moved
SIZE = {0: 1e-3, 1: 4e-3}  # how far, per step


def _inputs(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    lens = torch.randint(3, T + 1, (B,), generator=g)
    am = (torch.arange(T)[None] < lens[:, None]).long()
    return {"input_ids": torch.randint(3, 60, (B, T), generator=g) * am, "attention_mask": am}


def _outputs(batch: dict) -> dict:
    x = batch["input_ids"].to(torch.float64)
    return {"logprobs": (-(x % 29) / 32).to(torch.float32) * batch["attention_mask"],
            "attention_mask": batch["attention_mask"], "entropy": ((x % 5) / 8).sum(1).to(torch.float32)}


def make_runs(a, b) -> dict:
    """Run a: inputs and outputs, one process. Run b: the outputs of a 2-rank token-balanced replay, moved
    where MOVED says (and entropy of logical row 2 at step 1). Returns what the pages must show."""
    with trajstore.Writer(a) as w, trajstore.Writer(a, split="outputs") as wo:
        for s in STEPS:
            w.append(s, _inputs(s))
            wo.append(s, _outputs(_inputs(s)), meta={"loss": 0.25 * s})
    for k in range(2):
        r = trajstore.Reader(a, rank=k, world_size=2, balance="tokens")
        with trajstore.Writer(b, split="outputs", rank=k, world_size=2) as w:
            for s in STEPS:
                out, ids = _outputs(r[s]), r.ids(s)
                for i, row in enumerate(ids[:, 1].tolist()):
                    for j, tok in enumerate(MOVED[s].get(row, [])):
                        out["logprobs"][i, tok] += SIZE[s] * (j + 1)
                    if s == 1 and row == 2:
                        out["entropy"][i] += 0.5
                w.append(s, out, ids=ids, meta={"loss": 0.25 * s})
    return {"means": {s: float(_outputs(_inputs(s))["entropy"].double().mean()) for s in STEPS}}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    need_viewer()
    d = tmp_path_factory.mktemp("compare")
    want = make_runs(d / "base", d / "replay")
    srv = ViewServer(d / "base", d / "replay", "--split", "outputs", log=d / "view.log")
    driver = make_driver()
    try:
        yield SimpleNamespace(dir=d, url=srv.url, browser=driver, want=want)
    finally:
        driver.quit()
        srv.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    return [tmp_path_factory.mktemp("screenshots")]


def test_run_page_overlays_both_runs_with_a_legend(env, shots):
    br = env.browser
    open_page(br, env.url + "/", "run", "document.body.dataset.compareReady === '1'"
              " && document.querySelector('#overlay-entropy .main-svg')")
    traces = br.execute_script("return document.getElementById('overlay-entropy').data.map(t => [t.name, t.x, t.y])")
    assert [t[0] for t in traces] == ["base", "replay"]
    assert traces[0][1] == list(STEPS) and traces[0][2] == pytest.approx([env.want["means"][s] for s in STEPS])
    assert traces[1][2][0] == pytest.approx(traces[0][2][0]) and traces[1][2][1] > traces[0][2][1]  # step 1 moved
    legend = br.execute_script("return Array.from(document.querySelectorAll('#overlay-entropy .legend .traces'))"
                               ".map(e => e.textContent)")
    assert legend == ["base", "replay"]
    assert br.execute_script("return !!document.getElementById('overlay-meta.loss')")
    assert not br.find_elements("id", "compare-error")
    save_shot(br, "compare-run", shots)


def test_diff_page_lists_every_diverging_field_and_opens_the_aligned_trajectory(env, shots):
    br = env.browser
    open_page(br, env.url + "/diff", "diff", "document.body.dataset.compareReady === '1'"
              " && document.querySelector('#diverging-entries')")
    fields = br.execute_script("return Array.from(document.querySelectorAll('#diverging-fields li'))"
                               ".map(li => li.dataset.field)")
    assert fields == ["logprobs", "entropy"]
    rows = br.execute_script("return Array.from(document.querySelectorAll('#diverging-entries tr[data-step]'))"
                             ".map(tr => [Number(tr.dataset.step), tr.dataset.field, tr.querySelector('.beyond').textContent])")
    assert rows == [[0, "logprobs", "(0, 1) (0, 6)"], [1, "logprobs", "(1, 5)"], [1, "entropy", "(1, 2)"]]
    link = br.find_element("css selector", "#diverging-entries tr[data-step='0'] a.aligned-link")
    assert link.text == "(0, 1)"
    link.click()
    wait_js(br, "document.body.dataset.page === 'aligned' && document.body.dataset.ready === '1'")
    assert not br.find_elements("id", "compare-error")
    info = br.execute_script("return Object.assign({}, document.getElementById('aligned-info').dataset)")
    ids = trajstore.Reader(env.dir / "replay", "outputs").ids(0)[:, 1].tolist()
    assert info == {"field": "logprobs", "indexA": "1", "indexB": str(ids.index(1))}
    # both runs' tokens side by side, the token text from run a's inputs, coloured on the fitted scale
    a = trajstore.Reader(env.dir / "base")[0]
    n = int(a["attention_mask"][1].sum())
    spans = {side: br.execute_script(f"return Array.from(document.querySelectorAll('#aligned-{side} span.tok'))"
                                     ".map(s => [s.textContent, getComputedStyle(s).backgroundColor, s.dataset.diff])")
             for side in ("a", "b")}
    assert [s[0] for s in spans["a"]] == [str(int(x)) for x in a["input_ids"][1, :n]]
    assert spans["a"] == spans["b"]
    colours = [s[1] for s in spans["a"]]
    assert colours[4] == "rgb(203, 24, 29)"  # the largest difference (token 4, 2e-3): the scale's top
    assert all(c == "rgb(255, 255, 255)" for j, c in enumerate(colours) if j not in (2, 4))
    assert colours[2] not in ("rgb(255, 255, 255)", "rgb(203, 24, 29)")  # half of it: half way
    hi = float(br.find_element("id", "scale-max").text)
    assert hi == pytest.approx(2e-3, rel=1e-3) and br.find_element("id", "scale-min").text == "0"
    assert "logprobs" in br.find_element("id", "scale").text
    save_shot(br, "compare-aligned", shots)


def test_the_aligned_page_names_a_missing_id(env):
    br = env.browser
    br.get(env.url + f"/aligned/outputs/0/{B + 3}")
    wait_js(br, "document.body.dataset.ready === '1'")
    assert f"({0}, {B + 3})" in br.find_element("id", "compare-error").text
