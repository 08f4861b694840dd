"""``trajstore view`` answers only requests addressed to the host and port it is bound to (issue 27, item
6): a web page whose DNS name an attacker points at 127.0.0.1 (DNS rebinding) sends its own name in
``Host`` and gets 421, never the dump; a request without a Host header gets 400."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("plotly")

import uvicorn  # noqa: E402

import trajstore  # noqa: E402
from trajstore.view.app import HostCheck, make_app  # noqa: E402
from trajstore.view.pages import View  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("host") / "dump"
    with trajstore.Writer(d) as w:
        w.append(0, {"input_ids": torch.ones(2, 4, dtype=torch.int64),
                     "attention_mask": torch.ones(2, 4, dtype=torch.int64), "rewards": torch.tensor([1.0, 2.0])})
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    srv = uvicorn.Server(uvicorn.Config(make_app(View(d), "127.0.0.1", port), host="127.0.0.1", port=port,
                                        log_level="error", lifespan="off"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    while not srv.started:
        assert t.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    yield port
    srv.should_exit = True
    t.join(10)


def _get(port: int, path: str, host: str | None) -> tuple[int, bytes]:
    """GET ``path`` from 127.0.0.1:``port`` with ``Host: host`` (None: no Host header at all)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
    if host is not None:
        c.putheader("Host", host)
    c.endheaders()
    r = c.getresponse()
    out = r.status, r.read()
    c.close()
    return out


PATHS = ["/", "/api/run", "/api/step?step=0", "/api/traj?step=0&index=0", "/step/train/0", "/static/view.js"]


@pytest.mark.parametrize("path", PATHS)
def test_bound_host_and_port_are_answered(server, path):
    for host in (f"127.0.0.1:{server}", f"localhost:{server}", f"LOCALHOST:{server}", f"[::1]:{server}"):
        status, body = _get(server, path, host)
        assert status == 200, (host, status, body[:200])


@pytest.mark.parametrize("path", PATHS)
def test_other_hosts_are_refused(server, path):
    for host in (f"evil.example:{server}", "evil.example", f"127.0.0.1:{server + 1}", "127.0.0.1",
                 f"localhost.evil.example:{server}", f"127.0.0.1.nip.io:{server}", f"127.0.0.2:{server}",
                 f"127.0.0.1:{server}@evil.example", f"127.0.0.1:{server}:{server}", ""):
        status, body = _get(server, path, host)
        assert status in (400, 421), (host, status)
        assert b"rewards" not in body and b"train" not in body, body[:200]
    status, body = _get(server, path, None)
    assert status == 400, status


def test_rebinding_page_cannot_read_the_run(server):
    """What a rebinding page's script gets from /api/run: 421 and a one-line reason, no data."""
    status, body = _get(server, "/api/run", f"attacker.example:{server}")
    assert status == 421
    assert b"not the address this server is bound to" in body
    ok = json.loads(_get(server, "/api/run", f"127.0.0.1:{server}")[1])
    assert ok  # the same request with the bound host is answered


def test_host_rules_of_other_bindings():
    app = object()
    any_ip = HostCheck(app, "0.0.0.0", 8000)
    for h in ("127.0.0.9:8000", "localhost:8000", "127.0.0.1:8000", "[::1]:8000",
              f"{socket.gethostname()}:8000"):
        assert any_ip.allowed(h), h  # an address literal cannot be rebound; names: this machine's only
    for h in ("evil.example:8000", "127.0.0.9:8001", "127.0.0.9", "::1:8000"):
        assert not any_ip.allowed(h), h
    named = HostCheck(app, "trajstore-host.example", 9000)
    assert named.allowed("trajstore-host.example:9000") and named.allowed("TRAJSTORE-HOST.example:9000")
    assert not named.allowed("localhost:9000") and not named.allowed("other.example:9000")
    v6 = HostCheck(app, "::1", 9000)
    assert v6.allowed("[::1]:9000") and v6.allowed("localhost:9000") and not v6.allowed("evil.example:9000")
