"""The directory layout of a dump: manifest, split folders, step file names."""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from .errors import ConfigError, DumpNotFoundError, FormatError, FormatVersionError

FORMAT_VERSION = 1
MANIFEST = "trajstore.json"
STEP_RE = re.compile(r"^step_(\d{8,})\.parquet$")
TMP_PREFIX = ".step_"
_SPLIT_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def check_split(split: str) -> str:
    if not isinstance(split, str) or not _SPLIT_RE.match(split) or ".." in split:
        raise ConfigError(
            f"split {split!r} is not a valid name: use 1-128 letters, digits, '_', '-' or '.', "
            "not starting with '.' or '-' and without '/' or '..'"
        )
    return split


def check_step(step) -> int:
    if type(step) is not int and not (hasattr(step, "__index__") and not isinstance(step, bool | float)):
        raise ConfigError(f"step {step!r} is a {type(step).__name__}; steps are non-negative ints")
    step = int(step.__index__())
    if step < 0:
        raise ConfigError(f"step {step} is negative; steps are non-negative ints")
    return step


def step_name(step: int) -> str:
    return f"step_{step:08d}.parquet"


def list_steps(split_dir: Path) -> list[int]:
    try:
        names = os.listdir(split_dir)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := STEP_RE.match(n)))


def list_splits(root: Path) -> list[str]:
    try:
        return sorted(d.name for d in root.iterdir() if d.is_dir() and _SPLIT_RE.match(d.name))
    except FileNotFoundError:
        return []


def _git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return r.stdout.strip() or None if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    """Fingerprint of the process that writes the dump."""
    import numpy
    import pyarrow
    import torch

    from . import __version__

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "trajstore": __version__,
        "torch": torch.__version__,
        "pyarrow": pyarrow.__version__,
        "numpy": numpy.__version__,
        "cuda": torch.version.cuda,
        "git_commit": _git_commit(),
        "argv": list(sys.argv),
    }


def read_manifest(root: Path) -> dict:
    f = root / MANIFEST
    try:
        doc = json.loads(f.read_text())
    except FileNotFoundError:
        raise DumpNotFoundError(
            f"no trajstore dump at {root}: {MANIFEST} is missing; check the path, or create one with "
            "trajstore.Writer(path)"
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{f}: the manifest is not valid JSON ({e}); the dump is damaged") from None
    if not isinstance(doc, dict) or doc.get("format") != "trajstore":
        raise FormatError(f"{f}: not a trajstore manifest (missing \"format\": \"trajstore\")")
    v = doc.get("format_version")
    if not isinstance(v, int):
        raise FormatError(f"{f}: format_version is missing or not an int")
    if v > FORMAT_VERSION:
        raise FormatVersionError(
            f"{f}: written with format version {v}; this trajstore reads up to {FORMAT_VERSION}; "
            "upgrade trajstore"
        )
    return doc


def create_manifest(root: Path) -> dict:
    """Read the manifest, creating the dump (atomically) if there is none."""
    root.mkdir(parents=True, exist_ok=True)
    if (root / MANIFEST).exists():
        return read_manifest(root)
    from . import __version__

    doc = {
        "format": "trajstore",
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": environment(),
    }
    tmp = root / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(doc, indent=2))
    _fsync(tmp)
    try:
        os.link(tmp, root / MANIFEST)  # never replaces a manifest another writer made first
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(root)
    return read_manifest(root)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    try:
        _fsync(path)
    except OSError:  # some filesystems refuse fsync on directories
        pass


def commit(tmp: Path, final: Path, overwrite: bool) -> None:
    """Make ``tmp`` visible as ``final``: fsync, then link (no clobber) or replace."""
    _fsync(tmp)
    if overwrite:
        os.replace(tmp, final)
    else:
        try:
            os.link(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
    fsync_dir(final.parent)


def clean_temp(split_dir: Path) -> list[str]:
    """Remove leftovers of interrupted writes; returns their names."""
    gone = []
    for n in os.listdir(split_dir) if split_dir.exists() else []:
        if n.startswith(TMP_PREFIX) and ".tmp-" in n:
            pid = n.rsplit(".tmp-", 1)[1].split("-")[0]
            if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
                continue  # another live writer's step in progress
            (split_dir / n).unlink(missing_ok=True)
            gone.append(n)
    return gone


def temp_name(step: int) -> str:
    return f".{step_name(step)}.tmp-{os.getpid()}-{os.urandom(4).hex()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
