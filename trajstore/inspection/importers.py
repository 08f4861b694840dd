"""``trajstore import``: dumps written by other tools become trajstore dumps (docs/IMPORT.md).

Three kinds of source, auto-detected or named with ``kind=``:

* ``pt``: a folder of ``torch.save`` files, as AReaL (``step_000042.pt``, ``step_000007_dp_3.pt``),
  slime (``--save-debug-rollout-data .../rollout_data_{rollout_id}.pt``, ``eval_{id}`` for
  evaluation) and TRL users write them. Read with ``torch.load(weights_only=True)`` only; a file
  that needs more is refused unless ``trust_pickle=True``.
* ``verl``: a RolloutSkip dump (``<dump_dir>/<exp>_<project>/GBS.._N.._in.._out../<step>/gen_batch.dp``
  with ``meta.json``), written by ``DataProto.save_to_disk``: a pickle.
* ``roll``: a ROLL rollout-mock dump (``<dump_dir>/<train|val>/step_000000.pkl``): a pickle.

Pickles are read only with ``trust_pickle=True`` (``--trust-pickle``): unpickling runs code named by
the file, so it is for files you made yourself. All loading is in :mod:`.legacy_load`.

Each file becomes one step written by :class:`~trajstore.writer.Writer` (checksums, index: a normal
dump). A batch the writer cannot store is skipped with its reason (recorded in the dump as a
skipped step too) unless ``strict=True``; :class:`ImportReport` says what was converted.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..base.text import format_ranges, human_bytes, runs
from ..errors import BatchError, ConfigError, DumpNotFoundError, FormatError, TrajstoreError, WriterError
from ..store import commit, listing, paths
from ..read.reader import Reader
from ..write.writer import Committed, Writer
from .legacy_load import NeedsTrust, PickledDataProto, load_weights_only, unpickle_trusted

__all__ = ["import_dump", "ImportReport", "Imported", "Skipped", "KINDS"]

log = logging.getLogger("trajstore.import")
KINDS = ("pt", "verl", "roll")
PT_SUFFIXES = (".pt", ".pth")
TRUST_HINT = ("pass --trust-pickle (trust_pickle=True) only if you made these files yourself: unpickling runs "
              "code named by the file")
_RANK = re.compile(r"^(?P<head>.*?)[_-](?P<word>dp|rank)[_-]?(?P<rank>\d+)$")
_STEP = re.compile(r"^(?P<head>.*?)(?P<step>\d+)$")


@dataclass
class Imported:
    """One step written: from ``source`` (relative to the source folder) to ``split``/``step``."""

    source: str
    split: str
    step: int
    rows: int = 0
    bytes: int = 0
    earlier: bool = False  # already in the dump, imported from the same file by an earlier run (kept)


@dataclass
class Skipped:
    """A file not imported, and why (``split``/``step`` where known)."""

    source: str
    reason: str
    split: str | None = None
    step: int | None = None


@dataclass
class ImportReport:
    """What :func:`import_dump` converted: ``imported`` steps and ``skipped`` files."""

    src: str
    dst: str
    kind: str
    imported: list[Imported] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"src": self.src, "dst": self.dst, "kind": self.kind, "imported": [asdict(i) for i in self.imported],
                "skipped": [asdict(s) for s in self.skipped]}

    def splits(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i in self.imported:
            out.setdefault(i.split, []).append(i.step)
        return {k: sorted(v) for k, v in sorted(out.items())}

    def written(self) -> str:
        """What the dump holds of this import, in a few words (``split train: steps 0-2``)."""
        return "; ".join(f"split {k}: steps {format_ranges(runs(v))}" for k, v in self.splits().items()) or "nothing"

    def summary(self) -> str:
        earlier = [i for i in self.imported if i.earlier]
        lines = [f"imported {len(self.imported)} step(s) from {self.src} ({self.kind}) into {self.dst}"
                 + (f" ({len(earlier)} of them by an earlier run from the same files, kept as they were)"
                    if earlier else "")]
        for name, steps in self.splits().items():
            mine = [i for i in self.imported if i.split == name]
            lines.append(f"  split {name}: steps {format_ranges(runs(steps))}  rows {sum(i.rows for i in mine)}  "
                         f"bytes {human_bytes(sum(i.bytes for i in mine))}")
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} file(s):")
            lines += [f"  {s.source}: {s.reason}" for s in self.skipped]
        return "\n".join(lines)


@dataclass
class _Item:
    """One source file to become ``split``/``step`` with step metadata ``meta``."""

    path: Path
    split: str
    step: int
    meta: dict


# ----------------------------------------------------------------------------- finding the files
def detect(src: Path) -> str:
    """The kind of dump at ``src``: ``verl`` (a ``gen_batch.dp``), ``roll`` (``*.pkl``) or ``pt``."""
    if src.is_file():
        return "verl" if src.name.endswith(".dp") else "roll" if src.suffix == ".pkl" else "pt"
    if next(src.rglob("gen_batch.dp"), None) is not None:
        return "verl"
    if next(src.rglob("*.pkl"), None) is not None:
        return "roll"
    if any(next(src.rglob(f"*{s}"), None) is not None for s in PT_SUFFIXES):
        return "pt"
    raise DumpNotFoundError(f"{src}: no .pt/.pth files, verl gen_batch.dp or ROLL .pkl files to import; "
                            "point at the folder the framework wrote its dump into")


def _files(src: Path, pattern: str) -> list[Path]:
    return [src] if src.is_file() else sorted(p for p in src.rglob(pattern) if p.is_file())


def _rel(src: Path, p: Path) -> str:
    return p.name if src.is_file() else str(p.relative_to(src))


def _split_of(src: Path, p: Path, default: str) -> str:
    """The folders between ``src`` and the file, joined with ``-`` (``train``, ``val``), else ``default``."""
    parts = [] if src.is_file() else list(p.parent.relative_to(src).parts)
    return "-".join(parts) if parts else default


def _scan_pt(src: Path, split: str, skipped: list[Skipped]) -> list[_Item]:
    files = _files(src, "*.pt") + ([] if src.is_file() else _files(src, "*.pth"))
    items = []
    for p in sorted(files):
        name, where = p.stem, _split_of(src, p, split)
        if m := _RANK.match(name):
            name, where = m["head"], f"{where}-{m['word']}{int(m['rank'])}"
        m = _STEP.match(name)
        if m is None and len(files) > 1:
            skipped.append(Skipped(_rel(src, p), "no step number in its name (step_12.pt, rollout_data_12.pt, 12.pt)"))
            continue
        step = int(m["step"]) if m else 0
        if m and re.search(r"(^|[_-])eval[_-]?$", m["head"]):  # slime names evaluation rollouts eval_<id>
            where = "eval" if where == split else f"{where}-eval"
        items.append(_Item(p, where, step, {}))
    return items


def _scan_verl(src: Path, split: str, skipped: list[Skipped]) -> list[_Item]:
    files = _files(src, "gen_batch.dp")
    runs = sorted({str(p.parent.parent) for p in files})
    if len(runs) > 1:
        raise ConfigError(f"{src} holds {len(runs)} RolloutSkip runs ({', '.join(runs[:4])}...); import one at a "
                          "time: point at one GBS<n>_N<n>_in<n>_out<n> folder")
    items = []
    for p in files:
        rel = _rel(src, p)
        if not p.parent.name.isdigit():
            skipped.append(Skipped(rel, f"its folder {p.parent.name!r} is not a step number"))
            continue
        meta_file = p.parent / "meta.json"
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError) as e:
            skipped.append(Skipped(rel, f"no readable meta.json beside it ({e}); RolloutSkip writes it once the "
                                        "step is dumped, so the step is incomplete", split, int(p.parent.name)))
            continue
        items.append(_Item(p, split, int(p.parent.name), meta if isinstance(meta, dict) else {"meta": meta}))
    return items


def _scan_roll(src: Path, split: str, skipped: list[Skipped]) -> list[_Item]:
    items = []
    for p in _files(src, "*.pkl"):
        m = re.fullmatch(r"step_(\d+)", p.stem)
        if m is None:
            skipped.append(Skipped(_rel(src, p), "not named step_<n>.pkl as ROLL's rollout mock writes it"))
            continue
        items.append(_Item(p, _split_of(src, p, split), int(m[1]), {}))
    return items


SCANS = {"pt": _scan_pt, "verl": _scan_verl, "roll": _scan_roll}


# ----------------------------------------------------------------------------- reading one file
def _load(item: _Item, kind: str, trust: bool) -> Any:
    """The batch one source file holds, as saved (slime's ``{"rollout_id", "samples", "metadata"}`` too)."""
    if kind == "pt":
        try:
            return load_weights_only(item.path)
        except NeedsTrust as e:
            if not trust:
                raise ConfigError(f"{e}; {TRUST_HINT.replace('these files', 'this file')}") from None
        except FormatError:
            if not trust:
                raise
        return unpickle_trusted(item.path)
    obj = unpickle_trusted(item.path)
    if not isinstance(obj, PickledDataProto):
        raise BatchError(f"holds a {type(obj).__module__}.{type(obj).__qualname__}, not a DataProto")
    if getattr(obj, "remote_batch", None) is not None:
        raise BatchError("its DataProto has a remote_batch (fields held elsewhere), which the file does not contain")
    return obj


# ----------------------------------------------------------------------------- the import
def import_dump(src: str | Path, dst: str | Path, *, kind: str | None = None, trust_pickle: bool = False,
                split: str = "train", strict: bool = False, overwrite: bool = False,
                progress: Callable[[list], Iterable] | None = None) -> ImportReport:
    """Convert the dump at ``src`` (a folder, or one file) into a trajstore dump at ``dst``.

    ``kind``: ``"pt"``, ``"verl"`` or ``"roll"`` (default: detected). ``trust_pickle``: allow
    unpickling (verl and ROLL dumps, ``.pt`` files ``weights_only`` cannot read); it runs code named by
    the files, so only for files you made yourself. ``split``: the split of files whose folder or
    name names none. A batch the writer cannot store (or a file that cannot be read) is skipped and
    reported; ``strict=True`` raises instead. ``overwrite`` replaces steps already in ``dst``.
    Returns an :class:`ImportReport`; raises :class:`ConfigError` when a file needs ``trust_pickle``."""
    src_p, dst_p = paths.local_root(src, "import"), paths.local_root(dst, "import")
    if not src_p.exists():
        raise DumpNotFoundError(f"{src}: no such file or folder to import")
    if kind is not None and kind not in KINDS:
        raise ConfigError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    paths.check_split(split)
    kind = kind or detect(src_p)
    if kind != "pt" and not trust_pickle:
        what = "verl RolloutSkip dump (gen_batch.dp)" if kind == "verl" else "ROLL rollout-mock dump (.pkl)"
        raise ConfigError(f"{src} is a {what}: its files are Python pickles and nothing was read; {TRUST_HINT}")
    report = ImportReport(str(src), str(dst), kind)
    items = SCANS[kind](src_p, split, report.skipped)
    seen: dict[tuple[str, int], str] = {}
    writers: dict[str, Writer] = {}
    committed: dict[tuple[str, int], Committed] = {}
    try:
        _run(items, kind, trust_pickle, strict, overwrite, src_p, dst_p, report, seen, writers, committed, progress)
    except TrajstoreError as e:  # stopped half way: say what the dump holds, and how to go on
        if report.imported and e.args and isinstance(e.args[0], str):
            e.args = (f"{e.args[0]}; {dst} holds what was imported before it ({report.written()}): run the same "
                      "command again to go on (steps imported from the same files are kept, not written again)",
                      *e.args[1:])
        raise
    return report


def _run(items: list[_Item], kind: str, trust_pickle: bool, strict: bool, overwrite: bool, src_p: Path,
         dst_p: Path, report: ImportReport, seen: dict, writers: dict[str, Writer], committed: dict,
         progress: Callable[[list], Iterable] | None) -> None:
    try:
        for item in (progress or list)(items):
            rel = _rel(src_p, item.path)
            key = (item.split, item.step)
            if key in seen:
                _skip(report, strict, Skipped(rel, f"step {item.step} of split {item.split!r} is also {seen[key]}",
                                              *key), ConfigError)
                continue
            seen[key] = rel
            prior = None if overwrite else _prior(dst_p, item.split, item.step)
            if prior is not None:
                if prior == {"kind": kind, "file": rel}:  # a rerun after a stop: this file is in already
                    report.imported.append(Imported(rel, *key, earlier=True))
                else:
                    _skip(report, strict, Skipped(rel, f"step {item.step} of split {item.split!r} is already in "
                                                       f"{dst_p} (from {prior.get('file', 'elsewhere')}); "
                                                       "--overwrite (overwrite=True) replaces it", *key),
                          ConfigError)
                continue
            failed = _convert(item, kind, trust_pickle, rel, writers, committed, dst_p, overwrite)
            if failed is None:
                c = committed.get(key)
                report.imported.append(Imported(rel, *key, c.rows if c else 0, c.bytes if c else 0))
            else:
                _skip(report, strict, Skipped(rel, failed[0], *key), failed[1])
    finally:
        for w in writers.values():
            w.close()


def _prior(dst: Path, split: str, step: int) -> dict | None:
    """None if ``dst`` has no step ``step`` in ``split``; else where it was imported from (``{}``: not
    by ``import``)."""
    if not (dst / paths.MANIFEST).is_file() or step not in listing.list_steps(dst / split):
        return None
    try:
        got = Reader(dst, split).meta(step).get("imported_from")
    except TrajstoreError:
        return {}
    return got if isinstance(got, dict) else {}


def _convert(item: _Item, kind: str, trust: bool, rel: str, writers: dict[str, Writer],
             committed: dict, dst: Path, overwrite: bool) -> tuple[str, type] | None:
    """Write one file as one step; None, or why it was skipped and the error class ``strict`` raises."""
    try:
        paths.check_split(item.split)  # a folder named like no split (``_trajstore``...): this file only
    except ConfigError as e:
        return f"its folder makes the split name {item.split!r}, which cannot be used: {e}; rename the folder " \
               "or import it on its own with --split", ConfigError
    try:
        batch = _load(item, kind, trust)
    except (ConfigError, NeedsTrust):
        raise
    except BatchError as e:
        return str(e), BatchError
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file is reported, the import goes on
        return f"cannot be read ({type(e).__name__}: {e})", FormatError
    if item.split not in writers:
        def on_commit(c: Committed, split: str = item.split) -> None:
            committed[(split, c.step)] = c
        writers[item.split] = Writer(dst, item.split, overwrite=overwrite, on_commit=on_commit)
    w = writers[item.split]
    meta = {**item.meta, "imported_from": {"kind": kind, "file": rel}}
    try:
        w.append(item.step, batch, meta=meta)
    except (BatchError, ConfigError) as e:  # the batch, or its metadata, cannot be stored exactly
        commit.record_skipped(w.dir, item.step, f"import of {rel}: {e}")
        return str(e), type(e)
    try:
        w.flush()
    except WriterError as e:  # already recorded as skipped by the writer
        cause = e.__cause__
        return (str(cause), type(cause)) if isinstance(cause, TrajstoreError) else (str(e), WriterError)
    return None


def _skip(report: ImportReport, strict: bool, s: Skipped, cls: type) -> None:
    if strict:
        raise cls(f"{s.source}: {s.reason} (strict: the files after it were not imported)")
    log.warning("trajstore import: skipped %s: %s", s.source, s.reason)
    report.skipped.append(s)
