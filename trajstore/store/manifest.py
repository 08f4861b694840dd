"""A dump's manifest (``trajstore.json``, docs/FORMAT.md section 1): read and checked, created atomically
with the side folder by the first writer, its text for object storage, and what a path that holds no
manifest is instead (a file, a folder of dumps); the text of a skipped-step record, stamped like the
manifest."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .._version import __version__
from ..base import fingerprint
from ..errors import DumpNotFoundError, FormatError, WriterError
from ..format.spec import MANIFEST_VERSION, check_version
from .files import fsync_dir, mkdir_real, stale_temps, write_durable
from .fs import is_remote
from .paths import LAYOUT, MANIFEST, SIDE
from .regular import read_small

def read_manifest(root: Path) -> dict:
    f = root / MANIFEST
    try:
        doc = json.loads(read_small(f, "the manifest"))
    except FileNotFoundError:
        inside = dumps_inside(root)
        raise DumpNotFoundError(
            f"no trajstore dump at {root}: {MANIFEST} is missing; " + (
                f"it is a folder of dumps: {', '.join(map(str, inside))}; give one of them" if inside else
                "check the path, or create one with trajstore.Writer(path)")
        ) from None
    except NotADirectoryError:
        raise DumpNotFoundError(not_a_folder(root) or f"no trajstore dump at {root}") from None
    except FormatError:  # not a regular file, or over the cap (store/regular.py)
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise FormatError(f"{f}: the manifest is not valid JSON ({e}); the dump is damaged") from None
    except OSError as e:
        raise FormatError(f"{f}: the manifest cannot be read ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != "trajstore":
        raise FormatError(f"{f}: not a trajstore manifest (missing \"format\": \"trajstore\")")
    check_version(doc.get("format_version"), str(f), "the manifest", MANIFEST_VERSION)
    if not isinstance(doc.get("environment", {}), dict):
        raise FormatError(f"{f}: the manifest's \"environment\" is {type(doc['environment']).__name__}, not an "
                          "object; the dump is damaged (restore trajstore.json, or set it to {})")
    return doc


def not_a_folder(root: Path) -> str | None:
    """Why ``root`` cannot be a dump when it (or a folder above it) is a file, else None."""
    if is_remote(root):
        return None
    for p in (root, *root.parents):
        if p.exists() and not p.is_dir():
            return (f"{root} is a file, not a dump: a dump is a folder (holding {MANIFEST}); "
                    f"give a dump's folder, or a new folder's name to write one" if p == root else
                    f"{root}: {p} is a file, not a folder; a dump is a folder: give another path")
    return None


def dumps_inside(root: Path, limit: int = 10) -> list[Path]:
    """The dumps directly inside the folder ``root`` (at most ``limit``): a folder of runs given as a dump."""
    if is_remote(root):
        return []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [root / n for n in names if os.path.isfile(root / n / MANIFEST)][:limit]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def new_manifest() -> str:
    """The text of a new dump's manifest (local disk and object storage alike)."""
    return json.dumps({
        "format": "trajstore",
        "format_version": MANIFEST_VERSION,
        "layout": LAYOUT,
        "library_version": __version__,
        "created": _now(),
        "environment": fingerprint.collect(),
    }, indent=2)


def skipped_record(step: int, reason: str) -> str:
    """The text of the record that ``step`` was not written, and why (``commit.record_skipped``)."""
    return json.dumps({"step": step, "reason": str(reason)[:2000], "time": _now()})


def create_manifest(root: Path) -> dict:
    """Read the manifest, creating the dump (atomically) if there is none. A folder that cannot be
    written (a read-only mount, no permission) is a WriterError naming it, and so is a file given as
    the dump's folder."""
    bad = not_a_folder(root)
    if bad:
        raise WriterError(bad)
    try:
        return _create_manifest(root)
    except (FileNotFoundError, FormatError):
        raise
    except OSError as e:
        raise WriterError(f"cannot create or open the dump {root} for writing: {e.strerror or e} "
                          f"({type(e).__name__}, {e.filename or root}); check that the folder is writable "
                          "(not a read-only mount) and the permissions; a Reader can still read it") from e


def _create_manifest(root: Path) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    for n in stale_temps(root, f".{MANIFEST}.tmp-", keep_own=True):  # a writer killed creating the dump
        (root / n).unlink(missing_ok=True)
    if os.path.lexists(root / MANIFEST):
        doc = read_manifest(root)
        if doc["format_version"] >= 2:
            mkdir_real(root / SIDE)  # a copy that lost the empty folder
        return doc
    mkdir_real(root / SIDE)  # before the manifest: a layout-2 dump always has it
    tmp = root / f".{MANIFEST}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    write_durable(tmp, new_manifest())  # O_EXCL: never through a link planted under the name
    try:
        os.link(tmp, root / MANIFEST)  # never replaces a manifest another writer made first
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(root)
    return read_manifest(root)
