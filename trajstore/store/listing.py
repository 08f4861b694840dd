"""What a dump holds, by listing its folders: a split's steps (``scan``: whole step files, complete and
incomplete shard sets, ambiguous steps, names that are not regular files), the files of one logical
step, the steps recorded as skipped, the splits of a dump and the one read when none is named
(docs/FORMAT.md section 1). The names listed are those of ``store/paths.py``."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import NamedTuple

from ..errors import ConfigError, FormatError
from .files import listdir
from .fs import is_remote
from .manifest import read_manifest
from .paths import (
    MAX_WORLD_SIZE,
    RANK_RE,
    SHARD_RE,
    SHARD_SKIPPED_RE,
    SIDE,
    SKIPPED_RE,
    SPLIT_RE,
    STEP_RE,
    TOO_LARGE,
    places,
    shard_name,
    skipped_name,
    step_name,
)
from .regular import entries, read_small

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


def list_splits(root: Path) -> list[str]:
    try:
        return sorted(d.name for d in root.iterdir() if d.is_dir() and SPLIT_RE.match(d.name) and d.name != SIDE)
    except FileNotFoundError:
        return []


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
