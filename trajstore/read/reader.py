"""Reader: list the steps of a dump and bring one back exactly as it was appended."""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from ..base import threads as _threads
from . import shards as shard_read, tables
from .decode import decode, decode_file
from ..device import bridge as torch_bridge
from ..format.batch import containers
from ..format import typed
from ..format import limits
from ..format.file import validate
from ..format.file.parquet import read_sample
from ..format.spec import is_dict_batch, is_plain_sample
from .prefetch import iterate
from ..store import listing, manifest, paths, remote, stepfile
from ..store.fs import is_remote, resolve, source
from ..store.segments import Index
from ..errors import ConfigError, DumpNotFoundError, FormatError, StepNotFoundError, foreign_errors

__all__ = ["Reader"]


_StepFile = stepfile.StepFile  # an opened step file (store/stepfile.py)


def _describe(steps: list[int], step: int) -> str:
    if not steps:
        return "the split holds no steps"
    i = bisect.bisect_left(steps, step)
    near = sorted({steps[j] for j in (i - 1, i) if 0 <= j < len(steps)})
    return (f"it holds {len(steps)} step(s) from {steps[0]} to {steps[-1]}; "
            f"nearest: {', '.join(map(str, near))}")


class Reader:
    """Read a dump written by :class:`trajstore.Writer`.

    >>> r = trajstore.Reader("dumps/run1")
    >>> batch = r[12]                 # the batch of step 12, as appended
    >>> r.read(12, columns=["rewards"])
    >>> trajstore.Reader("copied/step_00000012.parquet")[12]   # a step file on its own

    ``path`` may also be one step file, copied out of its dump or renamed: the reader then holds
    that one step (its number and split are the file's own, ``split`` is not used), ``manifest``
    is ``{}`` and ``skipped`` is empty; with ``verify=True`` it is checked against a
    ``<name>.sha256`` beside it (``sha256sum`` format). Without ``split``: ``train``, else the dump's
    only split; ``path`` may be a URL (``s3://bucket/run1``..., ``fs``: the file system to use, as for
    :class:`trajstore.Writer`). Several splits and no ``train`` (rank splits ``train-rank0``... included) is a
    ConfigError naming them (``store.listing.default_split``).

    A step of N ranks is their shards joined; ``rank``/``world_size``/``balance``: a replaying rank's slice
    of each step; ``shard(s, k)``: rank k's shard as dumped (``trajstore/read/shards.py``).

    ``threads``: the threads a read uses (Arrow decoding of a step's row groups, on Arrow's pool raised to
    it while the read is in flight, and the joins and copies after it); default ``$TRAJSTORE_THREADS``, else this process's cores shared among the ranks of this
    host (``$LOCAL_WORLD_SIZE``), never ``OMP_NUM_THREADS`` (README, Threads). The budget used is the
    attribute ``threads``.
    """

    def __init__(self, path: str | Path, split: str | None = None, *, verify: bool = False,
                 rank: int | None = None, world_size: int | None = None, balance: str = "contiguous",
                 fs: Any = None, threads: int | None = None):
        self._slice = shard_read.check_slice(rank, world_size, balance, f"Reader({str(path)!r})")
        self._by_id = False  # rows of each step sorted by trajectory id (what an aligned diff compares)
        self.threads = _threads.budget(threads, f"Reader({str(path)!r})")  # the thread budget of a read
        self.path = resolve(path, f"Reader({str(path)!r})", fs)  # a Path, or a RemotePath (store/fs.py)
        self.verify = verify  # check each step file against its recorded SHA-256 before decoding
        self._lone: int | None = None  # the step of a step file opened on its own
        if self.path.is_file():
            self._open_lone()
            return
        self.split = paths.check_split(listing.default_split(self.path) if split is None else split)
        self.manifest = manifest.read_manifest(self.path)
        self.dir = self.path / self.split
        if not self.dir.is_dir():
            others = listing.list_splits(self.path)
            raise DumpNotFoundError(
                f"dump {self.path} has no split {self.split!r}; splits present: {others or 'none'}"
            )
        self.refresh()

    def _open_lone(self) -> None:
        f = self.path
        with foreign_errors(f, "reading it as a Parquet file", then="it is damaged or not a trajstore step file"):
            with pq.ParquetFile(source(f), **limits.THRIFT_LIMITS) as pf:
                kv = pf.metadata.metadata or {}
        try:
            doc = limits.load_doc(kv[b"trajstore"], str(f))
            step, split = doc["step"], doc["split"]
        except (KeyError, TypeError, IndexError):
            raise FormatError(f"{f}: not a trajstore step file (no trajstore metadata with its step and split); "
                              "open a dump folder, or a step file written by trajstore") from None
        if type(step) is not int or step < 0 or type(split) is not str:
            raise FormatError(f"{f}: its trajstore metadata names step {step!r} of split {split!r}; it is damaged")
        self._lone, self.split, self.manifest, self.dir = step, split, {}, f.parent
        self.refresh()

    # -- listing
    def refresh(self) -> list[int]:
        """Re-scan the split for steps committed since the reader was opened."""
        if self._lone is not None:
            self._steps = [self._lone] if self.path.exists() else []
            self._listing = listing.Listing(self._steps, {}, {}, {}, {})
            return self._steps
        self._listing = listing.scan(self.dir)
        self._steps = self._listing.steps
        # index segments are read again on demand; object storage keeps none (store/remote.py)
        self._index = remote.NoIndex() if is_remote(self.dir) else Index(self.dir, self.split)
        return self._steps

    def wait_for(self, step: int, timeout: float | None = None, poll: float = 0.05) -> None:
        """Block until ``step`` is committed (a writer may be running); StepNotFoundError after ``timeout`` s,
        or at once if the writer recorded the step as skipped."""
        step = paths.check_step(step)
        if self._lone is not None:
            self.file(step)  # a lone step file holds its one step, or StepNotFoundError
            return
        end = None if timeout is None else time.monotonic() + timeout
        f = self.dir / paths.step_name(step)
        while not f.exists() and step not in listing.scan(self.dir).shards:
            if listing.is_skipped(self.dir, step):
                why = listing.list_skipped(self.dir).get(step, "")
                raise StepNotFoundError(f"step {step} will not appear in dump {self.path} split {self.split!r}: "
                                        f"the writer recorded it as skipped: {why}", step=step)
            if end is not None and time.monotonic() >= end:
                self.refresh()
                raise StepNotFoundError(
                    f"step {step} did not appear in dump {self.path} split {self.split!r} within {timeout} s: "
                    f"{_describe(self._steps, step)}; is the writer still running?", step=step)
            time.sleep(poll if end is None else max(0.0, min(poll, end - time.monotonic())))
        self.refresh()

    @property
    def skipped(self) -> dict[int, str]:
        """Steps the writer recorded as skipped (e.g. disk full), with the reason."""
        return {} if self._lone is not None else listing.list_skipped(self.dir)

    @property
    def steps(self) -> list[int]:
        return list(self._steps)

    @property
    def splits(self) -> list[str]:
        return [self.split] if self._lone is not None else listing.list_splits(self.path)

    def __len__(self) -> int:
        return len(self._steps)

    def __contains__(self, step: object) -> bool:
        if self._lone is not None:
            return step == self._lone and self.path.exists()
        return isinstance(step, int) and ((self.dir / paths.step_name(step)).exists() or step in self._listing.shards)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        for s in list(self._steps):
            yield s, self.read(s)

    def __getitem__(self, step: int) -> Any:
        return self.read(step)

    # -- one step
    def file(self, step: int) -> Path:
        """The committed file of ``step`` (raises StepNotFoundError)."""
        step = paths.check_step(step)
        if self._lone is not None:
            if step == self._lone and self.path.exists():
                return self.path
            raise StepNotFoundError(f"step {step} is not in {self.path}: the file holds step {self._lone} of "
                                    f"split {self.split!r} alone", step=step)
        f = self.dir / paths.step_name(step)
        if step in self._listing.shards or step in self._listing.ambiguous or not f.exists():
            self.refresh()
            shard_read.check_whole(self, step)  # written by several ranks, or ambiguous: says so
            elsewhere = [s for s in self.splits if s != self.split
                         and (self.path / s / paths.step_name(step)).exists()]
            hint = f"; split(s) {elsewhere} hold step {step}" if elsewhere else ""
            why = listing.list_skipped(self.dir).get(step)
            hint += f"; the writer recorded it as skipped: {why}" if why is not None else ""
            hint += shard_read.incomplete(self, step)
            raise StepNotFoundError(
                f"step {step} is not in dump {self.path} split {self.split!r}: "
                f"{_describe(self._steps, step)}{hint}", step=step
            )
        return f

    def _open(self, step: int, check: bool = True, f: Path | None = None) -> _StepFile:
        """The step's Parquet file (``f``: one of its shards) and its trajstore description; ``check=False``
        skips the walk of the whole spec (``_validate``), for callers that check the one node they decode."""
        return stepfile.open_step(self.file(step) if f is None else f, step, self.verify, check)

    def meta(self, step: int) -> dict:
        """The ``meta`` dict given to ``append`` for ``step``, its values of the types given (a step of
        several ranks: their metas merged, ``shard_read.meta``)."""
        if self._sharded(step):
            return shard_read.meta(self, step)
        sf = self._open(step, check=False)  # the spec is not walked: only the meta is decoded
        return typed.step_meta(sf.doc, str(sf.path))

    def info(self, step: int) -> dict:
        """The step's stored description: spec, meta, row count."""
        return shard_read.logical(self, step, None, None)[0] if self._sharded(step) else self._open(step).doc

    def _sharded(self, step: int) -> bool:  # read through shard_read: shards, or a rank's slice
        return self._slice is not None or self._by_id or step in self._listing.shards

    def ids(self, step: int) -> Any:
        """The trajectory id of each row ``read(step)`` returns, in its order: an int64 numpy array of
        shape ``[B, 2]``, row ``i`` holding ``(step, row)`` of the logical batch as it was dumped (its
        step and its row there), whatever slice, rank layout or balance this reader reads; a step
        recorded with ``ids=`` (``Writer.append``) gives those (docs/FORMAT.md 3.13)."""
        return shard_read.ids(self, paths.check_step(step))

    def files(self, step: int) -> list[Path]:
        """The files of ``step``: its step file, or its N shard files in rank order."""
        return shard_read.files(self, step)

    def shard(self, step: int, rank: int, columns: list[str] | None = None, layout: str | None = None) -> Any:
        """The shard rank ``rank`` appended for ``step`` (of a step written by several ranks), exactly."""
        return shard_read.shard(self, step, rank, columns, layout)

    def read(self, step: int, columns: list[str] | None = None, layout: str | None = None,
             device: Any = None) -> Any:
        """The batch of ``step``; ``columns`` limits it to those fields, ``layout``
        ("padded" or "packed") converts a dict batch between the two layouts; ``device`` ("cuda")
        moves its torch tensors there through pinned staging memory (trajstore/device/bridge.py),
        ordered on the caller's current stream. On the CPU, tensors are views of Arrow memory
        where the layout allows."""
        with _threads.using(self.threads):
            return self._read_to(step, columns, layout, device)

    def _read_to(self, step: int, columns: list[str] | None, layout: str | None, device: Any) -> Any:
        if device is not None:
            arena = torch_bridge.host_arena(device)
            try:
                batch = self._read(step, columns, layout, arena)
            except BaseException:
                if arena is not None:
                    arena.release()  # the pinned buffer goes back to the pool
                raise
            return torch_bridge.to_device(batch, device, arena)
        return self._read(step, columns, layout)

    def _read(self, step: int, columns: list[str] | None, layout: str | None, arena: Any = None) -> Any:
        with _threads.using(self.threads):
            return self._read_step(step, columns, layout, arena)

    def _read_step(self, step: int, columns: list[str] | None, layout: str | None, arena: Any = None) -> Any:
        if not self._sharded(step):
            try:
                return decode_file(self._open(step), step, columns, layout, arena)
            except ConfigError:
                if step not in self._listing.shards:  # else its last shard was committed since the listing
                    raise
        doc, table, where = shard_read.logical(self, step, columns, layout)
        return decode(doc, table, where, columns, layout, arena)

    def column(self, name: str, steps: list[int] | None = None, *, workers: int | None = None) -> dict[int, Any]:
        """One field of many steps: ``{step: value}`` for ``steps`` (default: all, in order), where
        ``value`` is what ``read(step, columns=[name])[name]`` returns (for a list-of-trajectories
        batch: the list of each trajectory's value, None where the trajectory is None or lacks
        the field), and a per-trajectory tensor field (e.g. ``rewards``) is decoded straight
        from its column, checked against its spec node. ``workers`` > 1 reads that many files at
        once on threads: worth it where file reads wait on storage (network file systems, a cold
        cache); on a warm page cache the per-file work (mostly Python around pyarrow's footer
        parse) contends for the GIL, and one thread is faster (benchmarks/RESULTS.md).
        Stack the values with ``torch.stack(list(d.values()))`` when every step has the same
        batch size. A plain per-trajectory field of a step is taken from the split's index
        (``<dump>/_trajstore/<split>/index/``, docs/FORMAT.md section 6) when a segment holds it and the step file
        is still the one indexed, without opening the file; every other step is read from its
        file. With ``verify=True`` the index is not used: each file is checked whole first."""
        if type(name) is not str:
            raise ConfigError(f"column name must be a str, got {type(name).__name__}")
        steps = list(self._steps) if steps is None else [paths.check_step(s) for s in steps]
        if workers is not None and (type(workers) is not int or workers < 1):
            raise ConfigError(f"workers must be an int >= 1, got {workers!r}")
        got = {} if self.verify or not steps or self._lone is not None or self._slice else \
            self._index.values(name, steps, self._listing.shards)
        rest = [s for s in steps if s not in got] if got else steps
        n = workers or 1
        if n == 1 or len(rest) < 2:
            files = {s: self._column(s, name) for s in rest}
        else:
            with ThreadPoolExecutor(max_workers=n, thread_name_prefix="trajstore-column") as ex:
                files = dict(zip(rest, ex.map(lambda s: self._column(s, name), rest)))
        return {s: got[s] if s in got else files[s] for s in steps} if got else files

    def _column(self, step: int, name: str) -> Any:
        with _threads.using(self.threads):
            return self._column_of(step, name)

    def _column_of(self, step: int, name: str) -> Any:
        if self._sharded(step):
            return shard_read.column(self, step, name)
        sf = self._open(step, check=False)
        pf, doc, f = sf.pf, sf.doc, sf.path
        spec = doc["batch"]
        node = dict(spec["keys"]).get(name) if is_dict_batch(spec) else None
        limits.check_pages(pf.metadata, str(f))
        if is_plain_sample(node):
            with foreign_errors(f, "reading field {!r} of step {}", name, step, then="the step is damaged"):
                return read_sample(pf, node, doc, f)
        with foreign_errors(f, "reading its Arrow schema", then="the step is damaged"):
            arrow_schema = pf.schema_arrow
        validate.check(doc, arrow_schema, pf.metadata.num_rows, str(f))
        batch = decode_file(sf, step, [name], None)
        if isinstance(batch, list | tuple):
            return [None if e is None else e.get(name) for e in batch]
        plain = containers.unwrap(batch)[0] if "wrapper" in spec else batch
        if name not in plain:  # the description names it, but its container tag does not give it back
            raise FormatError(f"{sf.path}: step {step}: field {name!r} is in the file's spec but not in the batch "
                              "its container wrapper rebuilds; the file's description is damaged")
        return plain[name]

    def iter(self, steps: list[int] | None = None, device: Any = None, prefetch: int = 2,
             columns: list[str] | None = None, layout: str | None = None) -> Iterator[tuple[int, Any]]:
        """Yield ``(step, batch)`` for ``steps`` (default: all), decoding ``prefetch`` steps ahead
        on a thread pool (``trajstore/read/prefetch.py``); with ``device="cuda"`` the copy of the next
        batch overlaps the caller's work and the stream current at this call waits on each batch's
        copy. From ``prefetch=4`` on, each step decodes on one thread (the steps in flight give the
        parallelism, and nested thread pools are slower: benchmarks/RESULTS.md). ``break`` frees
        the threads and staging memory."""
        steps = list(self._steps) if steps is None else [paths.check_step(s) for s in steps]
        return iterate(lambda s, arena: self._read(s, columns, layout, arena), steps, device, prefetch)

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def __repr__(self) -> str:
        return f"Reader({str(self.path)!r}, split={self.split!r}, steps={len(self._steps)})"

    # -- views (trajstore/read/tables.py)
    def to_pandas(self, step: int | None = None) -> Any:
        """One DataFrame row per trajectory of ``step`` (None: every step), with ``step`` and ``index``."""
        return tables.to_pandas(self, step)

    def duckdb(self) -> Any:
        """A DuckDB connection with one view per split (``train``, ``val``...), each row with its ``step``."""
        return tables.duckdb_connect(self)
