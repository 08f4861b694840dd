"""The names in a dump and where its files live (docs/FORMAT.md section 1): the manifest's and the side
folder's names, split names, step, shard, checksum and skipped-record file names and their patterns, the
checks of a split name, a step and a rank, a dump's local root, and the folders a writer makes and writes
its temporaries in. What a split folder holds is listed by ``store/listing.py``; the manifest is read and
created by ``store/manifest.py``.

Layout 2 (manifest version 2): a split folder ``<dump>/<split>/`` holds only committed step files;
checksums, skipped-step records, temporaries and the column index live in ``<dump>/_trajstore/<split>/``
(``side_dir``), where no ``*.parquet`` glob and no directory reader of the split reaches them. Layout 1
(manifest version 1, trajstore 0.1.0 before issue 13) kept them all in the split folder; such a dump
keeps its layout when appended to, and readers look in both places."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ..errors import ConfigError, WriterError
from .files import check_real, fsync_dir, mkdir_real
from .fs import URL_RE, is_remote

MANIFEST = "trajstore.json"
SIDE = "_trajstore"  # <dump>/_trajstore/<split>/: a split's files that are not step files (layout 2)
LAYOUT = {"steps": "<split>/step_<n>.parquet", "side": f"{SIDE}/<split>/"}  # the manifest's "layout"
# Name patterns (docs/FORMAT.md section 1): ASCII digits only (``[0-9]``, never ``\d``, which takes any
# Unicode digit) and anchored at the very end (``\Z``, never ``$``, which also takes a trailing newline)
STEP_RE = re.compile(r"^step_([0-9]{8,})\.parquet\Z")
SKIPPED_RE = re.compile(r"^step_([0-9]{8,})\.skipped\.json\Z")
# one rank's shard of a logical step written by N ranks (docs/FORMAT.md section 1)
SHARD_RE = re.compile(r"^step_([0-9]{8,})\.rank([0-9]{5,})-of-([0-9]{5,})\.parquet\Z")
SHARD_SKIPPED_RE = re.compile(r"^step_([0-9]{8,})\.rank([0-9]{5,})-of-([0-9]{5,})\.skipped\.json\Z")
SUM_RE = re.compile(r"^(step_[0-9]{8,}(?:\.rank[0-9]{5,}-of-[0-9]{5,})?)\.sha256\Z")  # a step file's checksum
TMP_SUM_RE = re.compile(r"^\.(step_[0-9]{8,}(?:\.rank[0-9]{5,}-of-[0-9]{5,})?)\.sha256\.tmp-")  # its temporary
TMP_PREFIX = ".step_"
MAX_WORLD_SIZE = 99999  # the most ranks a step is written by: a shard name of more is ambiguous, never listed
TOO_LARGE = "a step number of 2**63 or more (no writer makes one)"  # Listing.odd's reason for such a name
SPLIT_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
RANK_RE = re.compile(r"^(.+)-rank(0|[1-9][0-9]*)\Z")  # config.location's split of one rank when the world size is above 1


def check_split(split: str) -> str:
    if not isinstance(split, str) or not SPLIT_RE.match(split) or ".." in split:
        raise ConfigError(
            f"split {split!r} is not a valid name: use 1-128 letters, digits, '_', '-' or '.', "
            "not starting with '.' or '-' and without '/' or '..'"
        )
    if split == SIDE:
        raise ConfigError(f"split {split!r} is reserved: the dump keeps its checksums and index there")
    return split


def side_dir(split_dir: Path) -> Path:
    """Where the files of ``split_dir`` that are not step files go: ``<dump>/_trajstore/<split>/``
    in a dump of layout 2 (one that has ``<dump>/_trajstore/``), else the split folder itself."""
    side = split_dir.parent / SIDE
    return side / split_dir.name if side.is_dir() else split_dir


def places(split_dir: Path) -> list[Path]:
    """The folders a reader looks in for a split's checksums and records: its side folder, then
    the split folder itself (layout 1), once each."""
    side = side_dir(split_dir)
    return [side] if side == split_dir else [side, split_dir]


def check_step(step) -> int:
    if type(step) is not int and not (hasattr(step, "__index__") and not isinstance(step, bool | float)):
        raise ConfigError(f"step {step!r} is a {type(step).__name__}; steps are non-negative ints")
    step = int(step.__index__())
    if step < 0:
        raise ConfigError(f"step {step} is negative; steps are non-negative ints")
    if step >= 2**63:
        raise ConfigError(f"step {step} is too large; steps must be below 2**63")
    return step


def check_shard(rank: Any, world_size: Any, who: str) -> tuple[int, int] | None:
    """``(rank, world_size)`` of a shard writer or reader, None for a whole-batch writer; ConfigError otherwise."""
    if rank is None and world_size is None:
        return None
    ok = all(type(v) is int or hasattr(v, '__index__') and not isinstance(v, bool | float) for v in (rank, world_size))
    if not ok or not 0 <= rank < world_size or world_size > MAX_WORLD_SIZE:
        raise ConfigError(f"{who}: rank={rank!r}, world_size={world_size!r}: give both, ints with 0 <= rank < "
                          "world_size <= 99999 (this rank's shards, or its slice of each step), or neither (whole steps)")
    return rank.__index__(), world_size.__index__()


def step_name(step: int) -> str:
    return f"step_{step:08d}.parquet"


def shard_tag(rank: int, world_size: int) -> str:
    """What the names of rank ``rank``'s shard files (and their sidecars) hold after the step number:
    ``.rank00002-of-00004.``."""
    return f".rank{rank:05d}-of-{world_size:05d}."


def shard_name(step: int, rank: int, world_size: int) -> str:
    """The file of rank ``rank``'s shard of ``step`` written by ``world_size`` ranks."""
    return f"step_{step:08d}{shard_tag(rank, world_size)}parquet"


def local_root(path: str | os.PathLike, who: str) -> Path:
    """The local directory of a dump named by ``path``, for the local-only commands ``who`` (``import``,
    ``upgrade``). ``file://`` URLs name local paths; any other URL is a ConfigError here, before anything
    is created (a URL taken as a path would make a local folder named ``s3:``). Every other entry point
    takes URLs: ``store.fs.resolve``."""
    s = os.fspath(path)
    m = URL_RE.match(s) if isinstance(s, str) else None
    if m is None:
        return Path(s)
    if m.group(1).lower() == "file":
        return Path(s[len(m.group(0)):] or "/")
    raise ConfigError(
        f"{who}: {s!r} is a {m.group(1)}:// URL; `trajstore {who}` works on dumps on a local or mounted file "
        "system only (Writer, Reader, Recorder and the other commands also take object-storage URLs). "
        "Copy the dump to a local folder first, or mount the bucket (s3fs, gcsfuse, ...) and pass the mount's path"
    )


def check_real_dirs(split_dir: Path) -> None:
    """FormatError unless the folders a writer of ``split_dir`` writes to or cleans (the split folder, the
    side folder ``_trajstore/`` and its ``<split>/`` and index folders, a layout-1 index folder) are real
    folders of the dump, not symbolic links or other files: checked before any clean-up runs. The dump
    folder itself (named by the caller) may be a link."""
    root = split_dir.parent
    side = root / SIDE / split_dir.name
    for d in (split_dir, root / SIDE, side, side / "index", split_dir / "_index"):  # index: store/index.py
        check_real(d)


def make_split(split_dir: Path) -> None:
    """Create the split folder for a writer (if missing) and ``check_real_dirs``: before the writer cleans
    anything up. WriterError if it cannot be created."""
    if is_remote(split_dir):
        split_dir.mkdir(exist_ok=True)
        return
    try:
        mkdir_real(split_dir)
    except OSError as e:
        raise WriterError(f"cannot create the split folder {split_dir}: {e.strerror or e} ({type(e).__name__}); "
                          "check that the dump is writable (not a read-only mount) and the permissions") from e
    check_real_dirs(split_dir)


def skipped_name(step: int) -> str:
    return f"step_{step:08d}.skipped.json"


def skipped_of(name: str) -> str:
    """The skipped-step record's name of step file or shard file ``name``."""
    return name.removesuffix(".parquet") + ".skipped.json"


def step_of(final: Path) -> int:
    return int(final.name.split("_", 1)[1].split(".", 1)[0])


def temp_path(split_dir: Path, step: int, name: str | None = None) -> Path:
    """A new temporary to write ``step`` (its file ``name``: a shard's) to before ``commit`` links it into
    ``split_dir``: in the side folder (made if needed), so the split folder holds committed step files only."""
    d = side_dir(split_dir)
    if d != split_dir and not d.is_dir():
        d.mkdir(exist_ok=True)
        fsync_dir(d.parent)
    return d / f".{name or step_name(step)}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
