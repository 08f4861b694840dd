"""The reader's side of a logical step written by N ranks, and of replay on M ranks (docs/FORMAT.md
section 1; ``Reader`` delegates here).

* A step written by N ranks (``Writer(rank=, world_size=)``) is N shard files; ``Reader[s]`` is the
  logical batch: the shards' rows joined in rank order on the Arrow table and spec level
  (``format.shards.join``), then decoded like any step. A step whose shards are not all committed is
  not listed; reading it says which ranks are missing (``incomplete``).
* ``Reader(..., rank=r, world_size=M, balance=...)`` reads rank r's slice of each logical step (one
  row per trajectory): with ``balance="contiguous"`` and M equal to the step's N, exactly the shard
  rank r dumped; otherwise ``format.shards.partition`` of the B rows: "contiguous", equal chunks in
  order (verl's ``DataProto.chunk``), or "tokens", equal-size token-balanced parts (verl's
  ``get_seqlen_balanced_partitions(equal_size=True)``). B % M must be 0 (a ConfigError otherwise).
  The slice is cut from the joined table (``format.shards.take``) before decoding.
* ``Reader.shard(s, k)`` decodes the shard rank k dumped, as that rank appended it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ..base.threads import map_parallel, threads, using
from ..errors import ConfigError, StepNotFoundError
from ..format.batch import containers
from ..format.shard import shards
from ..format import typed
from ..format.shard import ids as idcol
from ..format.shard.join import Joiner, merge_meta
from ..store import listing, paths
from .decode import decode, read_table


__all__ = ["BALANCES", "check_slice", "files", "logical", "shard", "column", "meta", "incomplete",
           "check_whole", "ranks", "ids"]

BALANCES = ("contiguous", "tokens")


def check_slice(rank: Any, world_size: Any, balance: Any, who: str) -> tuple[int, int, str] | None:
    """``(rank, world_size, balance)`` of a reader that reads one rank's slice of each step, or None: also
    for a world size of 1, whose one slice is the whole logical batch (read as without a slice, no take)."""
    if balance not in BALANCES:
        raise ConfigError(f"{who}: balance={balance!r}; use 'contiguous' (equal chunks in order, the dumped "
                          "shards when the world size is the dump's) or 'tokens' (token-balanced)")
    sh = paths.check_shard(rank, world_size, who)
    return None if sh is None or sh[1] == 1 else (*sh, balance)


def check_whole(r: Any, step: int) -> None:
    """For ``Reader.file``: raise for a step that has no one file (ambiguous, or written by several ranks)."""
    if step in r._listing.ambiguous:
        raise listing.ambiguous_error(r.dir, step, r._listing.ambiguous[step])
    n = r._listing.shards.get(step)
    if n is not None:
        raise ConfigError(f"step {step} of dump {r.path} split {r.split!r} was written by {n} ranks, one shard "
                          f"file each; Reader.files({step}) lists them, Reader.read({step}) joins them")


def incomplete(r: Any, step: int) -> str:
    """The end of a 'step not found' message for a step whose shards are not all committed."""
    got = r._listing.incomplete.get(step)
    if got is None:
        return ""
    n, missing = got
    return (f"; it was written by {n} ranks and the shard(s) of rank(s) {listing.ranks_text(missing)} are not "
            "committed (still being written, or that rank stopped): a step is readable once all its shards "
            "are (`trajstore verify` lists incomplete steps)")


def files(r: Any, step: int) -> list[Path]:
    """The files of ``step``: its step file, or its shards in rank order."""
    step = paths.check_step(step)
    if r._lone is not None:
        return [r.file(step)]
    if step not in r._listing.shards and not (r.dir / paths.step_name(step)).exists():
        r.refresh()
    if step in r._listing.shards or step in r._listing.ambiguous:
        return listing.step_files(r.dir, r._listing, step)
    return [r.file(step)]


def _opened(r: Any, step: int, fs: list[Path], k: int) -> Any:
    """Shard ``k`` of ``fs`` (or the one step file) opened, its description checked (its footer's shard is
    the one its name says: store/stepfile.py)."""
    return r._open(step, f=fs[k])


def _part(r: Any, step: int, fs: list[Path], k: int, columns: list[str] | None,
          layout: str | None) -> tuple[dict, pa.Table, Path]:
    """Shard ``k`` of ``fs`` (or the one step file): its checked description and the table to decode."""
    sf = _opened(r, step, fs, k)
    return sf.doc, read_table(sf, step, columns, layout), sf.path


def _cut(r: Any, step: int, fs: list[Path], columns: list[str] | None, layout: str | None) -> tuple | None:
    """A contiguous slice of a step of N shards replayed on M != N ranks, read from the shards it overlaps
    and, in a shard it cuts, from the row groups holding its rows (the footers of all shards are read):
    for ``uniform`` shards, else None (the slice is then cut from the join of every shard)."""
    opened = [_opened(r, step, fs, k) for k in range(len(fs))]
    docs = [sf.doc for sf in opened]
    n = [sf.pf.metadata.num_rows for sf in opened]
    rank, m, _ = r._slice
    if not sum(n) or sum(n) % m or not shards.uniform(docs):
        return None
    lo, hi = rank * sum(n) // m, (rank + 1) * sum(n) // m
    cuts, off = [], 0
    for sf, rows in zip(opened, n):
        a, b = max(lo, off), min(hi, off + rows)
        if a < b:
            cuts.append((sf, (a - off, b - off)))
        off += rows
    parts = _read_all(step, cuts, columns, layout)
    # the slice's rows in order: decoded as joined, no take (a copy)
    doc, table = shards.join([(d, t) for d, t, _ in parts], every=docs)
    return doc, table, f"{r.dir}/step_{step:08d}.rank*-of-{len(fs):05d}.parquet"


def logical(r: Any, step: int, columns: list[str] | None, layout: str | None) -> tuple[dict, pa.Table, Any]:
    """``(doc, table, where)`` of what ``r.read(step, columns, layout)`` decodes: the logical step, or
    the reader's slice of it (for a reader in id order, its rows sorted by trajectory id)."""
    doc, table, where = _logical(r, step, columns, layout)
    if getattr(r, "_by_id", False):
        o = idcol.order(ids(r, step, _sorted=False))
        if o is not None:
            doc, table = shards.take(doc, table, o)
    return doc, table, where


def _logical(r: Any, step: int, columns: list[str] | None, layout: str | None) -> tuple[dict, pa.Table, Any]:
    fs = files(r, step)
    sl = r._slice
    if sl is not None and sl[2] == "contiguous" and len(fs) == sl[1] > 1:
        return _part(r, step, fs, sl[0], columns, layout)  # M == N: exactly the shard rank r dumped
    if sl is not None and sl[2] == "contiguous" and len(fs) > 1:
        cut = _cut(r, step, fs, columns, layout)  # only the shards and row groups of the slice
        if cut is not None:
            return cut
    doc, table, where = _joined(r, step, fs, columns, layout)
    if sl is None:
        return doc, table, where
    doc, table = shards.take(doc, table, _slice_rows(r, step, doc, table, len(fs)))
    return doc, table, where


def _joined(r: Any, step: int, fs: list[Path], columns: list[str] | None, layout: str | None) -> tuple:
    """``(doc, table, where)`` of the logical step: its one file, or its shards joined."""
    # each shard's own columns of ``columns`` join (docs/FORMAT.md 3.12); a token-balanced slice also reads
    # the columns that count each row's tokens (``shards.count_columns``: for shards of one packed batch, or
    # of one padded or masked spec, that name the same ones), and where those are not known every column, in
    # any layout (``columns`` and ``layout`` then select what is decoded)
    opened = [_opened(r, step, fs, k) for k in range(len(fs))]
    sl, also = r._slice, ()
    if sl is not None and sl[2] == "tokens":
        docs = [sf.doc for sf in opened]
        cc = [shards.count_columns(d) for d in docs]
        packed = all(d["batch"].get("form") == "packed" for d in docs)
        also = cc[0] if (packed or shards.uniform(docs)) and all(c == cc[0] for c in cc) else None
        if also is None:
            columns, layout, also = None, None, ()
    parts = _read_all(step, [(sf, None) for sf in opened], columns, layout, also)
    if len(parts) == 1:
        return parts[0]
    doc, table = shards.join([(d, t) for d, t, _ in parts])
    return doc, table, f"{r.dir}/step_{step:08d}.rank*-of-{len(fs):05d}.parquet"


def _read_all(step: int, files: list[tuple[Any, tuple[int, int] | None]], columns: list[str] | None,
              layout: str | None, also: Any = ()) -> list[tuple[dict, pa.Table, Path]]:
    """``(doc, table, path)`` of each opened shard file of ``files`` (with the rows to read, or None: all of
    them, ``read_table``), read at once on the thread pool where there are several and their row groups are
    worth it (each read decodes on Arrow's pool too)."""
    size = 0 if len(files) < 2 else sum(sf.pf.metadata.row_group(g).total_byte_size for sf, _ in files
                                        for g in range(sf.pf.metadata.num_row_groups))  # (one file: read here)
    n = threads()  # the reader's budget, on the pool's threads too

    def one(f: tuple[Any, tuple[int, int] | None]) -> tuple[dict, pa.Table, Path]:
        with using(n):
            return f[0].doc, read_table(f[0], step, columns, layout, f[1], also=also), f[0].path
    return map_parallel(one, files, size)


def _slice_rows(r: Any, step: int, doc: dict | None, table: pa.Table | None, nfiles: int, b: int | None = None) -> list[int]:
    """The rows of the logical step (of ``b`` rows, or ``table``'s) that the reader's slice takes."""
    rank, m, how = r._slice
    b = table.num_rows if b is None else b
    if b % m:
        raise ConfigError(
            f"step {step} of dump {r.path} split {r.split!r} holds {b} trajectories, which {m} ranks cannot share "
            f"equally (balance={how!r} needs B % world_size == 0); replay on a world size that divides {b}"
            + (f", or on the {nfiles} ranks that wrote it (their shards as dumped)" if nfiles > 1 else ""))
    counts = shards.token_counts(doc, table) if how == "tokens" else None
    return shards.partition(b, m, how, counts)[rank]


def ids(r: Any, step: int, _sorted: bool = True) -> np.ndarray:
    """The trajectory ids of the rows ``r.read(step)`` returns, in their order (format/shard/ids.py): an int64
    ``[B, 2]`` array of ``(step, row)``; only the files' footers and id columns are read, and for a
    token-balanced slice the columns that count each row's tokens."""
    fs = files(r, step)
    per, start = [], 0
    for f in fs:
        sf = r._open(step, check=False, f=f)
        t = sf.pf.read(columns=[idcol.STEP_COL, idcol.ROW_COL] if idcol.has_ids(sf.doc) else [])
        per.append(idcol.of_table(sf.doc, t, step, start))
        start += t.num_rows
    every = np.concatenate(per) if per else np.zeros((0, 2), np.int64)
    sl = r._slice
    if sl is not None and sl[2] == "contiguous" and len(fs) == sl[1] > 1:
        out = per[sl[0]]
    elif sl is None:
        out = every
    elif sl[2] == "contiguous":
        out = every[_slice_rows(r, step, None, None, len(fs), b=len(every))]
    else:
        doc, table, _ = _joined(r, step, fs, [], None)  # the columns counting each row's tokens
        out = every[_slice_rows(r, step, doc, table, len(fs))]
    if _sorted and getattr(r, "_by_id", False):
        o = idcol.order(out)
        out = out if o is None else out[o]
    return out


def shard(r: Any, step: int, rank: Any, columns: list[str] | None, layout: str | None) -> Any:
    """The batch rank ``rank`` appended as its shard of ``step``."""
    fs = files(r, step)
    if type(rank) is not int or not 0 <= rank < len(fs) or len(fs) == 1 and r._listing.shards.get(step) is None:
        n = r._listing.shards.get(step)
        raise StepNotFoundError(f"step {step} of dump {r.path} split {r.split!r} has no shard of rank {rank!r}: "
                                + (f"it was written by {n} ranks (0..{n - 1})" if n else "it is one whole step file"),
                                step=step)
    doc, table, where = _part(r, step, fs, rank, columns, layout)
    return decode(doc, table, where, columns, layout)


def column(r: Any, step: int, name: str) -> Any:
    """``Reader.column``'s value of one step read through the shards (or a slice)."""
    doc, table, where = logical(r, step, [name], None)
    batch = decode(doc, table, where, [name], None)
    if isinstance(batch, list | tuple):
        return [None if e is None else e.get(name) for e in batch]
    return containers.unwrap(batch)[0][name] if "wrapper" in doc["batch"] else batch[name]


def meta(r: Any, step: int) -> dict:
    """The step metadata of what ``r.read(step)`` returns: a shard's own ``meta`` when it reads the shard
    as dumped (M == N), else the shards' metas merged as ``format.shards.join`` merges them (docs/FORMAT.md
    3.12: a key whose values differ between the ranks becomes the list of their values in rank order)."""
    fs = files(r, step)
    sl = r._slice
    if len(fs) == 1 or sl is not None and sl[2] == "contiguous" and len(fs) == sl[1]:
        sf = r._open(step, check=False, f=fs[sl[0] if len(fs) > 1 else 0])
        return typed.step_meta(sf.doc, str(sf.path))
    docs = [r._open(step, check=False, f=f).doc for f in fs]
    metas = [typed.step_meta(d, str(f)) for d, f in zip(docs, fs)]
    return merge_meta(metas, Joiner(docs, [pa.table({})] * len(fs), list(range(len(fs))), step), "step meta",
                      strict=False)


def ranks(r: Any, step: int) -> list[int] | None:
    """The rank that wrote each row of ``r.read(step)`` (None for a step of one whole file): from the
    shards' footers, or for a reader of one rank's slice the ``rank`` column of the rows it takes."""
    if r._lone is not None or step not in r._listing.shards:
        return None
    if r._slice is None:
        rows = [r._open(step, check=False, f=f).pf.metadata.num_rows for f in files(r, step)]  # footers, guarded
        return [k for k, n in enumerate(rows) for _ in range(n)]
    _, table, _ = logical(r, step, None, None)
    col = table.column(shards.RANK_COLUMN) if shards.RANK_COLUMN in table.column_names else None
    return None if col is None else col.to_pylist()
