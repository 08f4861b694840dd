"""System packages some tests need, installed by the tests themselves on a fresh machine (CI runs as
root on Debian): ``ensure_apt(...)`` installs missing Debian packages once per session with
``apt-get``; where that is impossible (not root, no apt-get, no network) the caller skips with the
command to run. The suite runs on two processes (``pytest -n 2``): a lock file makes one wait while
the other installs, instead of both running ``apt-get`` (the second would find dpkg locked)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile

_tried: dict[tuple[str, ...], str | None] = {}


@contextlib.contextmanager
def _one_at_a_time():
    """Held by one test process of this machine at a time (POSIX; elsewhere a no-op)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(os.path.join(tempfile.gettempdir(), "trajstore-tests-apt.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_apt(*packages: str) -> str | None:
    """Install the Debian ``packages`` if any is missing. None when they are there afterwards, else
    why not (to show in a skip reason)."""
    key = tuple(packages)
    if key in _tried:
        return _tried[key]
    with _one_at_a_time():
        _tried[key] = _install(packages)
    return _tried[key]


def _install(packages: tuple[str, ...]) -> str | None:
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    missing = [p for p in packages
               if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0] if shutil.which("dpkg") else list(packages)
    why = None
    if missing:
        if not shutil.which("apt-get") or os.geteuid() != 0:
            why = f"needs {' '.join(missing)}: run `{' '.join(cmd)}` as root"
        else:
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if p.returncode != 0:  # stale package lists: update them and try once more
                subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=900)
                p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if p.returncode != 0:
                why = f"`{' '.join(cmd)}` failed: {p.stderr.strip()[-300:]}"
    return why
