"""``python -m benchmarks.view [--steps N] [--tokens T] [--batch B]``: the data behind ``trajstore view``.

Two figures of issue 15, on local disk with a warm page cache:

* the run page of a dump of ``--steps`` (10,000) small steps (8 trajectories of 16 tokens with
  ``loss_mask``, ``versions``, ``logprobs`` / ``old_logprobs``, ``rewards``) written by the Writer:
  ``GET /api/run?wait=0`` on a fresh server (what the page shows first: the reward curves, from the
  split's column index), the time until every curve is in (each step's token columns read on the
  server's thread), then ``GET /api/run`` again (the metrics of committed steps are kept);
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
        self.server = uvicorn.Server(uvicorn.Config(make_app(View(path)), host="127.0.0.1", port=self.port,
                                                    log_level="error", lifespan="off"))
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


def run(tmp: Path, steps: int = 10_000, B: int = 1024, T: int = 16_384, browser: bool = False) -> list[tuple[str, float]]:
    rows = []
    t0 = time.perf_counter()
    b = batch(8, 16)
    with trajstore.Writer(tmp / "many") as w:  # the real writer: the split's column index is written too
        for s in range(steps):
            w.append(s, b)
    print(f"# view: wrote {steps} steps in {time.perf_counter() - t0:.1f} s", flush=True)
    srv = _Server(tmp / "many")
    t0 = time.perf_counter()
    t, d = srv.get("/api/run?wait=0")
    assert len(d["steps"]) == steps and d["fields"]["pair"] == ["old_logprobs", "logprobs"]
    assert all(v is not None for v in d["series"]["reward_mean"]), "rewards not from the index"
    rows.append((f"GET /api/run?wait=0, {steps} steps, fresh server: reward curves, {d['pending']} steps pending (s)", t))
    t, d = srv.get("/api/run")
    assert d["pending"] == 0 and all(v is not None for v in d["series"]["length_mean"])
    rows.append((f"... every curve complete, {steps} steps (s, from the first request)", time.perf_counter() - t0))
    rows.append((f"GET /api/run, {steps} steps, again (s)", best(lambda: srv.get("/api/run")[0])))
    srv.close()
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


def _browser(srv: _Server, B: int, T: int) -> list[tuple[str, float]]:
    """Page load to ``data-ready`` (JSON fetched, table or tokens built) in headless Chromium
    (Debian's ``chromium`` + ``chromium-driver`` through Selenium), best of 3."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    o = Options()
    o.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        o.add_argument(a)
    drv = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=o)

    def load(path: str) -> float:
        t0 = time.perf_counter()
        drv.get(f"http://127.0.0.1:{srv.port}{path}")
        while drv.execute_script("return document.body.getAttribute('data-ready')") != "1":
            time.sleep(0.01)
        return time.perf_counter() - t0

    try:
        return [(f"Chromium: step page of {B} x {T} tokens, load to table drawn (s)", best(lambda: load("/step/train/0"))),
                (f"Chromium: trajectory page of {T} tokens, load to tokens coloured (s)",
                 best(lambda: load(f"/traj/train/0/{B // 2}")))]
    finally:
        drv.quit()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16_384)
    ap.add_argument("--browser", action="store_true", help="also time the pages in headless Chromium (selenium)")
    a = ap.parse_args()
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(Path(tmp), a.steps, a.batch, a.tokens, a.browser)
    print("| figure | value |\n|---|---|")
    for name, v in rows:
        print(f"| {name} | {v:.3f} |")


if __name__ == "__main__":
    main()
