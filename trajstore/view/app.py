"""The Starlette app of ``trajstore view``: read-only pages over one dump (two for the diff page).

Routes: ``/`` (run), ``/step/{split}/{step}``, ``/traj/{split}/{step}/{index}``, ``/diff``; their data as
JSON under ``/api/run``, ``/api/step``, ``/api/traj``, ``/api/diff``; ``/static/{name}`` serves only the
files of this package's ``static`` folder and plotly's own bundle (``plotly/package_data/plotly.min.js``),
never a path taken from the request. Every page is a small HTML shell (its title escaped) loading plotly,
then ``SCRIPTS`` in order: ``plotly_text.js`` hands plotly every title and trace name with ``& < >`` as
entities (plotly reads tags in them, and a field name is dump data); ``common.js`` the helpers the page
scripts share; ``run.js``, ``step.js``, ``tokens.js``, ``diff.js`` build the pages, ``view.js`` picks the
page; ``compare.js`` (shell only) adds the sections of two runs. They fetch the JSON and build the page
with ``textContent`` (dump data never reaches ``innerHTML``).

Every request is answered only if its ``Host`` header names the address and port the server is bound
to (``HostCheck``; a web page whose domain an attacker points at 127.0.0.1, DNS rebinding, cannot read
the dump through the user's browser): a request without one gets 400, any other host 421. Bound to a
loopback address, the loopback names (``localhost``, ``127.0.0.1``, ``[::1]``) are that address too;
bound to every interface (``0.0.0.0``, ``::``), any IP address literal and this machine's own names
(``socket.gethostname``, ``getfqdn``), never another DNS name.
"""

from __future__ import annotations

import errno
import html
import ipaddress
import json
import os
import re
import socket
from pathlib import Path
from typing import Any

import plotly
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ..errors import ConfigError, TrajstoreError
from . import compare
from .pages import View

STATIC = Path(__file__).resolve().parent / "static"
PLOTLY_JS = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
VIEW_SCRIPTS = ("plotly_text.js", "common.js", "run.js", "step.js", "tokens.js", "diff.js", "view.js")
SCRIPTS = VIEW_SCRIPTS + ("compare.js",)  # a page's scripts, in order, after plotly (the export: VIEW_SCRIPTS)
HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"}


def static_files() -> dict[str, Path]:
    """The names ``/static/`` serves and their files (nothing else is ever served)."""
    out = {p.name: p for p in STATIC.iterdir() if p.is_file() and _NAME.match(p.name)}
    out["plotly.min.js"] = PLOTLY_JS
    return out


def shell(page: str, title: str, attrs: dict[str, Any] | None = None) -> str:
    """The HTML of a page: ``<body data-page=...>``, an escaped ``<h1>``, plotly and ``SCRIPTS``."""
    a = "".join(f' data-{k}="{html.escape(str(v), quote=True)}"' for k, v in (attrs or {}).items())
    t = html.escape(title)
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{t}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">'
            f'<link rel="stylesheet" href="/static/view.css"></head>\n'
            f'<body data-page="{page}"{a}><nav><a href="/">run</a></nav><h1>{t}</h1><div id="app"></div>\n'
            + "".join(f'<script src="/static/{n}"></script>' for n in ("plotly.min.js",) + SCRIPTS)
            + "\n</body></html>\n")


def _int(req: Request, name: str) -> int:
    v = req.query_params.get(name, req.path_params.get(name))
    if v is None or not re.fullmatch(r"\d{1,12}", str(v)):
        raise _Bad(f"{name} must be a non-negative integer, got {v!r}")
    return int(v)


class _Bad(ValueError):
    pass


def _pair(req: Request) -> tuple[str, str] | None:
    p = req.query_params.get("pair")
    if not p:
        return None
    parts = p.split(",")
    if len(parts) != 2 or not all(parts):
        raise _Bad(f"pair must be two field names a,b; got {p!r}")
    return parts[0], parts[1]


def _json(obj: Any) -> Response:
    return Response(json.dumps(obj, allow_nan=False, separators=(",", ":")), media_type="application/json",
                    headers=HEADERS)


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
    except ValueError:
        return None


class HostCheck:
    """ASGI middleware: requests whose ``Host`` is not the bound ``host:port`` are refused (module doc)."""

    def __init__(self, app: Any, host: str, port: int):
        self.app, self.port = app, int(port)
        h = host.strip().lower()
        ip = _ip(h)
        self.any_ip = h in ("", "0.0.0.0", "::", "[::]")
        names = {f"[{ip}]" if ip is not None and ip.version == 6 else (str(ip) if ip is not None else h)}
        if self.any_ip or (ip is not None and ip.is_loopback) or h == "localhost":
            names.update(LOOPBACK_NAMES)
        if self.any_ip:
            names.update({socket.gethostname().lower(), socket.getfqdn().lower()})
        self.names = names

    def allowed(self, value: str) -> bool:
        """Whether ``value`` (a Host header) names the bound address and port."""
        name, sep, port = value.strip().lower().rpartition(":")
        if not sep or not port.isdigit() or int(port) != self.port or (name.count(":") and not name.startswith("[")):
            return False  # the port is always sent: the server never listens on 80
        if name in self.names:
            return True
        ip = _ip(name)
        return self.any_ip and ip is not None and (ip.version == 4 or name.startswith("["))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        hosts = [v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"host"]
        if len(hosts) != 1:
            why, code = "the request has no Host header (or several)", 400
        elif not self.allowed(hosts[0]):
            why, code = f"Host {hosts[0][:100]!r} is not the address this server is bound to", 421
        else:
            await self.app(scope, receive, send)
            return
        await Response(f"{why}; open the address `trajstore view` printed\n", code, media_type="text/plain",
                       headers=HEADERS)(scope, receive, send)


def make_app(view: View, host: str = "127.0.0.1", port: int = 8000) -> Any:
    """The app serving ``view`` (a :class:`trajstore.view.pages.View`), answering only requests to
    ``host:port`` (the address it is served at: ``HostCheck``)."""
    files = static_files()
    name = os.path.basename(str(view.path).rstrip("/")) or str(view.path)

    async def run_page(req: Request) -> Response:
        return HTMLResponse(shell("run", f"run {name}", {"split": view.split, "splits": ",".join(view.splits),
                                                         "diff": int(view.other is not None)}), headers=HEADERS)

    async def step_page(req: Request) -> Response:
        s = _int(req, "step")
        sp = req.path_params["split"]
        return HTMLResponse(shell("step", f"{name} {sp} step {s}", {"split": sp, "step": s}), headers=HEADERS)

    async def traj_page(req: Request) -> Response:
        s, i = _int(req, "step"), _int(req, "index")
        sp = req.path_params["split"]
        return HTMLResponse(shell("traj", f"{name} {sp} step {s} trajectory {i}", {"split": sp, "step": s, "index": i}),
                            headers=HEADERS)

    async def diff_page(req: Request) -> Response:
        if view.other is None:
            return HTMLResponse(shell("diff", "diff: give two dumps (trajstore view A B)"), 404, headers=HEADERS)
        return HTMLResponse(shell("diff", f"diff {name} vs {os.path.basename(str(view.other).rstrip('/'))}",
                                  {"diff": 1}),
                            headers=HEADERS)

    def api_run(req: Request) -> Response:
        w = req.query_params.get("wait")
        if w is not None and not re.fullmatch(r"\d{1,4}(\.\d{1,3})?", w):
            raise _Bad(f"wait must be a number of seconds, got {w!r}")
        return _json(view.run(req.query_params.get("split"), _pair(req), None if w is None else float(w)))

    def api_step(req: Request) -> Response:
        return _json(view.step(req.query_params.get("split"), _int(req, "step")))

    def api_traj(req: Request) -> Response:
        return _json(view.traj(req.query_params.get("split"), _int(req, "step"), _int(req, "index")))

    def api_diff(req: Request) -> Response:
        return _json(view.diff())

    async def static(req: Request) -> Response:
        f = files.get(req.path_params["name"])
        if f is None:
            return Response("not found", 404, media_type="text/plain", headers=HEADERS)
        return FileResponse(f, media_type=TYPES.get(f.suffix, "application/octet-stream"), headers=HEADERS)

    def guarded(fn: Any) -> Any:
        async def call(req: Request) -> Response:
            try:
                return await run_in_threadpool(fn, req)
            except _Bad as e:
                return JSONResponse({"error": str(e)}, 400, headers=HEADERS)
            except TrajstoreError as e:
                return JSONResponse({"error": str(e)}, 404, headers=HEADERS)
        return call

    routes = _compare_routes(view, name, guarded) + [
        Route("/", run_page), Route("/step/{split}/{step:int}", step_page),
        Route("/traj/{split}/{step:int}/{index:int}", traj_page), Route("/diff", diff_page),
        Route("/api/run", guarded(api_run)), Route("/api/step", guarded(api_step)),
        Route("/api/traj", guarded(api_traj)), Route("/api/diff", guarded(api_diff)),
        Route("/static/{name}", static),
    ]
    return HostCheck(Starlette(routes=routes), host, port)


def _float(req: Request, name: str) -> float:
    v = req.query_params.get(name, "0")
    if not re.fullmatch(r"\d{1,6}(\.\d{1,12})?([eE]-?\d{1,3})?", v):
        raise _Bad(f"{name} must be a non-negative number, got {v!r}")
    return float(v)


def _compare_routes(view: View, name: str, guarded: Any) -> list[Route]:
    """Two runs side by side (``view/compare.py``): the aligned trajectory page and the JSON of the
    overlaid curves, the diverging fields and the aligned trajectory."""
    async def aligned_page(req: Request) -> Response:
        s, i = _int(req, "step"), _int(req, "row")
        sp = req.path_params["split"]
        return HTMLResponse(shell("aligned", f"{name} {sp} trajectory ({s}, {i}) of both runs",
                                  {"split": sp, "step": s, "row": i}), headers=HEADERS)

    def api_run(req: Request) -> Response:
        return _json(compare.curves(view, req.query_params.get("split")))

    def api_diff(req: Request) -> Response:
        return _json(compare.diverging(view, req.query_params.get("split"), _float(req, "atol"), _float(req, "rtol")))

    def api_traj(req: Request) -> Response:
        return _json(compare.aligned(view, _int(req, "step"), _int(req, "row"), req.query_params.get("field") or None,
                                     req.query_params.get("split")))

    return [Route("/aligned/{split}/{step:int}/{row:int}", aligned_page),
            Route("/api/compare/run", guarded(api_run)), Route("/api/compare/diff", guarded(api_diff)),
            Route("/api/compare/traj", guarded(api_traj))]


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port`` (0: a free port), bound before anything says it serves:
    ConfigError naming the address when it cannot be (in use, not this machine's, no permission)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, OverflowError) as e:
        raise ConfigError(f"--host {host} --port {port}: not an address to listen on ({e}); give an address "
                          "of this machine (127.0.0.1, the default) and a port of 1-65535") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: no wait after a restart
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        why = "another program listens there" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
        raise ConfigError(f"cannot listen on {host}:{port}: {why} ({type(e).__name__}); pass another --port "
                          "(or stop the program that uses it)") from None
    return sock


def serve(view: View, host: str = "127.0.0.1", port: int = 8000, sock: socket.socket | None = None) -> None:
    """Serve ``view`` until interrupted (uvicorn), on ``sock`` (of ``listen``) or a new socket."""
    import uvicorn

    sock = sock or listen(host, port)
    bound = sock.getsockname()[1]  # the port asked for, or the one the system chose for 0
    server = uvicorn.Server(uvicorn.Config(make_app(view, host, bound), host=host, port=bound, log_level="warning"))
    server.run(sockets=[sock])
