"""``trajstore view`` in real headless Chromium (Debian's chromium + chromium-driver through Selenium,
tests/_browser.py): the run page plots the reader's statistics and a click opens the step; the step
table sorts, filters and opens a trajectory; token colours and tooltips follow the documented formulas;
the diff page shows a planted divergence; dump text stays text; no path leaves the dump; the exported
HTML works with no network; a 16k-token trajectory renders whole; the demo's pages. The dumps and the
expected values come from tests/_viewdumps.py (trajstore.Reader only). ``pytest --screenshots DIR`` also
writes the PNG of each page of the demo's dump (20 steps, against a second run of 5 steps on 2 CPU
threads): ``pytest tests/test_view_browser.py -k demo --screenshots docs/img``."""

from __future__ import annotations

import math
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from _browser import OFFLINE, ViewServer, get_raw, make_driver, need_chromium, need_viewer, save_shot
from _dumps import run as run_cli
from _viewdumps import (B, INCOMPLETE, LONG, PAIR, PAYLOAD, PLANT_REWARDS, SKIPPED, XSS_INDEX, colour, curves,
                        diff_dumps, make_tokenizer, rows, view_dump)

pytestmark = pytest.mark.browser

METRICS = ["reward_mean", "reward_std", "reward_min", "reward_max", "length_mean", "length_p95", "tokens",
           "version_lag", "logprob_mismatch"]


@pytest.fixture(scope="session")
def env(tmp_path_factory):
    need_viewer()
    d = tmp_path_factory.mktemp("view")
    tok = make_tokenizer(d)
    view_dump(d / "dump", tok)
    plant = diff_dumps(d / "a", d / "b", tok)
    servers = []
    try:
        servers.append(ViewServer(d / "dump", "--tokenizer", tok, log=d / "run.log"))
        servers.append(ViewServer(d / "a", d / "b", "--tokenizer", tok, log=d / "diff.log"))
        yield SimpleNamespace(dir=d, tok=tok, plant=plant, dump=d / "dump", url=servers[0].url, diff_url=servers[1].url)
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="session")
def browser(env):
    driver = make_driver()
    yield driver
    driver.quit()


@pytest.fixture(scope="session")
def shots(request, tmp_path_factory) -> list[Path]:
    out = [tmp_path_factory.mktemp("screenshots")]
    if request.config.getoption("--screenshots", None):
        out.append(Path(request.config.getoption("--screenshots")))
    return out


def wait_js(driver, expr: str, *args, timeout: float = 60):
    """Wait until the JavaScript expression ``expr`` is truthy; return its value."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(
        lambda d: d.execute_script(f"return ({expr});", *args), message=f"waiting for {expr}")


def eventually(get, want, timeout: float = 30):
    """``get()`` once it equals ``want``, or its last value after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while (got := get()) != want and time.monotonic() < end:
        time.sleep(0.2)
    return got


def open_page(driver, url: str, page: str, ready: str) -> None:
    driver.get(url)
    wait_js(driver, f"document.body && document.body.dataset.page === '{page}' && ({ready})")
    assert driver.find_element("tag name", "h1").text.strip()


def plot(driver, div: str) -> list | None:
    return driver.execute_script(
        "const d = document.getElementById(arguments[0]);"
        "return d && d.data && d.data.length ? [Array.from(d.data[0].x || []), Array.from(d.data[0].y || []),"
        " d.data[0].type || 'scatter'] : null;", div)


def no_alert(driver) -> None:
    """No alert opens (waits two seconds for one, e.g. from an <img onerror>)."""
    from selenium.common.exceptions import NoAlertPresentException, TimeoutException
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    with pytest.raises(TimeoutException):
        WebDriverWait(driver, 2).until(EC.alert_is_present())
    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text


def only_local_resources(driver, base: str) -> None:
    names = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert names and all(n.startswith(base) for n in names), names


def gapped(xs: list, ys: list) -> tuple[list, list]:
    """Split train's curve as plotted: a null point at the skipped step breaks the line."""
    k = xs.index(SKIPPED + 1)
    return xs[:k] + [SKIPPED] + xs[k:], ys[:k] + [None] + ys[k:]


def same_curve(got: list, xs: list, ys: list, what: str) -> None:
    assert got[0] == xs, (what, got[0])
    assert [y is None for y in got[1]] == [y is None for y in ys], (what, got[1])
    assert [y for y in got[1] if y is not None] == pytest.approx([y for y in ys if y is not None],
                                                                 rel=1e-6, abs=1e-12), (what, got[1], ys)


def test_run_page_plots_the_readers_statistics_and_a_point_opens_its_step(env, browser, shots):
    from selenium.webdriver.common.action_chains import ActionChains

    open_page(browser, env.url + "/", "run", "document.querySelector('#curve-reward_mean .main-svg')")
    for split, prefix in (("train", "curve-"), ("ranks", "curve-ranks-"), ("packed", "curve-packed-"),
                          ("long", "curve-long-")):
        for metric, (xs, ys) in curves(env.dump, split).items():
            got = plot(browser, prefix + metric)
            assert got is not None, f"no plot {prefix + metric}"
            if split == "train":  # the skipped step is a gap in the line: its point is null
                xs, ys = gapped(xs, ys)
            same_curve(got, xs, ys, prefix + metric)
            axes = browser.execute_script("const l = document.getElementById(arguments[0])._fullLayout;"
                                          "return [l.xaxis.title.text, l.yaxis.title.text]", prefix + metric)
            assert axes[0] == "step" and axes[1], (prefix + metric, axes)  # both axes titled
    assert browser.execute_script("return document.getElementById('curve-packed-logprob_mismatch')") is None
    # the reward mean with a band of one standard deviation (mean - std .. mean + std)
    xs, mean = curves(env.dump, "train")["reward_mean"]
    std = curves(env.dump, "train")["reward_std"][1]
    band = browser.execute_script("const d = document.getElementById('curve-reward_mean').data;"
                                  "return d.map(t => [Array.from(t.x), Array.from(t.y), t.fill || null])")
    assert len(band) == 2 and band[1][2] == "toself"
    # one closed shape per run of steps (the skipped step breaks it): mean + std forth, mean - std back
    k = xs.index(SKIPPED + 1)
    shape = []
    for lo, hi in ((0, k), (k, len(xs))):
        shape += [None] * bool(shape) + [m + s for m, s in zip(mean[lo:hi], std[lo:hi])]
        shape += [m - s for m, s in zip(mean[lo:hi], std[lo:hi])][::-1]
    assert band[1][0] == [x for x in (xs[:k] + xs[:k][::-1] + [None] + xs[k:] + xs[k:][::-1])]
    assert [y is None for y in band[1][1]] == [y is None for y in shape]
    assert [y for y in band[1][1] if y is not None] == pytest.approx([y for y in shape if y is not None], rel=1e-6)
    # a curve with no data (split "packed" has no versions field) says so, with no empty axes
    empty = browser.execute_script("const g = document.getElementById('curve-packed-version_lag');"
                                   "return [g.dataset.empty, g._fullLayout.yaxis.visible,"
                                   " (g.layout.annotations || []).map(a => a.text)]")
    assert empty[0] == "1" and empty[1] is False and any("no versions field" in t for t in empty[2]), empty
    missing = browser.execute_script("return Array.from(document.querySelectorAll('#missing li'))"
                                     ".map(li => [li.dataset.step, li.dataset.why, li.dataset.split])")
    assert sorted(missing) == [[str(INCOMPLETE), "incomplete", "ranks"], [str(SKIPPED), "skipped", "train"]]
    only_local_resources(browser, env.url)
    save_shot(browser, "test-run", shots[:1])

    # click the plotted point of step 2: Plotly's own hover and click handling, then navigation
    x, y = curves(env.dump, "train")["reward_mean"][0][2], curves(env.dump, "train")["reward_mean"][1][2]
    px, py = browser.execute_script(
        "const gd = document.getElementById('curve-reward_mean'); gd.scrollIntoView({block: 'center'});"
        "const r = gd.getBoundingClientRect(), xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;"
        "return [r.left + xa._offset + xa.l2p(arguments[0]), r.top + ya._offset + ya.l2p(arguments[1])];", x, y)
    ac = ActionChains(browser)
    ac.w3c_actions.pointer_action.move_to_location(int(px), int(py))
    ac.w3c_actions.pointer_action.pause(0.5)
    ac.w3c_actions.pointer_action.move_to_location(int(px) + 1, int(py))
    ac.w3c_actions.pointer_action.click()
    ac.perform()
    wait_js(browser, "location.pathname === '/step/train/2' && document.body.dataset.page === 'step'")


def table(driver, key: str) -> list[tuple[str, str]]:
    """(data-index, data-value of column ``key``) of the visible rows, in page order."""
    return [tuple(x) for x in driver.execute_script(
        "return Array.from(document.querySelectorAll('#traj-table tbody tr')).filter(tr => tr.getClientRects().length)"
        ".map(tr => [tr.dataset.index, tr.querySelector(`td[data-key='${arguments[0]}']`).dataset.value]);", key)]


def headers(driver) -> list[str]:
    """The keys of the step table's columns, in page order."""
    return driver.execute_script("return Array.from(document.querySelectorAll('#traj-table th')).map(th => th.dataset.key)")


def test_step_page_sorts_filters_and_opens_a_trajectory(env, browser, shots):
    import trajstore

    step = 2
    rs = rows(trajstore.Reader(env.dump)[step])
    open_page(browser, f"{env.url}/step/train/{step}", "step",
              f"document.querySelectorAll('#traj-table tbody tr').length === {B}")
    keys = headers(browser)
    assert keys[:4] == ["index", "reward", "length", "version"] and "kl" in keys, keys
    got = {i: float(v) for i, v in table(browser, "reward")}
    assert got == {str(i): pytest.approx(r["reward"], rel=1e-7) for i, r in enumerate(rs)}
    assert dict(table(browser, "length")) == {str(i): str(r["length"]) for i, r in enumerate(rs)}
    assert {i: int(v) for i, v in table(browser, "version")} == {str(i): int(r["versions"].max()) for i, r in enumerate(rs)}
    for div, want in (("hist-reward", [r["reward"] for r in rs]), ("hist-length", [r["length"] for r in rs])):
        h = plot(browser, div)
        assert h is not None, f"no histogram {div}"
        if h[2] == "histogram":
            assert sorted(h[0]) == pytest.approx(sorted(want), rel=1e-7)
        else:  # pre-binned bars: the counts add up to the trajectories
            assert sum(h[1]) == len(want)
        axes = browser.execute_script("const l = document.getElementById(arguments[0])._fullLayout;"
                                      "return [l.xaxis.title.text, l.yaxis.title.text]", div)
        assert axes[0] and axes[1] == "trajectories", (div, axes)
    # the table uses the page's width; text left-aligned, numbers right-aligned
    widths = browser.execute_script("return [document.getElementById('traj-table').getBoundingClientRect().width,"
                                    " document.getElementById('app').getBoundingClientRect().width]")
    assert widths[0] >= 0.99 * widths[1], widths
    align = browser.execute_script(
        "const a = k => getComputedStyle(document.querySelector(`#traj-table td[data-key='${k}']`)).textAlign;"
        "return [a('completion'), a('uid'), a('reward'), a('length')]")
    assert align == ["left", "left", "right", "right"], align

    by_reward = [str(i) for i in sorted(range(B), key=lambda i: rs[i]["reward"])]
    header = browser.find_element("css selector", "#traj-table th[data-key='reward']")
    header.click()
    first = [i for i, _ in table(browser, "reward")]
    assert first in (by_reward, by_reward[::-1]), first
    header.click()
    assert [i for i, _ in table(browser, "reward")] == first[::-1]

    box = browser.find_element("id", "filter")
    box.send_keys(f"s{step}-t4")
    wait_js(browser, "document.querySelectorAll('#traj-table tbody tr').length > 0")
    assert [i for i, _ in table(browser, "index")] == ["4"]
    box.clear()  # an empty filter shows every row again
    browser.execute_script("arguments[0].dispatchEvent(new Event('input'))", box)
    assert sorted(i for i, _ in table(browser, "index")) == sorted(map(str, range(B)))

    browser.find_element("css selector", "#traj-table tbody tr[data-index='3']").click()
    wait_js(browser, f"location.pathname === '/traj/train/{step}/3' && document.body.dataset.page === 'traj'")

    # split "packed" has no versions field: no version column, and the page says it hid it
    open_page(browser, f"{env.url}/step/packed/0", "step", "document.querySelectorAll('#traj-table tbody tr').length")
    keys = headers(browser)
    assert keys == ["index", "reward", "length"], keys
    assert "version" in browser.find_element("id", "empty-columns").text


def spans(driver) -> list[dict]:
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('#tokens span.tok')).map(s => ({pos: s.dataset.pos,"
        " id: s.dataset.id, logprob: s.dataset.logprob, mask: s.dataset.mask, version: s.dataset.version,"
        " other: s.dataset.other, title: s.title, text: s.dataset.text, shown: s.textContent, bytes: s.dataset.bytes,"
        " bg: getComputedStyle(s).backgroundColor,"
        " seg: s.closest('div.segment') ? Array.from(document.querySelectorAll('div.segment')).indexOf("
        "s.closest('div.segment')) : -1}))")


# the text a reader sees: each run of tokens that makes whole characters as those characters, every
# other token as its text (whitespace marks put back)
SHOWN_TEXT = r"""return Array.from(document.querySelectorAll(arguments[0] + ' div.segment')).map(seg =>
  Array.from(seg.children).map(c => c.classList.contains('chars') ? c.querySelector('.whole').textContent
    : c.textContent).join('')).join('').replace(/\u21b5\n/g, '\n').replace(/\u00b7/g, ' ').replace(/\u2192/g, '\t')"""


def legend(driver) -> dict:
    return driver.execute_script(
        "const g = document.getElementById('legend'); return {mode: g.dataset.mode, min: g.dataset.min,"
        " max: g.dataset.max, text: g.textContent, bar: !!g.querySelector('.bar'),"
        " ticks: Array.from(g.querySelectorAll('.tick')).map(t => t.textContent),"
        " swatches: Array.from(g.querySelectorAll('.swatch-item')).map(t => t.textContent)}")


def test_trajectory_page_colours_and_tooltips_follow_the_data(env, browser, shots):
    import trajstore
    from selenium.webdriver.support.ui import Select
    from tokenizers import Tokenizer

    step, index = 4, 3  # a multi-turn trajectory: prompt, response, tool turn, response
    tok = Tokenizer.from_file(str(env.tok))
    r = rows(trajstore.Reader(env.dump)[step])[index]
    n = len(r["input_ids"])
    open_page(browser, f"{env.url}/traj/train/{step}/{index}", "traj",
              f"document.querySelectorAll('#tokens span.tok').length === {n}")
    got = spans(browser)
    ids = r["input_ids"].tolist()
    assert [int(s["pos"]) for s in got] == list(range(n))
    assert [int(s["id"]) for s in got] == ids
    assert [s["text"] for s in got] == [tok.decode([t]) for t in ids]
    assert [int(s["mask"]) for s in got] == r["loss_mask"].tolist()
    assert [int(s["version"]) for s in got] == r["versions"].tolist()
    # float32 values (bf16 held as float32) at float32 precision: their shortest float32 repr
    lps, others = ([float(str(np.float32(x))) for x in r[k]] for k in PAIR)
    assert [s["logprob"] for s in got] == [str(np.float32(x)) for x in r[PAIR[0]]]
    assert [s["other"] for s in got] == [str(np.float32(x)) for x in r[PAIR[1]]]
    for s in got:  # the tooltip names each field
        text = f"id={s['id']} text={s['text']!r} " + (f"bytes={s['bytes']} " if s["bytes"] else "")
        assert s["title"].startswith(text), s
        assert s["title"].endswith(f"{PAIR[0]}={s['logprob']} {PAIR[1]}={s['other']} loss_mask={s['mask']} "
                                   f"versions={s['version']}"), s
    assert browser.execute_script(SHOWN_TEXT, "#tokens") == tok.decode(ids)
    spaces = [s for s in got if " " in s["text"] and not s["bytes"]]
    assert spaces and all("\u00b7" in s["shown"] for s in spaces)  # whitespace shown

    # segments: one per run of the loss mask, in order: prompt, response, turn, response
    mask = r["loss_mask"].tolist()
    runs = [k for k in range(n) if k == 0 or mask[k] != mask[k - 1]]
    kinds = browser.execute_script("return Array.from(document.querySelectorAll('div.segment')).map(d => d.dataset.kind)")
    assert kinds == ["prompt", "response", "turn", "response"] and len(runs) == 4
    assert [s["seg"] for s in got] == [sum(k <= j for k in runs) - 1 for j in range(n)]

    resp = r["loss_mask"] == 1
    maxv = int(r["versions"][resp].max())
    top = float(abs(np.asarray(lps) - np.asarray(others))[resp].max())
    modes = browser.execute_script("return Array.from(document.querySelectorAll('#colour option')).map(o => o.value)")
    assert modes == ["logprob", "diff", "version"]
    for mode in modes:
        Select(browser.find_element("id", "colour")).select_by_value(mode)
        want = [colour(mode, m, lp, o, v, maxv, top) for m, lp, o, v in zip(mask, lps, others, r["versions"].tolist())]
        got = eventually(lambda: [s["bg"] for s in spans(browser)], want)  # colouring may run in chunks
        assert got == want, mode
        assert len(set(want)) > 2  # the mode shows something
        key = eventually(lambda: legend(browser)["mode"], mode)
        assert key == mode
        g = legend(browser)
        assert "not in loss_mask" in g["text"]  # the masked tokens' grey is in every legend
        if mode == "logprob":
            assert g["bar"] and g["ticks"] == ["0", "1"] and PAIR[0] in g["text"]
        if mode == "diff":  # the scale is fitted to this trajectory: its largest |a - b| is the darkest red
            assert g["bar"] and float(g["max"]) == pytest.approx(top, rel=1e-12) and g["ticks"][0] == "0"
            assert float(g["ticks"][1].split()[0]) == pytest.approx(top, rel=1e-2)
            assert "rgb(255, 0, 0)" in want and top < 0.2  # the real bf16 mismatch is small and still visible
        if mode == "version":
            shown = [int(x.split()[0]) for x in g["swatches"][:-1]]  # newest first, then the mask's grey
            assert shown == sorted(set(r["versions"][resp].tolist()), reverse=True)
    save_shot(browser, "test-trajectory", shots[:1])


def test_multi_byte_characters_come_out_whole(env, browser):
    """A byte-level tokenizer cuts "ï" and "—" between tokens: the page shows the characters whole,
    each piece as its bytes, never U+FFFD."""
    import trajstore
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(env.tok))
    r = trajstore.Reader(env.dump)
    where = next((s, i) for s in r.steps for i, x in enumerate(rows(r[s]))
                 if "naïve" in tok.decode(x["input_ids"].tolist()))
    ids = rows(r[where[0]])[where[1]]["input_ids"].tolist()
    open_page(browser, f"{env.url}/traj/train/{where[0]}/{where[1]}", "traj",
              f"document.querySelectorAll('#tokens span.tok').length === {len(ids)}")
    assert browser.execute_script(SHOWN_TEXT, "#tokens") == tok.decode(ids)
    wholes = browser.execute_script("return Array.from(document.querySelectorAll('#tokens span.chars'))"
                                    ".map(c => [c.querySelector('.whole').textContent, Array.from("
                                    "c.querySelectorAll('span.tok')).map(t => t.dataset.bytes)])")
    assert any("ï" in w for w, _ in wholes) and any("—" in w for w, _ in wholes), wholes
    for w, parts in wholes:  # each token of a run as its bytes; together the run's characters
        assert b"".join(bytes.fromhex(p) for p in parts) == w.replace("\u00b7", " ").encode()
    assert "\ufffd" not in browser.find_element("id", "tokens").text


def test_diff_page_highlights_the_planted_divergence(env, browser, shots):
    import trajstore

    plant = env.plant

    first = trajstore.diff(env.dir / "a", env.dir / "b").first_divergence
    assert (first["step"], first["field"], first["trajectory"], first["token"]) == \
        (plant["step"], plant["field"], plant["index"], plant["token"])
    open_page(browser, env.diff_url + "/diff", "diff", "document.querySelector('#divergence')"
              " && document.querySelectorAll('#divergence span.tok, span.tok').length > 0")
    div = browser.execute_script("return Object.assign({}, document.getElementById('divergence').dataset)")
    assert div == {"step": str(plant["step"]), "field": plant["field"], "index": str(plant["index"]),
                   "token": str(plant["token"])}
    # both sides' tokens of that trajectory, the divergent token marked once on each side, with its value
    for side in ("a", "b"):
        hot = browser.find_elements("css selector", f"#tokens-{side} span.tok.diverge")
        assert len(hot) == 1 and hot[0].get_attribute("data-pos") == str(plant["token"]), side
        assert hot[0].get_attribute("data-logprob") == str(np.float32(first[side]))  # float32 precision
    assert len(browser.find_elements("css selector", "span.tok.diverge")) == 2
    values = [dd.text for dd in browser.find_elements("css selector", "#divergence dd.side")[:2]]
    assert values == [str(np.float32(first["a"])), str(np.float32(first["b"]))]
    # the summary: which steps and fields are identical, and every field that differs, in words
    rep = trajstore.diff(env.dir / "a", env.dir / "b")
    bad = [k for k, v in rep.fields().items() if v["status"] not in ("identical", "close")]
    assert bad == [plant["field"], "rewards"]
    summary = browser.execute_script("const s = document.getElementById('diff-summary');"
                                     "return [s.dataset.differFields, s.dataset.differSteps,"
                                     " Array.from(s.querySelectorAll('li'))"
                                     ".map(li => [li.dataset.what, li.textContent])]")
    assert summary[0].split(",") == bad and summary[1] == f"{plant['step']}-{PLANT_REWARDS}"
    said = dict(summary[2])
    assert said["steps"].startswith("4 steps in both dumps: 2 identical (0-1)") and "2 differ (2-3)" in said["steps"]
    assert said["differ-fields"] == "fields that differ: " + ", ".join(bad)
    assert said["identical-fields"].startswith("fields identical at every step: input_ids, attention_mask")
    table = browser.execute_script("return Array.from(document.querySelectorAll('#diff-fields tbody tr'))"
                                   ".map(tr => Array.from(tr.cells).map(td => td.textContent))")
    assert [t[0] for t in table] == bad and all(t[1] == "differs" for t in table)
    assert table[1][2] == str(PLANT_REWARDS) and table[1][5].startswith(f"step {PLANT_REWARDS}, trajectory 0")
    text = browser.find_element("tag name", "body").text
    assert "field *" not in text and "\nb: " not in text and "(differs)" in text
    only_local_resources(browser, env.diff_url)
    save_shot(browser, "test-diff", shots[:1])


def test_diff_page_of_equal_dumps_says_so(env, browser):
    srv = ViewServer(env.dir / "a", env.dir / "a", log=env.dir / "same.log")
    try:
        open_page(browser, srv.url + "/diff", "diff", "document.querySelector('#divergence')")
        assert browser.find_element("id", "divergence").get_attribute("data-step") == ""
        assert not browser.find_elements("css selector", "span.tok.diverge")
    finally:
        srv.stop()


def test_dump_text_is_shown_as_text_never_run(env, browser):
    open_page(browser, f"{env.url}/traj/train/0/{XSS_INDEX}", "traj", "document.querySelectorAll('#tokens span.tok').length")
    no_alert(browser)
    assert PAYLOAD in browser.execute_script(SHOWN_TEXT, "#tokens")
    assert browser.execute_script("return document.querySelectorAll('#tokens img, #tokens script, body img').length") == 0
    open_page(browser, f"{env.url}/step/train/0", "step", f"document.querySelectorAll('#traj-table tbody tr').length === {B}")
    no_alert(browser)
    cell = browser.find_element("css selector", f"#traj-table tr[data-index='{XSS_INDEX}'] td[data-key='completion']")
    assert cell.text == PAYLOAD and cell.get_attribute("data-value") == PAYLOAD
    assert browser.execute_script("return document.querySelectorAll('#traj-table img, #traj-table script').length") == 0


TRAVERSALS = ["/static/../../etc/passwd", "/static/..%2f..%2f..%2f..%2fetc%2fpasswd", "/static/%2e%2e/%2e%2e/etc/passwd",
              "/static/%2e%2e%2f%2e%2e%2f%2e%2e%2fetc%2fpasswd", "/static/..%252f..%252fetc%252fpasswd",
              "/static//etc/passwd", "/static/%2fetc%2fpasswd", "/static/..\\..\\..\\etc\\passwd",
              "/static/..%5c..%5c..%5cetc%5cpasswd", "/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd",
              "/api/step?split=..%2f..%2f..%2fetc&step=0", "/api/step?split=../../../etc/passwd&step=0",
              "/api/run?split=..%2F..%2F..%2Fetc", "/api/traj?split=/etc&step=0&index=0"]


@pytest.mark.parametrize("raw", TRAVERSALS)
def test_no_path_leaves_the_dump(env, raw):
    status, body = get_raw(env.url, raw)
    assert b"root:" not in body and status in (400, 403, 404), (status, body[:200])


def test_no_path_leaves_the_dump_in_the_browser_either(env, browser):
    import trajstore.view

    static = Path(trajstore.view.__file__).parent / "static"
    names = [f.name for f in static.iterdir() if f.is_file()]
    assert names
    for name in names:  # what may be served is served
        with urllib.request.urlopen(f"{env.url}/static/{name}") as r:
            assert r.status == 200 and r.read() == (static / name).read_bytes()
    for raw in ("/static/../../etc/passwd", "/static/..%2f..%2f..%2fetc%2fpasswd", "/step/..%2f..%2fetc/passwd"):
        browser.get(env.url + raw)
        assert "root:x:" not in browser.page_source


def test_exported_html_works_with_no_network(env, tmp_path):
    need_chromium()
    out = tmp_path / "run.html"
    run_cli("view", env.dump, "--tokenizer", env.tok, "--export", out, timeout=600)
    driver = make_driver(OFFLINE)
    try:
        from selenium.common.exceptions import WebDriverException

        try:  # the browser really has no network: not even the live view server on 127.0.0.1 answers
            driver.get(env.url + "/")
        except WebDriverException:
            pass
        assert driver.execute_script("return document.body ? (document.body.dataset.page || null) : null") is None
        driver.get(out.as_uri())
        wait_js(driver, "window.Plotly && document.querySelector('#curve-reward_mean .main-svg')")
        sizes = driver.execute_script("return Array.from(document.querySelectorAll('.js-plotly-plot'))"
                                      ".map(d => d.data ? d.data.length : 0)")
        assert sizes and all(sizes), sizes
        same_curve(plot(driver, "curve-reward_mean"), *gapped(*curves(env.dump, "train")["reward_mean"]), "export")
        res = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert all(n.startswith(("file:", "data:", "blob:")) for n in res), res
        no_alert(driver)
    finally:
        driver.quit()


def test_a_16k_token_trajectory_renders_whole(env, browser):
    import trajstore

    r = rows(trajstore.Reader(env.dump, "long")[0])[0]
    assert len(r["input_ids"]) == LONG
    open_page(browser, f"{env.url}/traj/long/0/0", "traj", "document.querySelectorAll('#tokens span.tok').length > 0")
    wait_js(browser, f"document.querySelectorAll('#tokens span.tok').length === {LONG}", timeout=300)
    last = browser.execute_script("const s = document.querySelectorAll('#tokens span.tok');"
                                  "return [s.length, s[s.length - 1].dataset.pos, s[s.length - 1].dataset.id]")
    assert last == [LONG, str(LONG - 1), str(int(r["input_ids"][-1]))]
    assert not math.isnan(float(browser.execute_script(
        "return document.querySelector('#tokens span.tok[data-mask=\"1\"]').dataset.logprob")))


# -- the demo's dump: the pages a newcomer first sees (and docs/img/, with --screenshots docs/img)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def demo(request, tmp_path_factory):
    """The demo's dump (examples/rl_loop.py, as examples/demo.py runs it) and a second run of the same
    seed on 2 CPU threads (``b``): 20 and 5 steps for the screenshots, else 3 and 2 (quicker)."""
    import os
    import subprocess
    import sys

    need_chromium()
    d = tmp_path_factory.mktemp("demo")
    full = bool(request.config.getoption("--screenshots", None))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for name, steps, extra in (("demo", 20 if full else 3, []), ("demo2", 5 if full else 2, ["--threads", "2"])):
        subprocess.run([sys.executable, str(ROOT / "examples" / "rl_loop.py"), "--dump", f"dumps/{name}", "--steps",
                        str(steps), "--quiet", *extra], check=True, env=env, timeout=600, cwd=d)
    tok = ROOT / "examples" / "tokenizer.json"
    # served from the folder holding dumps/, so the pages name dumps/demo and dumps/demo2 as README.md does
    srv = ViewServer("dumps/demo", "dumps/demo2", "--tokenizer", tok, log=d / "view.log", cwd=d)
    try:
        yield SimpleNamespace(dump=d / "dumps" / "demo", b=d / "dumps" / "demo2", tok=tok, url=srv.url)
    finally:
        srv.stop()


def test_the_demo_dumps_pages(demo, browser, shots):
    import trajstore
    from selenium.webdriver.support.ui import Select
    from tokenizers import Tokenizer

    r = trajstore.Reader(demo.dump)
    open_page(browser, demo.url + "/", "run", "document.querySelector('#curve-reward_mean .main-svg')"
              " && !document.querySelector('p.pending').textContent")
    g = browser.execute_script("const g = document.getElementById('curve-version_lag');"
                               "return [g.dataset.empty, (g.layout.annotations || []).map(a => a.text)]")
    assert g[0] == "1" and "no versions field" in g[1][0]  # the demo records no policy versions
    assert browser.execute_script("return document.getElementById('curve-reward_mean').data.length") == 2
    save_shot(browser, "run", shots)

    step = min(12, r.steps[-1])
    open_page(browser, f"{demo.url}/step/train/{step}", "step",
              "document.querySelectorAll('#traj-table tbody tr').length")
    keys = headers(browser)
    assert keys == ["index", "reward", "length", "group", "prompt", "response"], keys  # no versions: no column
    save_shot(browser, "step", shots)

    # a trajectory whose response has several tokens: no <pad> or <bos> sampled, the mismatch coloured
    b = r[step]
    index = int(b["response_mask"].sum(1).argmax())
    resp = b["input_ids"][index][b["response_mask"][index].bool()].tolist()
    tok = Tokenizer.from_file(str(demo.tok))
    assert not {"<pad>", "<bos>", "="} & {tok.decode([t], skip_special_tokens=False) for t in resp}
    open_page(browser, f"{demo.url}/traj/train/{step}/{index}", "traj",
              "document.querySelectorAll('#tokens span.tok').length")
    modes = browser.execute_script("return Array.from(document.querySelectorAll('#colour option')).map(o => o.value)")
    assert modes == ["logprob", "diff"]  # no versions field: no colour by version
    Select(browser.find_element("id", "colour")).select_by_value("diff")
    wait_js(browser, "document.getElementById('legend').dataset.mode === 'diff'")
    top = float(legend(browser)["max"])
    mask = b["response_mask"][index].bool()
    shown = [[float(str(np.float32(x))) for x in b[k][index][mask].float().tolist()]
             for k in ("old_logprobs", "logprobs")]
    want = max(abs(x - y) for x, y in zip(*shown))  # of the values as the page shows them (float32 text)
    assert top == pytest.approx(want, rel=1e-12) and 0 < top < 0.1  # the bf16 vs fp32 gap, on its own scale
    save_shot(browser, "trajectory", shots)

    open_page(browser, demo.url + "/diff", "diff", "document.getElementById('diff-summary')")
    rep = trajstore.diff(demo.dump, demo.b)
    bad = [k for k, v in rep.fields().items() if v["status"] not in ("identical", "close") and k != "*"]
    got = browser.execute_script("return document.getElementById('diff-summary').dataset.differFields")
    assert (got.split(",") if got else []) == bad
    save_shot(browser, "diff", shots)


def test_plotly_draws_a_field_name_as_text(browser, tmp_path):
    """A field name reaches plotly's titles as text (static/plotly_text.js): tags and entities in it are
    drawn as the characters they are, never as a link or markup."""
    import torch

    import trajstore

    name = '<b>r</b><a href="javascript:alert(1)">y</a> a&amp;b &lt;'
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, {"input_ids": torch.ones(2, 4, dtype=torch.int64),
                     "attention_mask": torch.ones(2, 4, dtype=torch.int64), name: torch.tensor([1.0, 2.0])})
    out = tmp_path / "t.html"
    run_cli("view", tmp_path / "d", "--export", out, "--steps", "0", timeout=600)
    browser.get(out.as_uri())
    wait_js(browser, "document.querySelectorAll('.gtitle').length >= 9")
    titles = browser.execute_script("return Array.from(document.querySelectorAll('.gtitle')).map(e => e.textContent)")
    assert f"reward ({name})" in titles, titles
    assert browser.execute_script("return document.querySelectorAll('svg a, svg b').length") == 0
    no_alert(browser)
