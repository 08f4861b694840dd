"""The least replay that stages steps through pinned host memory (issue 23; benchmarks/RESULTS.md, fifteenth
round): ``k`` threads, each reading a whole step with pyarrow (``read_table`` of the columns a packed replay
reads, each page's CRC32 verified as every trajstore read verifies it), copying each column chunk's values
into a pinned buffer of its own and sending that buffer to the GPU in one copy, then waiting for it; at most
``k`` steps at once, in order, as ``Reader.iter(prefetch=k)`` holds them. Nothing is converted (ids stay int32,
masks bits), no tensor is built, no offsets are sent: what is left is the work every replay that stages through
pinned memory does (the read, one host copy and one device copy a step), done one after the other, measured beside
the decoder ceiling (``replay_cpu.ceiling``, 8 steps at once, no copy at all). It is a reference, not a bound: a
replay that overlaps the copies with the decode can pass it (trajstore's, at prefetch 4). Without CUDA the
buffers are plain memory and nothing is sent (a test of the staging)."""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch


def columns(f: Path) -> list[str]:
    """The columns a packed replay reads (the decoder ceiling's): every one but ``attention_mask``."""
    return [c for c in pq.ParquetFile(f).schema_arrow.names if c != "attention_mask"]


def values(table: pa.Table) -> list[tuple[str, np.ndarray]]:
    """``(column, bytes)`` of each chunk's values as stored: a list column's values (its rows' range), a flat
    column's data buffer; bools as their bitmap's bytes."""
    out = []
    for name in table.column_names:
        for c in table.column(name).chunks:
            v = c
            if pa.types.is_large_list(c.type):
                o = np.frombuffer(c.buffers()[1], np.int64, count=len(c) + 1, offset=c.offset * 8)
                v = c.values.slice(int(o[0]), int(o[-1] - o[0]))
            if pa.types.is_boolean(v.type):
                lo, hi = v.offset // 8, (v.offset + len(v) + 7) // 8
            else:
                w = v.type.bit_width // 8
                lo, hi = v.offset * w, (v.offset + len(v)) * w
            out.append((name, np.frombuffer(v.buffers()[1], np.uint8)[lo:hi]))
    return out


def read(f: Path, cols: list[str], pool: pa.MemoryPool | None = None) -> pa.Table:
    """Step file ``f``'s columns ``cols``, each page's CRC32 verified: ``read_table``, or with ``pool`` Arrow's dataset
    reader decoding into that memory pool (``benchmarks/pinned_decode.py``; ``read_table`` takes none)."""
    if pool is None:
        return pq.read_table(f, columns=cols, use_threads=False, pre_buffer=False, page_checksum_verification=True)
    import pyarrow.dataset as ds

    fmt = ds.ParquetFileFormat(pre_buffer=False, page_checksum_verification=True)
    return ds.dataset(str(f), format=fmt).to_table(columns=cols, use_threads=False, memory_pool=pool)


def stage(f: Path, cols: list[str], take: Any, pool: pa.MemoryPool | None = None
          ) -> tuple[np.ndarray, list[tuple[str, int, int]]]:
    """Read step file ``f`` (into ``pool``: ``read``) and copy its values into ``take(nbytes)``, a buffer of at least
    that many bytes: the buffer, and ``(column, start, stop)`` of each chunk's bytes there."""
    parts = values(read(f, cols, pool))
    buf = take(sum(len(b) for _, b in parts))
    where, p = [], 0
    for name, b in parts:
        buf[p:p + len(b)] = b
        where.append((name, p, p + len(b)))
        p += len(b)
    return buf, where


def gbps(files: list[Path], raw: int, k: int, device: Any = None) -> float:
    """GB/s of tensor bytes (``raw`` a step) of one pass over ``files`` on ``k`` threads (see the module doc)."""
    cols = columns(files[0])
    cuda = device is not None and torch.device(device).type == "cuda"
    local = threading.local()  # each thread's pinned buffer (reused, grown where a step needs more) and stream

    def take(n: int) -> np.ndarray:
        buf = getattr(local, "buf", None)
        if buf is None or buf.numel() < n:
            buf = local.buf = torch.empty(max(n + n // 4, 1), dtype=torch.uint8, pin_memory=cuda)
        return buf.numpy()

    def one(f: Path) -> None:
        _, where = stage(f, cols, take)
        if cuda:
            n = where[-1][2] if where else 0
            s = getattr(local, "stream", None) or torch.cuda.Stream(device)
            local.stream = s
            with torch.cuda.stream(s):
                g = torch.empty(n, dtype=torch.uint8, device=device)
                g.copy_(local.buf[:n], non_blocking=True)
            s.synchronize()

    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    in_order(one, files, k)
    return len(files) * raw / (time.perf_counter() - t0) / 1e9


def in_order(one: Any, files: list[Path], k: int) -> None:
    """``one(f)`` of each file on ``k`` threads, at most ``k`` steps at once, taken in order."""
    with ThreadPoolExecutor(k) as ex:
        held: deque = deque()
        for f in files:
            if len(held) == k:
                held.popleft().result()
            held.append(ex.submit(one, f))
        for fut in held:
            fut.result()


def read_cpu(f: Path, cols: list[str]) -> dict[str, np.ndarray]:
    """The least read of a step to host memory in a packed layout: ``read_table`` (page checksums verified),
    then each column's values joined into one fresh array on this thread (``np.concatenate``: ids widened to
    int64 as the spec gives them, bools unpacked from their bitmaps), no offsets or spec: the floor under
    ``Reader.read(step, layout="packed")`` that pyarrow's read alone is not."""
    table = pq.read_table(f, columns=cols, use_threads=True, pre_buffer=False, page_checksum_verification=True)
    out = {}
    for name in table.column_names:
        col = table.column(name)
        kind = (table.schema.field(name).metadata or {}).get(b"trajstore.dtype", b"")
        chunks = [c.flatten() if pa.types.is_large_list(c.type) else c for c in col.chunks]
        parts = [np.unpackbits(np.frombuffer(v.buffers()[1], np.uint8), count=v.offset + len(v), bitorder="little")
                 [v.offset:].view(np.bool_) if pa.types.is_boolean(v.type) else v.to_numpy() for v in chunks]
        want = np.int64 if kind == b"int64" else None
        out[name] = np.concatenate(parts, dtype=want) if parts else np.empty(0, want)
    return out
