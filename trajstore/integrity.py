"""Integrity of a dump: the SHA-256 of every step file, checked on read and by ``verify``.

``_store.commit`` records ``step_N.sha256`` (``sha256sum`` format) next to each
``step_N.parquet`` before the step becomes visible; see docs/RELIABILITY.md.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from . import _store
from .errors import ChecksumError, DumpNotFoundError, FormatError, TrajstoreError

__all__ = ["verify", "VerifyReport", "read_verified"]


def _recorded(f: Path, step: int) -> tuple[str | None, list[str]]:
    return _store.read_sum(f.with_suffix(_store.SUM_SUFFIX)), _store.pending_sums(f.parent, step)


def check_digest(f: Path, step: int, digest: str) -> None:
    """Raise ChecksumError unless ``digest`` is the one recorded for step file ``f``."""
    recorded, pending = _recorded(f, step)
    if digest == recorded or digest in pending:
        return
    # a writer may have renamed its temporary checksum into place between the two looks
    recorded = _store.read_sum(f.with_suffix(_store.SUM_SUFFIX)) or recorded
    if digest == recorded:
        return
    if recorded is None and not pending:
        raise ChecksumError(
            f"{f}: step {step} has no recorded checksum ({f.with_suffix(_store.SUM_SUFFIX).name} is "
            "missing or malformed), so it cannot be verified; run `trajstore verify` on the dump, "
            "or pass verify=False to read it anyway"
        )
    raise ChecksumError(
        f"{f}: step {step} is damaged: its SHA-256 is {digest[:16]}..., the checksum recorded at "
        f"commit is {(recorded or pending[0])[:16]}...; restore the file from a copy or rewrite the step"
    )


def read_verified(f: Path, step: int):
    """The bytes of step file ``f`` (an Arrow buffer: decoded arrays may point into it, and it must
    not be owned by a Python object), after checking them against the recorded checksum."""
    import pyarrow as pa

    for attempt in range(3):
        try:
            before = os.stat(f)
            with pa.OSFile(str(f)) as src:
                data = src.read_buffer()
        except (OSError, pa.ArrowException) as e:
            raise FormatError(f"{f}: step {step} cannot be read ({e})") from None
        try:
            check_digest(f, step, hashlib.sha256(memoryview(data)).hexdigest())
            return data
        except ChecksumError:
            if attempt == 2 or _same_file(before, f):
                raise
            # the step was overwritten while it was read: read the new version


def _same_file(st: os.stat_result, f: Path) -> bool:
    try:
        now = os.stat(f)
    except OSError:
        return False
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns) == (now.st_ino, now.st_dev, now.st_size, now.st_mtime_ns)


@dataclass
class VerifyReport:
    """What ``verify`` found: steps checked, steps damaged (with why), steps recorded as skipped."""

    path: Path
    checked: dict[str, int] = field(default_factory=dict)
    damaged: dict[tuple[str, int], str] = field(default_factory=dict)
    skipped: dict[tuple[str, int], str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.damaged

    def __bool__(self) -> bool:
        return self.ok

    def summary(self) -> str:
        n = sum(self.checked.values())
        lines = [f"{self.path}: {n} step(s) checked in {len(self.checked)} split(s), "
                 f"{len(self.damaged)} damaged, {len(self.skipped)} recorded as skipped"]
        lines += [f"DAMAGED {s}/{step}: {why}" for (s, step), why in sorted(self.damaged.items())]
        lines += [f"skipped {s}/{step}: {why}" for (s, step), why in sorted(self.skipped.items())]
        return "\n".join(lines)


def verify(path: str | Path, split: str | None = None, *, deep: bool = False) -> VerifyReport:
    """Check every step file of the dump at ``path`` (or of one ``split``) against its checksum.

    ``deep=True`` also decodes every step (checks its spec and contents, slower).
    Returns a :class:`VerifyReport`; ``report.damaged`` maps ``(split, step)`` to the reason.
    """
    root = Path(path)
    _store.read_manifest(root)
    splits = [_store.check_split(split)] if split is not None else _store.list_splits(root)
    if split is not None and not (root / split).is_dir():
        raise DumpNotFoundError(f"dump {root} has no split {split!r}; splits present: "
                                f"{_store.list_splits(root) or 'none'}")
    rep = VerifyReport(root)
    for s in splits:
        d = root / s
        steps = _store.list_steps(d)
        rep.checked[s] = len(steps)
        rep.skipped.update({(s, k): why for k, why in _store.list_skipped(d).items()})
        reader = None
        if deep:
            from .reader import Reader

            reader = Reader(root, s, verify=True)
        for step in steps:
            f = d / _store.step_name(step)
            try:
                if reader is not None:
                    reader.read(step)
                else:
                    check_digest(f, step, _store.file_sha256(f))
            except TrajstoreError as e:
                rep.damaged[(s, step)] = str(e)
            except OSError as e:
                rep.damaged[(s, step)] = f"{f}: cannot be read ({e})"
    return rep
