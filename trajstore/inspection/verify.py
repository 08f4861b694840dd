"""``verify``: check every step file of a dump against its recorded checksum (or decode it whole); steps
written by several ranks: every shard, and steps whose shards are not all committed are reported."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DumpNotFoundError, TrajstoreError
from ..format.spec import MANIFEST_VERSION
from ..store import checksums, listing, manifest, paths, stepfile
from ..store.fs import resolve

__all__ = ["verify", "VerifyReport"]


@dataclass
class VerifyReport:
    """What ``verify`` found: steps checked, steps damaged (with why), steps recorded as skipped."""

    path: Path
    checked: dict[str, int] = field(default_factory=dict)
    damaged: dict[tuple[str, int], str] = field(default_factory=dict)
    skipped: dict[tuple[str, int], str] = field(default_factory=dict)
    incomplete: dict[tuple[str, int], str] = field(default_factory=dict)  # shards missing: not readable
    layout: int | None = None  # the manifest's format version (the dump's layout)
    formats: dict[int, int] = field(default_factory=dict)  # step-file format version -> steps of it

    @property
    def ok(self) -> bool:
        return not self.damaged

    def __bool__(self) -> bool:
        return self.ok

    def summary(self) -> str:
        n = sum(self.checked.values())
        lines = [f"{self.path}: {n} step(s) checked in {len(self.checked)} split(s), "
                 f"{len(self.damaged)} damaged, {len(self.skipped)} recorded as skipped"
                 + (f", {len(self.incomplete)} incomplete (shards missing, not readable)" if self.incomplete else ""),
                 f"layout {self.layout}; step files of format "
                 + (", ".join(f"{v} ({c})" for v, c in sorted(self.formats.items())) or "-")
                 + (" (`trajstore upgrade` moves it to the current layout)" if (self.layout or 0) < MANIFEST_VERSION
                    else "")]
        lines += [f"DAMAGED {s}/{step}: {why}" for (s, step), why in sorted(self.damaged.items())]
        lines += [f"skipped {s}/{step}: {why}" for (s, step), why in sorted(self.skipped.items())]
        lines += [f"INCOMPLETE {s}/{step}: {why}" for (s, step), why in sorted(self.incomplete.items())]
        return "\n".join(lines)


def verify(path: str | Path, split: str | None = None, *, deep: bool = False) -> VerifyReport:
    """Check every step file of the dump at ``path`` (or of one ``split``) against its checksum.

    ``deep=True`` also decodes every step (checks its spec and contents, slower).
    Returns a :class:`VerifyReport`; ``report.damaged`` maps ``(split, step)`` to the reason.
    """
    root = resolve(path, "verify")
    layout = manifest.read_manifest(root)["format_version"]
    splits = [paths.check_split(split)] if split is not None else listing.list_splits(root)
    if split is not None and not (root / split).is_dir():
        raise DumpNotFoundError(f"dump {root} has no split {split!r}; splits present: "
                                f"{listing.list_splits(root) or 'none'}")
    rep = VerifyReport(root, layout=layout)
    for s in splits:
        d = root / s
        listed = listing.scan(d)
        steps = listed.steps
        rep.checked[s] = len(steps)
        rep.skipped.update({(s, k): why for k, why in listing.list_skipped(d).items()})
        rep.incomplete.update({(s, k): f"written by {n} ranks; the shard(s) of rank(s) {listing.ranks_text(miss)} "
                               "are not committed (a rank still writing, or stopped): the step is not readable"
                               for k, (n, miss) in listed.incomplete.items()})
        rep.damaged.update({(s, paths.step_of(Path(n))): f"{d / n}: {what}"
                            + (", not a step" if what == paths.TOO_LARGE else ", not a regular file") + " (not read)"
                            for n, what in listed.odd.items()})  # a FIFO, a device... named as a step
        if deep:  # decoding needs the reader (and torch); the checksums alone do not (`trajstore verify`)
            from ..read.reader import Reader

            reader = Reader(root, s, verify=True)
        for step in steps:
            f = d / paths.step_name(step)
            try:
                fs = listing.step_files(d, listed, step)  # its shards in rank order; FormatError if ambiguous
                if deep:
                    reader.read(step)
                else:
                    for f in fs:
                        checksums.check_file(f, step)
                v = max(stepfile.open_step(f, step).doc["format_version"] for f in fs)  # the footers only
                rep.formats[v] = rep.formats.get(v, 0) + 1
            except TrajstoreError as e:
                rep.damaged[(s, step)] = str(e)
            except OSError as e:
                rep.damaged[(s, step)] = f"{f}: cannot be read ({e})"
    return rep
