"""The page scripts of ``trajstore view`` run in Node over a small stand-in DOM, without a browser: each
page loads the scripts its HTML names, in that order, from the server on 127.0.0.1 (the exported file: its
inlined scripts), builds itself from the real JSON with no error, and marks itself ready. A script that
calls a helper of another script it does not reach, or a page that loads a script too late, fails here in
seconds (tests/test_view_browser.py and tests/test_view_compare_browser.py check what the pages show)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("plotly")
from _provision import ensure_apt  # noqa: E402

_why = None if shutil.which("node") else ensure_apt("nodejs")  # installed by the test itself on a fresh machine
pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason=_why or "needs node to run the page scripts")

from trajstore.view.export import export  # noqa: E402
from trajstore.view.pages import View  # noqa: E402

from _dumps import make_tokenizer, padded_dump  # noqa: E402
from test_view import Server  # noqa: E402

# A page in Node: its <body> attributes and scripts from the HTML (plotly itself stands in as Plotly.newPlot
# and react recording the plot), the scripts run in order in one context, then the page's elements.
_HARNESS = r"""
const fs = require("fs"), vm = require("vm");
const [source, base] = process.argv.slice(2);
const thrown = [];
class El {
  constructor(tag) { this.tagName = tag.toUpperCase(); this.attrs = {}; this.children = []; this.style = {};
    this.parentNode = null; this.own = ""; this.listeners = {}; const self = this;
    this.classList = {add(c) { self.attrs["class"] = ((self.attrs["class"] || "") + " " + c).trim(); }}; }
  setAttribute(k, v) { this.attrs[k] = String(v); }
  getAttribute(k) { return k in this.attrs ? this.attrs[k] : null; }
  removeAttribute(k) { delete this.attrs[k]; }
  appendChild(c) {
    if (c.tagName === "#FRAGMENT") { c.children.slice().forEach((x) => this.appendChild(x)); return c; }
    return this.insertBefore(c, null);
  }
  insertBefore(c, ref) {
    if (c.parentNode) c.parentNode.children.splice(c.parentNode.children.indexOf(c), 1);
    c.parentNode = this;
    const at = ref ? this.children.indexOf(ref) : -1;
    if (at < 0) this.children.push(c); else this.children.splice(at, 0, c);
    return c;
  }
  get firstChild() { return this.children[0] || null; }
  set textContent(t) {
    this.children.forEach((c) => { c.parentNode = null; });
    this.children = []; this.own = String(t);
  }
  get textContent() { return this.own + this.children.map((c) => c.textContent).join(""); }
  get value() { const o = this.children.find((c) => c.tagName === "OPTION"); return o ? o.attrs.value : ""; }
  addEventListener(ev, f) { (this.listeners[ev] = this.listeners[ev] || []).push(f); }
  on(ev, f) { this.addEventListener(ev, f); }
  all() { return [this].concat(...this.children.map((c) => c.all())); }
}
function unescape(s) {
  const map = {"&quot;": '"', "&#x27;": "'", "&lt;": "<", "&gt;": ">", "&amp;": "&"};
  return s.replace(/&(quot|#x27|lt|gt|amp);/g, (m) => map[m]);
}
async function main() {
  const exported = source.startsWith("file:");
  const text = async (path) => (await fetch(base + path)).text();
  const html = exported ? fs.readFileSync(source.slice(5), "utf8") : await text(source);
  const body = new El("body"), app = body.appendChild(new El("div"));
  app.setAttribute("id", "app");
  const battrs = /<body([^>]*)>/.exec(html)[1];
  for (const m of battrs.matchAll(/([\w-]+)="([^"]*)"/g)) body.setAttribute(m[1], unescape(m[2]));
  const scripts = [];
  for (const m of html.matchAll(/<script( [^>]*)?>([\s\S]*?)<\/script>/g)) {
    const src = /src="\/static\/([^"]+)"/.exec(m[1] || ""), id = /id="([^"]+)"/.exec(m[1] || "");
    if (id) { const d = body.appendChild(new El("script")); d.setAttribute("id", id[1]); d.own = m[2]; }
    else if (src) { if (src[1] !== "plotly.min.js") scripts.push([src[1], await text("/static/" + src[1])]); }
    else if (!/\* plotly\.js v/.test(m[2].slice(0, 200))) scripts.push(["inline " + scripts.length, m[2]]);
  }
  const document = {body: body, createElement: (t) => new El(t), createDocumentFragment: () => new El("#fragment"),
    createTextNode: (t) => { const e = new El("#text"); e.own = String(t); return e; },
    getElementById: (id) => body.all().find((e) => e.attrs.id === id) || null};
  const plot = (div, data, layout) => { div.plotted = {data: data, layout: layout}; return Promise.resolve(div); };
  const search = !exported && source.includes("?") ? source.slice(source.indexOf("?")) : "";
  const ctx = {document: document, location: {search: search, href: "", hash: ""}, URLSearchParams: URLSearchParams,
    console: console, fetch: (u) => fetch(base + u), Plotly: {newPlot: plot, react: plot}};
  ctx.window = ctx;
  vm.createContext(ctx);
  for (const [name, text] of scripts) {
    try { vm.runInContext(text, ctx, {filename: name}); } catch (e) { thrown.push(name + ": " + e); }
  }
  const compare = body.attrs["data-diff"] === "1" && !exported;
  for (let i = 0; i < 600; i++) {
    if (body.attrs["data-ready"] === "1" && (!compare || body.attrs["data-compare-ready"] === "1")) break;
    await new Promise((r) => setTimeout(r, 50));
  }
  const els = body.all();
  process.stdout.write(JSON.stringify({scripts: scripts.map((s) => s[0]), thrown: thrown, body: body.attrs,
    errors: els.filter((e) => /\berror\b/.test(e.attrs["class"] || "")).map((e) => e.textContent),
    ids: els.map((e) => e.attrs.id).filter(Boolean), plots: els.filter((e) => e.plotted).length,
    tokens: els.filter((e) => /\btok\b/.test(e.attrs["class"] || "")).length,
    rows: els.filter((e) => e.tagName === "TR" && e.attrs["data-index"] !== undefined).length}));
}
process.on("unhandledRejection", (e) => thrown.push("unhandled: " + e));
main().catch((e) => { thrown.push("harness: " + e.stack); process.stdout.write(JSON.stringify({thrown: thrown})); });
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("node") / "page.js"
    p.write_text(_HARNESS)
    return p


@pytest.fixture(scope="module")
def views(tmp_path_factory):
    d = tmp_path_factory.mktemp("view-scripts")
    tok = make_tokenizer(d)
    padded_dump(d / "a", tok)
    padded_dump(d / "b", tok, perturb=(1, 2, 3, 0.5))
    one, two = Server(View(d / "a", tokenizer=tok)), Server(View(d / "a", tokenizer=tok, other=d / "b"))
    yield d, one, two
    one.close()
    two.close()


def page(harness: Path, source: str, srv: Server | None) -> dict:
    """What ``source`` (a path of the server ``srv``, or ``file:`` and an exported file) builds in Node."""
    base = f"http://127.0.0.1:{srv.port}" if srv else "http://127.0.0.1:9"  # the export: never fetched
    p = subprocess.run(["node", str(harness), source, base], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert not out["thrown"] and not out["errors"], out
    assert out["body"].get("data-ready") == "1", out
    return out


def test_each_page_builds_from_its_scripts(harness, views):
    _, one, two = views
    split = View(views[0] / "a").split
    run = page(harness, "/", one)
    assert run["scripts"][:2] == ["plotly_text.js", "common.js"] and run["scripts"][-2:] == ["view.js", "compare.js"]
    curves = [i for i in run["ids"] if i.startswith("curve-")]
    assert curves and run["plots"] == len(curves) and "missing" in run["ids"]
    n = len(one.json(f"/api/step?split={split}&step=1")["rows"])
    step = page(harness, f"/step/{split}/1", one)
    assert step["rows"] == n and step["plots"] == 2 and {"traj-table", "filter", "hist-reward"} <= set(step["ids"])
    traj = page(harness, f"/traj/{split}/1/2", one)
    toks = one.json(f"/api/traj?split={split}&step=1&index=2")["tokens"]
    assert traj["tokens"] == len(toks) > 0 and {"tokens", "colour", "legend"} <= set(traj["ids"])


def test_two_dumps_pages_build_from_their_scripts(harness, views):
    d, _, two = views
    split = View(d / "a").split
    run = page(harness, "/", two)
    assert run["body"]["data-compare-ready"] == "1" and "overlay" in run["ids"] and "diff-link" in run["ids"]
    assert any(i.startswith("overlay-") for i in run["ids"])
    diff = page(harness, "/diff", two)
    assert {"diff-summary", "divergence", "tokens-a", "tokens-b", "legend-a", "diverging-entries"} <= set(diff["ids"])
    assert diff["tokens"] > 0 and diff["body"]["data-compare-ready"] == "1"
    got = page(harness, f"/aligned/{split}/1/2?field=logprobs", two)  # the planted divergence's trajectory
    n = len(two.json(f"/api/compare/traj?split={split}&step=1&row=2&field=logprobs")["tokens"])
    assert {"aligned-info", "scale", "aligned-a", "aligned-b"} <= set(got["ids"]) and got["tokens"] == 2 * n > 0


def test_exported_file_builds_from_its_inlined_scripts(harness, views, tmp_path):
    d, one, _ = views
    v = View(d / "a")
    out = export(v, tmp_path / "e.html", [1], per_step=2)
    got = page(harness, f"file:{out}", None)
    assert len(got["scripts"]) == 7  # VIEW_SCRIPTS, plotly left out
    assert f"traj-table-{v.split}-1" in got["ids"] and f"tokens-{v.split}-1-1" in got["ids"]
    assert any(i.startswith("curve-") for i in got["ids"]) and got["tokens"] > 0
