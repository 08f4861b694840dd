"""Real headless Chromium for the ``trajstore view`` tests (tests/test_view_browser.py): Debian's
``chromium`` and ``chromium-driver`` (installed once per session by ``_provision.ensure_apt`` where
missing; skipped with the command to run where that is impossible), driven by Selenium through the
system ``/usr/bin/chromedriver`` -- Selenium Manager is never asked for a driver (it would download one).
``ViewServer`` runs the ``trajstore view`` console script on a free 127.0.0.1 port (in ``cwd`` if given)."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from _dumps import cli
from _provision import ensure_apt

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
WINDOW = (1400, 1000)
# any fetch of this browser fails: no proxy answers on port 9 and no host name resolves
OFFLINE = ["--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-bypass-list=<-loopback>"]


def need_chromium() -> None:
    """Skip (with the reason) where Chromium and its driver are missing and cannot be installed."""
    why = ensure_apt("chromium", "chromium-driver")
    if why is None and not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        why = f"{CHROMIUM} or {CHROMEDRIVER} missing after installing chromium and chromium-driver"
    if why:
        pytest.skip(why)
    pytest.importorskip("selenium")


def need_viewer() -> None:
    """``need_chromium``, and skip where the ``view`` extra (starlette, uvicorn, plotly) is not installed."""
    need_chromium()
    for m in ("starlette", "uvicorn", "plotly"):
        pytest.importorskip(m)


def make_driver(extra: list[str] = (), profile: Path | None = None) -> Any:
    """A headless Chromium of a fixed window size through the system chromedriver. Selenium Manager
    (which would download a driver and a browser) raises if anything calls it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.selenium_manager import SeleniumManager

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ["--headless=new", f"--window-size={WINDOW[0]},{WINDOW[1]}", "--disable-gpu", "--disable-dev-shm-usage",
              "--no-first-run", "--disable-extensions", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--hide-scrollbars", "--force-device-scale-factor=1",
              f"--user-data-dir={profile or tempfile.mkdtemp(prefix='trajstore-chromium-')}", *extra]:
        opts.add_argument(a)
    if os.geteuid() == 0:
        opts.add_argument("--no-sandbox")  # Chromium's sandbox refuses to run as root
    opts.unhandled_prompt_behavior = "ignore"  # an alert stays open for the test to see
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=CHROMEDRIVER, env={**os.environ, "SE_OFFLINE": "true"})

    def no_manager(*a, **k):
        raise AssertionError("Selenium Manager was asked for a driver: the system chromedriver must be used")

    with mock.patch.object(SeleniumManager, "binary_paths", no_manager):
        driver = webdriver.Chrome(options=opts, service=service)
    driver.set_window_size(*WINDOW)
    driver.set_page_load_timeout(120)
    driver.set_script_timeout(120)
    return driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ViewServer:
    """``trajstore view *args --port N`` in a subprocess, up once ``GET /`` answers."""

    def __init__(self, *args: Any, log: Path, cwd: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(cli() + ["view", *map(str, args), "--port", str(self.port)],
                                     stdout=self._out, stderr=subprocess.STDOUT, cwd=cwd,
                                     env={**os.environ, "NO_COLOR": "1"})
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise AssertionError(f"trajstore view {args} exited with {self.proc.returncode}:\n"
                                     f"{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"trajstore view {args} did not answer on {self.url}:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


def get_raw(url_base: str, raw_path: str) -> tuple[int, bytes]:
    """``GET raw_path`` sent as is (no client-side normalisation of ``..`` or escapes): status, body."""
    import http.client

    host, port = url_base.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        c.request("GET", raw_path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def save_shot(driver: Any, name: str, folders: list[Path]) -> None:
    """A PNG of the current page as ``<folder>/<name>.png`` in each folder."""
    for d in folders:
        d.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(d / f"{name}.png")), f"no screenshot of {name}"

