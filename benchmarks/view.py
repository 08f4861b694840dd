"""``python -m benchmarks.view [--steps N] [--tokens T] [--batch B]``: the data behind ``trajstore view``.

Two figures of issue 15, on local disk with a warm page cache:

* the run page of a dump of ``--steps`` (10,000) small steps (8 trajectories of 16 tokens with
  ``loss_mask``, ``versions``, ``logprobs`` / ``old_logprobs``, ``rewards``) written by the Writer:
  ``GET /api/run`` on a fresh server (every curve, from the split's column index: its per-step
  rewards and per-trajectory digests, ``store/digest.py``), then again (the metrics of committed
  steps are kept), and ``GET /api/run`` of a copy without its index (an older dump: each step's
  footer and token columns read on the server's thread); with ``--browser``, the run page loaded
  in headless Chromium on a fresh server until every curve is drawn (``data-ready``);
* the step page of one step of ``--batch`` (1,024) trajectories of ``--tokens`` (16,384) tokens:
  ``GET /api/step`` (the scalar columns and the loss-mask and versions columns; no token ids, no
  log-probs), and ``GET /api/traj`` of one of its trajectories (one row group read); with
  ``--browser``, those pages loaded in headless Chromium until drawn (``data-ready``).

Each request goes through a real uvicorn server on 127.0.0.1 (``tests/test_view.py``'s set-up) and
is timed at the client, JSON included; best of 3 unless said. """

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

import trajstore


def batch(B: int, T: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g)
    return {"input_ids": torch.randint(0, 152_064, (B, T), generator=g),
            "attention_mask": torch.ones(B, T, dtype=torch.bool),
            "loss_mask": torch.arange(T).expand(B, T) >= T // 4,
            "logprobs": lp, "old_logprobs": lp + 0.01 * torch.randn(B, T, generator=g),
            "versions": torch.randint(10, 14, (B, T), generator=g, dtype=torch.int32),
            "rewards": torch.randn(B, generator=g)}


class _Server:
    def __init__(self, path: Path):
        import uvicorn

        from trajstore.view.app import make_app
        from trajstore.view.pages import View

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        app = make_app(View(path), "127.0.0.1", self.port)  # it answers Host 127.0.0.1:<port> only
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def get(self, url: str) -> tuple[float, dict]:
        t0 = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{url}") as r:
            body = json.loads(r.read())
        return time.perf_counter() - t0, body

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def best(fn, repeat: int = 3) -> float:
    return min(fn() for _ in range(repeat))


def run(tmp: Path, steps: int = 10_000, B: int = 1024, T: int = 16_384, browser: bool = False,
        big: bool = True) -> list[tuple[str, float]]:
    rows = []
    t0 = time.perf_counter()
    b = batch(8, 16)
    with trajstore.Writer(tmp / "many") as w:  # the real writer: the split's column index is written too
        for s in range(steps):
            w.append(s, b)
    print(f"# view: wrote {steps} steps in {time.perf_counter() - t0:.1f} s", flush=True)
    srv = _Server(tmp / "many")
    t, d = srv.get("/api/run")
    assert len(d["steps"]) == steps and d["fields"]["pair"] == ["old_logprobs", "logprobs"] and d["pending"] == 0
    assert all(v is not None for m in ("reward_mean", "length_mean", "version_lag", "logprob_mismatch")
               for v in d["series"][m]), "a curve not complete"
    rows.append((f"GET /api/run, {steps} steps, fresh server: every curve, from the column index (s)", t))
    rows.append((f"GET /api/run, {steps} steps, again (s)", best(lambda: srv.get("/api/run")[0])))
    srv.close()
    shutil.copytree(tmp / "many", tmp / "old")
    shutil.rmtree(tmp / "old" / "_trajstore" / "train" / "index")
    srv = _Server(tmp / "old")
    t, d2 = srv.get("/api/run")
    assert d2["series"] == d["series"]
    rows.append((f"GET /api/run, {steps} steps without the index (an older dump), fresh server: every curve (s)", t))
    srv.close()
    if browser:
        srv = _Server(tmp / "many")
        with _Chromium() as drv:
            rows.append((f"Chromium: run page of {steps} steps, fresh server, load until every curve is drawn (s)",
                         drv.load(srv, "/")))
            rows.append((f"Chromium: run page of {steps} steps, again (s)", best(lambda: drv.load(srv, "/"))))
        srv.close()
    if not big:
        return rows
    t0 = time.perf_counter()
    with trajstore.Writer(tmp / "big") as w:
        w.append(0, batch(B, T))
    print(f"# view: wrote one step of {B} x {T} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
    srv = _Server(tmp / "big")
    t, d = srv.get("/api/step?step=0")
    assert len(d["rows"]) == B
    rows.append((f"GET /api/step, {B} x {T} tokens, first (s)", t))
    rows.append((f"GET /api/step, {B} x {T} tokens (s)", best(lambda: srv.get("/api/step?step=0")[0])))
    rows.append((f"GET /api/traj, one trajectory of {T} tokens (s)",
                 best(lambda: srv.get(f"/api/traj?step=0&index={B // 2}")[0])))
    if browser:
        rows += _browser(srv, B, T)
    srv.close()
    return rows


class _Chromium:
    """Headless Chromium (Debian's ``chromium`` + ``chromium-driver`` through Selenium)."""

    def __enter__(self):
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service

        o = Options()
        o.binary_location = "/usr/bin/chromium"
        for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
            o.add_argument(a)
        self.drv = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=o)
        return self

    def load(self, srv: _Server, path: str) -> float:
        """Page load until ``data-ready`` (JSON fetched, curves, table or tokens drawn)."""
        t0 = time.perf_counter()
        self.drv.get(f"http://127.0.0.1:{srv.port}{path}")
        while self.drv.execute_script("return document.body.getAttribute('data-ready')") != "1":
            time.sleep(0.01)
        return time.perf_counter() - t0

    def __exit__(self, *exc):
        self.drv.quit()


def _browser(srv: _Server, B: int, T: int) -> list[tuple[str, float]]:
    """Step and trajectory pages loaded to ``data-ready`` in headless Chromium, best of 3."""
    with _Chromium() as c:
        return [(f"Chromium: step page of {B} x {T} tokens, load to table drawn (s)",
                 best(lambda: c.load(srv, "/step/train/0"))),
                (f"Chromium: trajectory page of {T} tokens, load to tokens coloured (s)",
                 best(lambda: c.load(srv, f"/traj/train/0/{B // 2}")))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16_384)
    ap.add_argument("--browser", action="store_true", help="also time the pages in headless Chromium (selenium)")
    ap.add_argument("--no-big", action="store_true", help="leave out the step of --batch x --tokens")
    a = ap.parse_args()
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(Path(tmp), a.steps, a.batch, a.tokens, a.browser, big=not a.no_big)
    print("| figure | value |\n|---|---|")
    for name, v in rows:
        print(f"| {name} | {v:.3f} |")


if __name__ == "__main__":
    main()
