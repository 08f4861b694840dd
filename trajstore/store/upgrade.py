"""Move a dump of layout 1 (manifest version 1) to layout 2 (docs/FORMAT.md section 1): every split's
checksums, skip records and index segments go to ``<dump>/_trajstore/<split>/``, so the split folders
hold only step files, then the manifest says version 2. Step files are not touched.

Safe to interrupt and to run again: readers look in both places at every moment, each file is moved
with one ``rename``, and the manifest is replaced (temp + fsync + rename) only once everything is moved.
Run it while no writer has the dump open."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..errors import ConfigError
from ..format.spec import MANIFEST_VERSION
from . import commit, index, listing, manifest, paths
from .files import fsync, fsync_dir, stale_temps

__all__ = ["upgrade_layout"]

_SIDECAR_RE = re.compile(r"^(step_[0-9]{8,}(\.rank[0-9]{5,}-of-[0-9]{5,})?\.(sha256|skipped\.json)|columns\.json)\Z")  # columns: store/columns.py


def upgrade_layout(root: str | Path) -> list[str]:
    """Upgrade the dump at ``root`` to layout 2; returns the files moved (``<split>/<name>``), empty
    when the dump already is of layout 2. ConfigError while a live process writes to it."""
    root = paths.local_root(root, "upgrade")
    doc = manifest.read_manifest(root)
    if doc["format_version"] >= 2:
        return []
    splits = listing.list_splits(root)
    for s in splits:
        paths.check_real_dirs(root / s)  # nothing is moved or removed through a linked folder
    live = [f"{s}/{n}" for s in splits for d in (root / s, root / s / index.DIR) if d.is_dir()
            for n in os.listdir(d) if ".tmp-" in n and n not in _stale(d)]
    if live:
        raise ConfigError(f"dump {root}: a writer is still writing ({', '.join(live[:3])}); upgrade it once "
                          "every writer has closed")
    (root / paths.SIDE).mkdir(exist_ok=True)
    moved = []
    for s in splits:
        d, side = root / s, root / paths.SIDE / s
        side.mkdir(exist_ok=True)
        commit.clean_temp(d)  # promotes pending checksums of dead writers, removes their temporaries
        for n in sorted(os.listdir(d)):
            if _SIDECAR_RE.match(n):
                os.replace(d / n, side / n)
                moved.append(f"{s}/{n}")
        old = d / index.DIR
        if old.is_dir():
            (side / index.SIDE_DIR).mkdir(exist_ok=True)
            for n in sorted(os.listdir(old)):
                if index.SEGMENT_RE.match(n) and n.endswith(".parquet") or index.SUM_RE.match(n):
                    to = n[: -len("parquet")] + "index" if n.endswith(".parquet") else n  # a checksum keeps its name
                    os.replace(old / n, side / index.SIDE_DIR / to)
                    moved.append(f"{s}/{index.DIR}/{n}")
            index.clean_temp(d)
            fsync_dir(side / index.SIDE_DIR)
            try:
                old.rmdir()
            except OSError:
                pass  # something else is in it: left alone
        fsync_dir(side)
        fsync_dir(d)
    fsync_dir(root / paths.SIDE)
    doc = {**doc, "format_version": MANIFEST_VERSION, "layout": paths.LAYOUT}
    tmp = root / f".{paths.MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(doc, indent=2))
    fsync(tmp)
    os.replace(tmp, root / paths.MANIFEST)
    fsync_dir(root)
    return moved


def _stale(d: Path) -> set[str]:
    return set(stale_temps(d, ".", keep_own=False))
