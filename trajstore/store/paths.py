"""The directory layout of a dump: manifest, split folders, step file names, and where the files of a
split that are not step files live (docs/FORMAT.md section 1).

Layout 2 (manifest version 2): a split folder ``<dump>/<split>/`` holds only committed step files;
checksums, skipped-step records, temporaries and the column index live in ``<dump>/_trajstore/<split>/``
(``side_dir``), where no ``*.parquet`` glob and no directory reader of the split reaches them. Layout 1
(manifest version 1, trajstore 0.1.0 before issue 13) kept them all in the split folder; such a dump
keeps its layout when appended to, and readers look in both places."""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from pathlib import Path
from typing import Any, NamedTuple

from ..base import fingerprint
from .._version import __version__
from ..errors import ConfigError, DumpNotFoundError, FormatError, WriterError
from ..format.spec import MANIFEST_VERSION, check_version
from .files import check_real, fsync_dir, listdir, mkdir_real, stale_temps, write_durable
from .fs import URL_RE, is_remote
from .regular import entries, read_small

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
_SPLIT_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")


def check_split(split: str) -> str:
    if not isinstance(split, str) or not _SPLIT_RE.match(split) or ".." in split:
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


class Missing(list):
    """An incomplete step's missing ranks: the first ``MAX_LISTED``, ``total`` in all (``scan`` never builds
    a list of 99999 ints per step of a folder of shard names); ``ranks_text`` writes them for a message."""

    total = 0


MAX_LISTED = 16


class Listing(NamedTuple):
    """What a split folder holds (``scan``). ``steps``: the logical steps a reader lists, sorted:
    whole step files, complete shard sets (all N shards of one N committed) and ambiguous steps
    (reading one raises a FormatError naming its files). ``shards``: step -> N of its complete
    shard set. ``incomplete``: step -> (N, missing ranks: ``Missing``) of shard sets not complete (a rank still
    writing, or dead); they are not in ``steps``. ``ambiguous``: step -> its files, for a step
    with a whole file and shards, or shards of two world sizes. ``parts``: step -> N -> the ranks
    whose shard is there (complete and incomplete sets alike). ``odd``: name -> what it is, of the
    names of step or shard files that are not regular files (a FIFO, a device, a folder, a link to
    one or a dangling link: ``store/regular.py``); they are not steps, ``trajstore verify`` reports them."""

    steps: list[int]
    shards: dict[int, int]
    incomplete: dict[int, tuple[int, Missing]]
    ambiguous: dict[int, list[str]]
    parts: dict[int, dict[int, set[int]]]
    odd: dict[str, str] = {}


def scan(split_dir: Path) -> Listing:
    """The split's steps by kind (see ``Listing``): one directory listing."""
    if not is_remote(split_dir):  # regular files only: a FIFO named like a step is in ``odd``
        names, odd = entries(split_dir, lambda n: bool(STEP_RE.match(n) or SHARD_RE.match(n)))
    else:
        try:
            names, odd = listdir(split_dir), {}
        except FileNotFoundError:
            names, odd = [], {}
    big = {n: TOO_LARGE for n in names if len(n) > 25 and (m := STEP_RE.match(n) or SHARD_RE.match(n))
           and int(m.group(1)) >= 2**63}
    if big:  # a step number no writer makes (check_step): not a step, `verify` reports the name
        names, odd = [n for n in names if n not in big], {**odd, **big}
    steps = [int(m.group(1)) for n in names if (m := STEP_RE.match(n))]
    parts: dict[int, dict[int, set[int]]] = {}
    if len(steps) < len(names):  # other names: shard files, maybe
        for n in names:
            if ".rank" in n and (m := SHARD_RE.match(n)):
                parts.setdefault(int(m.group(1)), {}).setdefault(int(m.group(3)), set()).add(int(m.group(2)))
    if not parts:
        steps.sort()
        return Listing(steps, {}, {}, {}, {}, odd)
    whole = set(steps)
    shards, incomplete, ambiguous = {}, {}, {}
    for s, by in parts.items():
        # a name no writer makes; a world size over MAX_WORLD_SIZE is never expanded (no range(10**12))
        bad = any(not 1 <= N <= MAX_WORLD_SIZE or max(ranks) >= N for N, ranks in by.items())
        if s in whole or len(by) > 1 or bad:
            ambiguous[s] = sorted(([step_name(s)] if s in whole else [])
                                  + [shard_name(s, r, N) for N, ranks in by.items() for r in ranks])
            continue
        ((N, ranks),) = by.items()
        if len(ranks) == N:
            shards[s] = N
        else:
            incomplete[s] = (N, _missing(N, ranks))
    return Listing(sorted(whole | shards.keys() | ambiguous.keys()), shards, incomplete, ambiguous, parts, odd)


def _missing(n: int, ranks: set[int]) -> Missing:  # at most len(ranks) + MAX_LISTED turns
    out = Missing(itertools.islice((r for r in range(n) if r not in ranks), MAX_LISTED))
    out.total = n - len(ranks)
    return out


def ranks_text(missing: list[int]) -> str:
    total = getattr(missing, "total", len(missing))
    return ", ".join(map(str, missing)) + (f", ... ({total} in all)" if total > len(missing) else "")


def step_files(split_dir: Path, listing: Listing, step: int) -> list[Path]:
    """The files of logical step ``step`` of ``listing`` (``scan(split_dir)``): its whole step file, or its
    shards in rank order; FormatError for an ambiguous step."""
    if step in listing.ambiguous:
        raise ambiguous_error(split_dir, step, listing.ambiguous[step])
    n = listing.shards.get(step)
    if n is None:
        return [split_dir / step_name(step)]
    return [split_dir / shard_name(step, r, n) for r in range(n)]


def list_steps(split_dir: Path) -> list[int]:
    """The logical steps of a split (``Listing.steps``): whole step files and complete shard sets."""
    return scan(split_dir).steps


def ambiguous_error(split_dir: Path, step: int, names: list[str]) -> FormatError:
    return FormatError(
        f"{split_dir}: step {step} is ambiguous: its files {', '.join(names)} are not one whole step file nor "
        "the shards of one world size (docs/FORMAT.md section 1); keep the files of one writing and move the "
        "others out of the split folder")


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


def list_splits(root: Path) -> list[str]:
    try:
        return sorted(d.name for d in root.iterdir() if d.is_dir() and _SPLIT_RE.match(d.name) and d.name != SIDE)
    except FileNotFoundError:
        return []


RANK_RE = re.compile(r"^(.+)-rank(0|[1-9][0-9]*)\Z")  # config.location's split of one rank when the world size is above 1


def default_split(root: Path) -> str:
    """The split a command or a Reader reads when none is named: ``train`` if the dump has it, else its
    only split (``train`` when it has none, so the caller's "no split" message names the dump). Several
    splits and no ``train`` is a ConfigError naming them, also when they are the rank splits
    (``train-rank0``, ``train-rank1``...) of one logical split: each rank's split is a part of the
    batch, and choosing one by itself would read a part as if it were the whole."""
    root = root if is_remote(root) else Path(root)
    splits = list_splits(root) if root.is_dir() else []  # a step file on its own: its split
    if "train" in splits or not splits:
        return "train"
    if len(splits) == 1:
        return splits[0]
    read_manifest(root)  # a folder that is no dump says so first
    ranks = {m.group(1) for s in splits if (m := RANK_RE.match(s))}
    why = ""
    if ranks:
        why = (f"; {', '.join(sorted(ranks))} {'was' if len(ranks) == 1 else 'were'} dumped by several ranks, one "
               "split per rank, and a command that reads one split cannot pick a rank by itself: each rank's split "
               "holds only its part of every step")
    eg = next((s for s in splits if RANK_RE.match(s)), splits[0])
    raise ConfigError(f"dump {root} has no split 'train' and {len(splits)} splits: {', '.join(splits)}{why}; name "
                      f"the split to read with --split (e.g. --split {eg}; in Python Reader(path, split={eg!r}))")


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


def is_skipped(split_dir: Path, step: int) -> bool:
    """Whether ``step``, or a shard of it, is recorded as skipped."""
    if any((d / skipped_name(step)).exists() for d in places(split_dir)):
        return True
    pre = f"step_{step:08d}.rank"
    for d in places(split_dir):
        try:
            if any(n.startswith(pre) and SHARD_SKIPPED_RE.match(n) for n in os.listdir(d)):
                return True
        except OSError:
            continue
    return False


def list_skipped(split_dir: Path) -> dict[int, str]:
    """Steps recorded as skipped, with the reason (from the side folder and, layout 1, the split folder)."""
    out: dict[int, str] = {}
    shard: dict[tuple[int, int, int], str] = {}
    for d in reversed(places(split_dir)):  # the side folder's record wins
        try:
            names = listdir(d)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for n in names:
            m = SKIPPED_RE.match(n) or SHARD_SKIPPED_RE.match(n)
            if m:
                try:
                    doc = json.loads(read_small(d / n, "the skipped-step record"))
                    why = str(doc.get("reason", "")) if isinstance(doc, dict) else ""
                except FormatError as e:  # not a regular file, or over the cap
                    why = f"(unreadable record: {e})"
                except (OSError, ValueError, RecursionError):
                    why = "(unreadable record)"
                if m.re is SHARD_SKIPPED_RE:  # a logical step with any skipped shard is skipped
                    shard[(int(m.group(1)), int(m.group(2)), int(m.group(3)))] = why
                else:
                    out[int(m.group(1))] = why
    for (s, r, n), why in sorted(shard.items()):
        out[s] = (f"{out[s]}; " if s in out else "") + f"rank {r} of {n}: {why}"
    return dict(sorted(out.items()))


def temp_path(split_dir: Path, step: int, name: str | None = None) -> Path:
    """A new temporary to write ``step`` (its file ``name``: a shard's) to before ``commit`` links it into
    ``split_dir``: in the side folder (made if needed), so the split folder holds committed step files only."""
    d = side_dir(split_dir)
    if d != split_dir and not d.is_dir():
        d.mkdir(exist_ok=True)
        fsync_dir(d.parent)
    return d / f".{name or step_name(step)}.tmp-{os.getpid()}-{os.urandom(4).hex()}"


