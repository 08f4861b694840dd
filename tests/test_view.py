"""``trajstore view`` without a browser (tests/test_view_browser.py drives real Chromium): the JSON of each
page against the Reader's own data, path traversal, escaping, the exported file, a real tokenizer, the
diff page. The app runs in a real uvicorn server on a free port; requests go through urllib/http.client."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("plotly")

import uvicorn  # noqa: E402

import trajstore  # noqa: E402
from trajstore.inspection.traces import decode_ids, load_tokenizer  # noqa: E402
from trajstore.store import commit  # noqa: E402
from trajstore.read.tables import step_rows  # noqa: E402
from trajstore.view import data  # noqa: E402
from trajstore.view.app import PLOTLY_JS, SCRIPTS, STATIC, VIEW_SCRIPTS, make_app, shell  # noqa: E402
from trajstore.view.export import export  # noqa: E402
from trajstore.view.pages import View  # noqa: E402

from _dumps import make_tokenizer, padded_dump, small_batch, write  # noqa: E402

XSS = "<script>alert(1)</script>"


class Server:
    """``make_app(view)`` served by uvicorn on a free port of 127.0.0.1, in a thread."""

    def __init__(self, view: View):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        app = make_app(view, "127.0.0.1", self.port)  # it answers only Host 127.0.0.1:<port> (and localhost)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)

    def get(self, path: str) -> tuple[int, bytes, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}") as r:
                return r.status, r.read(), r.headers.get("content-type", "")
        except urllib.error.HTTPError as e:
            return e.code, e.read(), e.headers.get("content-type", "")

    def raw(self, target: str) -> tuple[int, bytes]:
        """GET ``target`` exactly as written (no client-side normalisation of ``..``)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port)
        c.putrequest("GET", target, skip_accept_encoding=True)
        c.endheaders()
        r = c.getresponse()
        out = r.status, r.read()
        c.close()
        return out

    def json(self, path: str) -> dict:
        status, body, ctype = self.get(path)
        assert status == 200, (path, status, body[:300])
        assert ctype.startswith("application/json")
        return json.loads(body)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def _select(batch: dict, rows: list[int]) -> dict:
    return {k: v[rows] if isinstance(v, torch.Tensor) else [v[i] for i in rows] for k, v in batch.items()}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory, tok) -> dict[str, Path]:
    """padded (with a skipped step), packed, list-of-trajectories and a 2-rank shard dump of the same data."""
    d = tmp_path_factory.mktemp("dumps")
    written = padded_dump(d / "padded", tok, steps=(0, 1, 2, 4))
    commit.record_skipped(d / "padded" / "train", 3, "No space left on device")
    r = trajstore.Reader(d / "padded")
    write(d / "packed", {s: r.read(s, layout="packed") for s in r.steps})
    lists = {}
    for s in r.steps:
        rows = step_rows(r, s)
        lists[s] = [{k: torch.as_tensor(np.asarray(v)) for k, v in row.items() if k != "uid"} for row in rows]
    write(d / "lists", lists)
    for rank, rows in enumerate([[0, 1], [2]]):
        with trajstore.Writer(d / "shards", rank=rank, world_size=2) as w:
            for s in (0, 1, 2, 4):
                if rank == 1 and s == 4:
                    continue  # step 4: rank 1's shard never came, the step is incomplete
                w.append(s, _select(written[s], rows))
    return {k: d / k for k in ("padded", "packed", "lists", "shards")}


def expected(reader: trajstore.Reader, s: int) -> dict:
    """The run-page metrics of step ``s`` computed here from the Reader's rows (the definitions of view/data.py)."""
    rows = step_rows(reader, s)
    rew = np.array([float(x["rewards"]) for x in rows])
    masks = [np.asarray(x["loss_mask"]) != 0 for x in rows]
    lens = np.array([m.sum() for m in masks], dtype=np.float64)
    tokens = sum(len(x["input_ids"]) for x in rows)
    resp_v = [np.asarray(x["versions"])[m] for x, m in zip(rows, masks)]
    top = max(v.max() for v in resp_v)
    lag = max(top - v.min() for v in resp_v)
    d = np.concatenate([np.abs(np.asarray(x["old_logprobs"], np.float64) - np.asarray(x["logprobs"], np.float64))[m]
                        for x, m in zip(rows, masks)])
    return {"reward_mean": rew.mean(), "reward_std": rew.std(), "reward_min": rew.min(), "reward_max": rew.max(),
            "length_mean": lens.mean(), "length_p95": np.percentile(lens, 95), "tokens": tokens,
            "version_lag": lag, "logprob_mismatch": d.mean()}


@pytest.mark.parametrize("kind", ["padded", "packed", "lists", "shards"])
def test_run_page_values_are_the_readers_statistics(dumps, kind):
    srv = Server(View(dumps[kind]))
    try:
        got = srv.json("/api/run")
    finally:
        srv.close()
    r = trajstore.Reader(dumps[kind])
    assert got["steps"] == r.steps == [0, 1, 2] + ([] if kind == "shards" else [4])
    assert got["fields"]["pair"] == ["old_logprobs", "logprobs"]
    for i, s in enumerate(r.steps):
        for m, v in expected(r, s).items():
            assert got["series"][m][i] == pytest.approx(float(v), rel=1e-12, abs=1e-12), (kind, s, m)
    want = [{"step": 3, "why": "skipped"}] if kind == "padded" else [{"step": 4, "why": "incomplete"}] \
        if kind == "shards" else []
    assert [{"step": m["step"], "why": m["why"]} for m in got["missing"]] == want


def test_step_and_trajectory_pages_hold_the_readers_data(dumps, tok):
    srv = Server(View(dumps["shards"], tokenizer=tok))
    try:
        r = trajstore.Reader(dumps["shards"])
        t = load_tokenizer(tok)
        for s in r.steps:
            rows = step_rows(r, s)
            page = srv.json(f"/api/step?split=train&step={s}")
            assert page["columns"][:4] == ["index", "reward", "length", "version"] and "uid" in page["columns"]
            assert len(page["rows"]) == len(rows) == 3
            for i, (row, x) in enumerate(zip(page["rows"], rows)):
                m = np.asarray(x["loss_mask"]) != 0
                assert row == {"index": i, "reward": float(x["rewards"]), "length": float(m.sum()),
                               "version": float(np.asarray(x["versions"])[m].max()), "uid": x["uid"]}
                tr = srv.json(f"/api/traj?split=train&step={s}&index={i}")
                toks = tr["tokens"]
                assert [k["id"] for k in toks] == [int(v) for v in x["input_ids"]]
                assert [k["mask"] for k in toks] == [int(v) for v in m]
                # float32 (and bf16, held as float32) values at float32 precision: the shortest repr
                assert [k["logprob"] for k in toks] == [str(np.float32(float(v))) for v in x["old_logprobs"]]
                assert [k["other"] for k in toks] == [str(np.float32(float(v))) for v in x["logprobs"]]
                assert [k["version"] for k in toks] == [str(int(v)) for v in x["versions"]]
                assert [k["text"] for k in toks] == [decode_ids(t, [int(v)]) for v in x["input_ids"]]
                assert any(re.search("[a-z]", k["text"]) for k in toks)  # decoded text, not ids
                k = toks[0]
                assert k["title"] == (f"id={k['id']} text={k['text']!r} old_logprobs={k['logprob']} "
                                      f"logprobs={k['other']} loss_mask={k['mask']} versions={k['version']}")
        assert srv.get("/api/traj?split=train&step=0&index=3")[0] == 404  # no such trajectory
        assert srv.get("/api/step?split=train&step=4")[0] == 404  # incomplete
        assert srv.get("/api/step?split=train&step=x")[0] == 400
    finally:
        srv.close()


def test_without_tokenizer_token_texts_are_ids(dumps):
    v = View(dumps["padded"])
    toks = v.traj(None, 0, 1)["tokens"]
    assert [k["text"] for k in toks] == [str(k["id"]) for k in toks]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), B=st.integers(1, 6), T=st.integers(1, 9), packed=st.booleans())
def test_run_metrics_match_rows_for_any_padded_batch(tmp_path_factory, seed, B, T, packed):
    d = tmp_path_factory.mktemp("h")
    b = small_batch(B, T, seed)
    b["response_mask"] = (torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) < 0.6).int() \
        * b["attention_mask"].int()
    w = write(d / "x", {5: b})
    if packed:
        w = write(d / "y", {5: w.read(5, layout="packed")})
    got = View(w.path).run()["series"]
    rows = step_rows(w, 5)
    lens = np.array([(np.asarray(x["response_mask"]) != 0).sum() for x in rows], dtype=np.float64)
    rew = np.array([float(x["rewards"]) for x in rows])
    assert got["length_mean"] == [pytest.approx(lens.mean())]
    assert got["length_p95"] == [pytest.approx(np.percentile(lens, 95))]
    assert got["reward_std"] == [pytest.approx(rew.std())]
    assert got["tokens"] == [float(sum(len(x["input_ids"]) for x in rows))]
    assert got["version_lag"] == [None] and "logprob_mismatch" not in got


@pytest.fixture(scope="module")
def xss_dump(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("xss") / "run"
    b = small_batch()
    b["response"] = [XSS, "ok", XSS + "&amp;"]
    write(d, {0: b, 1: b}, split=XSS.replace("<", "").replace(">", "").replace("/", "").replace("(", "")
          .replace(")", ""))
    return d


def test_traversal_is_refused_and_nothing_outside_is_served(dumps):
    srv = Server(View(dumps["padded"]))
    try:
        passwd = Path("/etc/passwd").read_bytes()[:20]
        for target in ["/static/../../etc/passwd", "/static/%2e%2e%2f%2e%2e%2fetc%2fpasswd", "/static//etc/passwd",
                       "/static/..%2f..%2fetc%2fpasswd", "/static/%2fetc%2fpasswd", "/static/.%2e/app.py",
                       "/static/../app.py", "/static/..", "/static/", "/static/__init__.py", "/etc/passwd",
                       "/../../etc/passwd", "/static/%00view.js", "/static/view.js%00", "/static/.view.css"]:
            status, body = srv.raw(target)
            assert status == 404, (target, status)
            assert passwd not in body and b"import" not in body, target
        assert srv.get("/static/view.js")[0] == 200
        status, body, _ = srv.get("/static/plotly.min.js")
        assert status == 200 and body == PLOTLY_JS.read_bytes()
    finally:
        srv.close()


def test_dump_text_is_escaped_everywhere(xss_dump, tmp_path):
    v = View(xss_dump)
    split = v.split
    srv = Server(v)
    try:
        assert XSS in json.dumps(srv.json(f"/api/step?split={split}&step=1"))  # the data holds it, as JSON
        for path in ["/", f"/step/{split}/1", f"/traj/{split}/1/0", "/diff", f"/step/{XSS}/1"]:
            status, body, ctype = srv.get(path.replace("<", "%3C").replace(">", "%3E"))
            assert status == 404 or ctype.startswith("text/html"), path
            assert b"<script>alert" not in body, path
        status, body, _ = srv.get("/step/%3Cscript%3Ealert(1)%3C%5Cscript%3E/1")  # a split named like a tag
        assert b"&lt;script&gt;alert(1)&lt;\\script&gt;" in body and b"<script>alert" not in body
    finally:
        srv.close()
    out = export(v, tmp_path / "x.html", [1])
    page = out.read_text()
    assert "<script>alert" not in page and "\\u003cscript\\u003ealert(1)" in page
    assert "textContent" in (STATIC / "common.js").read_text()  # el(): the one way the pages set text
    for name in SCRIPTS:
        js = (STATIC / name).read_text()
        for bad in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
            assert bad not in js, (name, bad)


def test_pages_and_export_load_every_script_in_order(dumps, tmp_path):
    """The shell loads plotly then SCRIPTS, the export inlines plotly then VIEW_SCRIPTS in the same order
    (compare.js, two runs only, is left out of it), and every script of static/ is one of them."""
    assert {p.name for p in STATIC.glob("*.js")} == set(SCRIPTS) and SCRIPTS[:len(VIEW_SCRIPTS)] == VIEW_SCRIPTS
    assert VIEW_SCRIPTS[:2] == ("plotly_text.js", "common.js") and VIEW_SCRIPTS[-1] == "view.js"
    page = shell("run", "t")
    assert re.findall(r'<script src="/static/([^"]+)"></script>', page) == ["plotly.min.js", *SCRIPTS]
    exported = export(View(dumps["padded"]), tmp_path / "run.html", [1]).read_text(encoding="utf-8")
    at = [exported.index(f"<script>{(STATIC / n).read_text(encoding='utf-8')}</script>") for n in VIEW_SCRIPTS]
    assert at == sorted(at) and exported.index(PLOTLY_JS.read_text(encoding="utf-8")[:200]) < at[0]
    assert (STATIC / "compare.js").read_text(encoding="utf-8") not in exported


def test_export_is_self_contained(dumps, tmp_path):
    out = export(View(dumps["padded"]), tmp_path / "run.html", [1, 2], per_step=2)
    page = out.read_text()
    bundle = PLOTLY_JS.read_text()
    assert bundle[:2000].replace("</script", "<\\/script") in page  # plotly inlined, from the package
    outside = re.sub(r"(?s)<script\b[^>]*>.*?</script>", "", page)  # the markup around the scripts
    assert not re.search(r"(?i)\b(src|href)\s*=\s*[\"']?\s*([a-z][a-z0-9+.-]*:|//)", outside)
    assert not re.search(r"(?i)https?://", outside)
    assert not re.search(r"(?i)<script[^>]*\bsrc\s*=", page) and not re.search(r"(?i)<link\b", page)
    data_block = re.search(r'(?s)<script id="trajstore-data" type="application/json">(.*?)</script>', page).group(1)
    got = json.loads(data_block)
    assert [(d["step"], len(d["rows"])) for d in got["steps"]] == [(1, 3), (2, 3)]
    assert [(t["step"], t["index"]) for t in got["trajs"]] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert got["runs"][0]["series"] == View(dumps["padded"]).run()["series"]


def test_diff_page_names_the_planted_divergence(tmp_path, tok):
    padded_dump(tmp_path / "a", tok)
    padded_dump(tmp_path / "b", tok, perturb=(1, 2, 3, 0.5))
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    srv = Server(View(tmp_path / "a", tokenizer=tok, other=tmp_path / "b"))
    try:
        d = srv.json("/api/diff")
        assert srv.get("/diff")[0] == 200
    finally:
        srv.close()
    f = d["first"]
    assert (f["step"], f["field"], f["trajectory"], f["token"]) == (1, "logprobs", 2, 3)
    assert float(f["a"]) - float(f["b"]) == pytest.approx(-0.5, abs=1e-6)  # float32 values as float32 text
    assert f["a"] == str(np.float32(f["a"])) and f["b"] == str(np.float32(f["b"]))
    ids_a = [t["id"] for t in d["tokens_a"]]
    rows = step_rows(trajstore.Reader(tmp_path / "a"), 1)
    assert ids_a == [int(v) for v in rows[2]["input_ids"]] == [t["id"] for t in d["tokens_b"]]
    assert View(tmp_path / "a", other=tmp_path / "c").diff()["first"] is None


def test_field_choice_follows_the_definitions():
    f = data.pick(["input_ids", "response_mask", "loss_mask", "version", "logprobs", "ref_logprobs"],
                  ["score", "scores", "reward"], {"score", "scores", "reward"})
    assert (f.reward, f.mask, f.versions, f.ids, f.pair) == ("reward", "loss_mask", "version", "input_ids",
                                                             ("logprobs", "ref_logprobs"))
    assert data.pick([], ["n", "adv"], {"adv"}).reward == "adv"
    assert data.pick(["a", "b"], [], set(), ("b", "a")).pair == ("b", "a")
    with pytest.raises(trajstore.ConfigError, match="no per-token field 'c'"):
        data.pick(["a", "b"], [], set(), ("a", "c"))


def test_run_page_steps_without_index_are_pending_then_read(dumps, monkeypatch, tmp_path):
    """Steps the column index does not cover are ``pending`` until the server's thread has read
    them from their files; indexed steps are answered at once; both give the same curves."""
    from trajstore.view import pages

    shutil.copytree(dumps["packed"], tmp_path / "d")
    shutil.rmtree(tmp_path / "d" / "_trajstore" / "train" / "index")
    gate = threading.Event()
    real = pages.data.read

    def slow(*a, **kw):
        assert gate.wait(30)
        return real(*a, **kw)

    monkeypatch.setattr(pages.data, "read", slow)
    assert View(dumps["packed"]).run(wait=0)["pending"] == 0  # indexed: no file read
    v = View(tmp_path / "d")
    first = v.run(wait=0)
    assert first["pending"] == 4 and all(x == [None] * 4 for x in first["series"].values())
    gate.set()
    full = v.run()
    assert full["pending"] == 0 and None not in full["series"]["length_mean"]
    assert full["series"] == View(dumps["packed"]).run()["series"]


def test_cli_view_export_and_missing_extra(dumps, tmp_path):
    """``trajstore view --export`` through the command; without the extra, exit 2 naming it."""
    import subprocess
    import sys

    from trajstore.cli import main

    out = tmp_path / "e.html"
    assert main(["view", str(dumps["padded"]), "--export", str(out), "--steps", "1-2", "--max-per-step", "1"]) == 0
    got = json.loads(re.search(r'(?s)<script id="trajstore-data" type="application/json">(.*?)</script>',
                               out.read_text()).group(1))
    assert [(t["step"], t["index"]) for t in got["trajs"]] == [(1, 0), (2, 0)]
    assert main(["view", str(dumps["padded"]), "--export", str(out), "--steps", "7-9"]) == 2
    code = ("import sys; sys.modules['starlette'] = None; from trajstore.cli import main; "
            f"sys.exit(main(['view', {str(dumps['padded'])!r}]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parent.parent)
    assert p.returncode == 2 and "pip install 'trajstore[view]'" in p.stderr, p.stderr


def test_non_finite_values_and_clashing_names(tmp_path):
    b = small_batch(B=3, T=4)
    b["rewards"] = torch.tensor([float("inf"), float("nan"), 1.0])
    b["logprobs"][0, 0] = float("-inf")
    b["length"] = torch.tensor([7, 8, 9])  # a field named like a column of the table
    r = write(tmp_path / "d", {0: b})
    v = View(r.path)
    srv = Server(v)
    try:
        step = srv.json("/api/step?step=0")
        run = srv.json("/api/run")
        tr = srv.json("/api/traj?step=0&index=0")
    finally:
        srv.close()
    assert [x["reward"] for x in step["rows"]] == ["inf", None, 1.0]
    assert [x["field:length"] for x in step["rows"]] == [7, 8, 9]
    assert [x["length"] for x in step["rows"]] == [float(n) for n in r.read(0)["attention_mask"].sum(1).tolist()]
    assert run["series"]["reward_mean"] == [None]  # inf in the mean; NaN left out
    assert tr["tokens"][0]["logprob"] == "-inf"


# ----------------------------------------------------------------------------- run page from the column index
def _series(path, use_index: bool) -> tuple[dict, list]:
    """The run page's JSON of ``path`` with or without the column index, and the steps read from files."""
    from contextlib import nullcontext
    from unittest import mock

    from trajstore.store.segments import Index
    from trajstore.view import pages

    reads, real = [], pages.data.read

    def spy(r, s, *a, **kw):
        reads.append(s)
        return real(r, s, *a, **kw)

    off = mock.patch.object(Index, "table", lambda *a, **k: ([], None, [])) if not use_index else nullcontext()
    with off, mock.patch.object(pages.data, "read", spy):
        got = View(path).run()
    return got, reads


@pytest.mark.parametrize("kind", ["padded", "packed", "lists", "shards"])
def test_run_curves_from_the_index_are_the_curves_from_the_files(dumps, kind):
    got, reads = _series(dumps[kind], True)
    want, file_reads = _series(dumps[kind], False)
    assert got == want and got["pending"] == 0
    assert file_reads == got["steps"]
    # every step of a padded or packed dict was answered by the index (lists of trajectories keep no digests)
    assert reads == (got["steps"] if kind == "lists" else [])


@pytest.mark.parametrize("pair", [("logprobs", "old_logprobs"), ("old_logprobs", "input_ids")])
def test_a_pair_asked_for_without_digests_is_read_from_the_files(dumps, pair):
    v = View(dumps["padded"])
    with pytest.MonkeyPatch.context() as mp:
        from trajstore.view import pages
        calls = []
        real = pages.data.read
        mp.setattr(pages.data, "read", lambda r, s, *a, **k: calls.append(s) or real(r, s, *a, **k))
        got = v.run(pair=pair)
    assert got["fields"]["pair"] == list(pair) and calls == got["steps"]  # no digest of that pair
    from trajstore.store.segments import Index
    from unittest import mock
    with mock.patch.object(Index, "table", lambda *a, **k: ([], None, [])):
        assert View(dumps["padded"]).run(pair=pair)["series"] == got["series"]


def _run_batch(draw, kind: str) -> dict:
    """A generated batch with the run page's fields (some left out): a logprob pair, versions, masks."""
    from trajstore.testing import padded_batches, prompt_completion_batches, tensors, two_sided_batches

    if kind == "padded":
        b = draw(padded_batches(max_batch=4))
        m = b["attention_mask"].bool()
        b["old_logprobs"] = draw(tensors(tuple(m.shape), [torch.float32, torch.bfloat16, torch.float16])) \
            .masked_fill(~m, 0.0)
    elif kind == "two_sided":
        b = draw(two_sided_batches(max_batch=4))
        rm = b["response_mask"].bool()
        b["logprobs"] = draw(tensors(tuple(rm.shape), [torch.float32])).masked_fill(~rm, 0.0)
        b["rollout_logprobs"] = draw(tensors(tuple(rm.shape), [torch.float32, torch.bfloat16])).masked_fill(~rm, 0.0)
        b["versions"] = draw(tensors(tuple(rm.shape), [torch.int64, torch.int16])).masked_fill(~rm, 0)
        b["rewards"] = draw(tensors((rm.shape[0],), [torch.float32, torch.float64]))
    else:
        b = draw(prompt_completion_batches(max_batch=4))
    for k in ("loss_mask", "versions", "old_logprobs", "rewards"):
        if k in b and draw(st.integers(0, 4)) == 0:
            del b[k]
    return b


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(kind=st.sampled_from(["padded", "two_sided", "prompt_completion"]), n=st.integers(1, 3),
       how=st.sampled_from(["padded", "packed", "shards"]), data=st.data())
def test_run_curves_from_the_index_equal_the_files_for_any_batch(tmp_path_factory, kind, n, how, data):
    from hypothesis import assume

    batches = {s: _run_batch(data.draw, kind) for s in range(n)}
    d = tmp_path_factory.mktemp("ix")
    r = write(d / "a", batches)
    if how == "packed":
        try:
            r = write(d / "b", {s: r.read(s, layout="packed") for s in r.steps})
        except trajstore.TrajstoreError:
            assume(False)  # not every batch has a packed form that writes back
    elif how == "shards":
        assume(kind != "prompt_completion" and all(len(b["attention_mask"]) >= 2 for b in batches.values()))
        for rank in range(2):
            with trajstore.Writer(d / "b", rank=rank, world_size=2) as w:
                for s, b in batches.items():
                    B = len(b["attention_mask"])
                    w.append(s, _select(b, list(range(B // 2)) if rank == 0 else list(range(B // 2, B))))
        r = trajstore.Reader(d / "b")
    got, reads = _series(r.path, True)
    want, _ = _series(r.path, False)
    assert got == want
    same = len({tuple(sorted((k, str(getattr(v, "dtype", type(v)))) for k, v in b.items()))
                for b in batches.values()}) == 1
    if kind == "padded" and same:
        assert reads == []  # every step from the index


def test_digest_blocks_change_no_value(monkeypatch):
    """``store/digest.py`` works over blocks of whole rows: any block size gives the same bits."""
    from trajstore.store import digest

    rng = np.random.default_rng(7)
    lens = rng.integers(0, 40, 60)
    offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    n = int(offs[-1])
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n)
    a[::17] = np.inf
    m, v = rng.integers(0, 2, n).astype(np.int32), rng.integers(-5, 9, n).astype(np.int16)

    def run():
        return [*digest.absdiff((offs, a), (offs, b), (offs, m))[:2], *digest.extremes(offs, v, m != 0),
                digest.count(offs, m != 0)]

    want = run()
    for block in (1, 5, 64):
        monkeypatch.setattr(digest, "BLOCK", block)
        got = run()
        assert all(x.tobytes() == y.tobytes() for x, y in zip(got, want)), block
    assert want[1].tolist() == [float((m[offs[i]:offs[i + 1]] != 0).sum()) for i in range(60)]


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(0, 12), min_size=1, max_size=30),
       dtype=st.sampled_from(["int16", "int32", "int64", "float32"]), seed=st.integers(0, 2**16),
       block=st.sampled_from([None, 1, 7]), given_n=st.booleans())
def test_digest_extremes_are_each_rows_kept_max_and_min(lens, dtype, seed, block, given_n):
    """``digest.extremes``: per row, the max and min of its values where the mask keeps them (NaN for a row
    with none, NaN where a kept value is NaN), whatever the block size and whether the count is given."""
    from trajstore.store import digest

    rng = np.random.default_rng(seed)
    offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    n = int(offs[-1])
    v = (rng.integers(-1000, 1000, n) if dtype != "float32" else rng.standard_normal(n)).astype(dtype)
    if dtype == "float32" and n:
        v[rng.integers(0, n, 3)] = [np.inf, -np.inf, np.nan]
    keep = rng.random(n) < 0.6
    with pytest.MonkeyPatch.context() as mp:
        if block is not None:
            mp.setattr(digest, "BLOCK", block)
        hi, lo = digest.extremes(offs, v, keep, digest.count(offs, keep) if given_n else None)
    for i in range(len(lens)):
        k = v[offs[i]:offs[i + 1]][keep[offs[i]:offs[i + 1]]]
        want = (np.maximum.reduce(k), np.minimum.reduce(k)) if len(k) else (np.nan, np.nan)
        np.testing.assert_array_equal([hi[i], lo[i]], np.asarray(want, np.float64))
