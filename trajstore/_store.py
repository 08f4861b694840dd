"""The directory layout of a dump: manifest, split folders, step file names."""

from __future__ import annotations

import hashlib
import json
import os
import re
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
    if step >= 2**63:
        raise ConfigError(f"step {step} is too large; steps must be below 2**63")
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


def environment() -> dict:
    """Fingerprint of the process that writes the dump (see trajstore/fingerprint.py)."""
    from . import fingerprint

    return fingerprint.collect()


def read_manifest(root: Path) -> dict:
    f = root / MANIFEST
    try:
        doc = json.loads(f.read_text())
    except FileNotFoundError:
        raise DumpNotFoundError(
            f"no trajstore dump at {root}: {MANIFEST} is missing; check the path, or create one with "
            "trajstore.Writer(path)"
        ) from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise FormatError(f"{f}: the manifest is not valid JSON ({e}); the dump is damaged") from None
    except OSError as e:
        raise FormatError(f"{f}: the manifest cannot be read ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != "trajstore":
        raise FormatError(f"{f}: not a trajstore manifest (missing \"format\": \"trajstore\")")
    v = doc.get("format_version")
    if type(v) is not int or v < 1:
        raise FormatError(f"{f}: format_version is missing or not a positive int; the manifest is damaged")
    if v > FORMAT_VERSION:
        raise FormatVersionError(
            f"{f}: written with format version {v}; this trajstore reads up to {FORMAT_VERSION}; "
            "upgrade trajstore"
        )
    return doc


def create_manifest(root: Path) -> dict:
    """Read the manifest, creating the dump (atomically) if there is none."""
    root.mkdir(parents=True, exist_ok=True)
    for n in os.listdir(root):  # leftovers of a writer killed while creating the dump
        pid = n.rsplit(".tmp-", 1)[-1]
        if n.startswith(f".{MANIFEST}.tmp-") and pid.isdigit() and not _alive(int(pid)):
            (root / n).unlink(missing_ok=True)
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
    """Make ``tmp`` visible as ``final``, with its checksum: see docs/RELIABILITY.md.

    1. fsync ``tmp`` and write its SHA-256 to a fsynced temporary sidecar;
    2. link ``tmp`` to ``final`` (no clobber; FileExistsError if committed) or replace it;
    3. rename the temporary sidecar over ``step_N.sha256``.
    A crash between 2 and 3 leaves a temporary sidecar that matches the new file:
    readers accept it and ``clean_temp`` promotes it.
    """
    _fsync(tmp)
    digest = file_sha256(tmp)
    side = final.with_suffix(SUM_SUFFIX)
    side_tmp = final.parent / f".{side.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        _write_durable(side_tmp, sum_line(digest, final.name))
        if overwrite:
            os.replace(tmp, final)
        else:
            try:
                os.link(tmp, final)
            finally:
                tmp.unlink(missing_ok=True)
    except BaseException:
        side_tmp.unlink(missing_ok=True)
        raise
    # the step is visible and its bytes are on disk: what follows cannot fail it
    try:
        os.replace(side_tmp, side)
    except OSError:
        pass  # side_tmp stays: readers accept it as the step's checksum, clean_temp promotes it
    try:
        (final.parent / skipped_name(step_of(final))).unlink(missing_ok=True)
    except OSError:
        pass
    fsync_dir(final.parent)


def clean_temp(split_dir: Path, keep_own: bool = False) -> list[str]:
    """Remove leftovers of interrupted writes (promoting a temporary checksum that
    matches its committed step); returns the names removed.  Temporaries of other live
    processes are kept, and this process's own too with ``keep_own`` (another Writer of
    this process may be writing them)."""
    gone = []
    for n in sorted(os.listdir(split_dir)) if split_dir.exists() else []:
        if n.startswith(TMP_PREFIX) and ".tmp-" in n:
            pid = n.rsplit(".tmp-", 1)[1].split("-")[0]
            if pid.isdigit() and (int(pid) != os.getpid() or keep_own) and _alive(int(pid)):
                continue  # another live writer's step in progress
            m = re.match(r"^\.(step_\d{8,})\.sha256\.tmp-", n)
            if m and _promote(split_dir, m.group(1), split_dir / n):
                continue
            (split_dir / n).unlink(missing_ok=True)
            gone.append(n)
    for n in os.listdir(split_dir) if split_dir.exists() else []:
        if n.endswith(SUM_SUFFIX) and not (split_dir / n).with_suffix(".parquet").exists():
            (split_dir / n).unlink(missing_ok=True)  # checksum of a step that was never committed
            gone.append(n)
    return gone


def _promote(split_dir: Path, stem: str, side_tmp: Path) -> bool:
    final = split_dir / f"{stem}.parquet"
    try:
        recorded = read_sum(side_tmp)
        if not final.exists() or recorded is None or file_sha256(final) != recorded:
            return False
        if read_sum(final.with_suffix(SUM_SUFFIX)) != recorded:
            os.replace(side_tmp, final.with_suffix(SUM_SUFFIX))
            fsync_dir(split_dir)
            return True
    except OSError:
        return False
    return False


# ----------------------------------------------------------------------------- checksums
SUM_SUFFIX = ".sha256"
_SUM_RE = re.compile(r"^([0-9a-f]{64})  (\S+)\n?$")


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sum_line(digest: str, name: str) -> str:
    """One line in ``sha256sum`` format, so ``sha256sum -c step_*.sha256`` also checks a split."""
    return f"{digest}  {name}\n"


def read_sum(path: Path) -> str | None:
    """The digest recorded in a checksum file (None if absent or malformed)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
        m = _SUM_RE.match(raw.decode("ascii"))
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return m.group(1) if m else None


def pending_sums(split_dir: Path, step: int) -> list[str]:
    """Digests in temporary checksum files of ``step`` (a commit interrupted after step 2)."""
    pre = f".step_{step:08d}.sha256.tmp-"
    try:
        names = [n for n in os.listdir(split_dir) if n.startswith(pre)]
    except FileNotFoundError:
        return []
    return [d for n in names if (d := read_sum(split_dir / n))]


def _write_durable(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        data = text.encode()
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- skipped steps
def skipped_name(step: int) -> str:
    return f"step_{step:08d}.skipped.json"


def step_of(final: Path) -> int:
    return int(final.name.split("_", 1)[1].split(".", 1)[0])


def record_skipped(split_dir: Path, step: int, reason: str) -> bool:
    """Record that ``step`` was not written (e.g. disk full) so readers can say so.

    Best effort: returns False if the record itself cannot be written (the disk may be full).
    """
    path = split_dir / skipped_name(step)
    tmp = split_dir / f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    doc = {"step": step, "reason": str(reason)[:2000],
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        _write_durable(tmp, json.dumps(doc))
        os.replace(tmp, path)
        fsync_dir(split_dir)
        return True
    except OSError:
        return False
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def list_skipped(split_dir: Path) -> dict[int, str]:
    """Steps recorded as skipped, with the reason."""
    out = {}
    try:
        names = os.listdir(split_dir)
    except FileNotFoundError:
        return out
    for n in names:
        m = re.match(r"^step_(\d{8,})\.skipped\.json$", n)
        if m:
            try:
                doc = json.loads((split_dir / n).read_text())
                out[int(m.group(1))] = str(doc.get("reason", "")) if isinstance(doc, dict) else ""
            except (OSError, ValueError, RecursionError):
                out[int(m.group(1))] = "(unreadable record)"
    return dict(sorted(out.items()))


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
