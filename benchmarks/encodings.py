"""Parquet encodings for the columns that dominate a dump: token ids and log-probs (float32, and
bfloat16 as today's uint16 bits or widened to float32 as format version 3 stores it).

Each option writes the step's flat values (as the writer stores them: the leaf values of a
``large_list`` column, one row per trajectory, 8 row groups) to memory with zstd, then reads
them back on one thread (for bfloat16, and back to its uint16 bits, as trajstore decodes it); we
report bytes, write and read time. ``steps`` writes and reads whole steps with trajstore: bfloat16
log-probs stored as bits or widened, with the portable and the compact encodings.
``trajstore.format.file.parquet.parquet_options`` follows the result (see RESULTS.md).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import trajstore
from trajstore.format import dtypes as dt

OPTIONS = {
    "plain": {"use_dictionary": False},
    "dictionary": {"use_dictionary": True},
    "byte_stream_split": {"use_dictionary": False, "use_byte_stream_split": True},
    "delta_binary_packed": {"use_dictionary": False, "column_encoding": "DELTA_BINARY_PACKED"},
}


def _table(values: np.ndarray, offsets: np.ndarray) -> pa.Table:
    arr = pa.LargeListArray.from_arrays(pa.array(offsets.astype(np.int64)), pa.array(values))
    return pa.table({"x": arr})


def measure(name: str, values: np.ndarray, offsets: np.ndarray, levels=(1, 3, 9), repeat: int = 2,
            decode=None, only=None) -> list[dict]:
    """``decode(values)``: what a read does after Parquet (bfloat16 narrowed back to its bits);
    ``only``: the encodings to measure (default all)."""
    t = _table(values, offsets)
    rg = max(1, -(-t.num_rows // 8))
    out = []
    for enc, kw in OPTIONS.items():
        if enc == "delta_binary_packed" and values.dtype.kind != "i" or only and enc not in only:
            continue
        for lvl in levels:
            best_w = best_r = float("inf")
            for _ in range(repeat):
                sink = pa.BufferOutputStream()
                t0 = time.perf_counter()
                pq.write_table(t, sink, compression="zstd", compression_level=lvl, row_group_size=rg, **kw)
                best_w = min(best_w, time.perf_counter() - t0)
                buf = sink.getvalue()
                t0 = time.perf_counter()
                got = pq.ParquetFile(pa.BufferReader(buf)).read(use_threads=False)  # one thread
                if decode is not None:
                    decode(got.column(0).chunk(0).values.to_numpy())
                best_r = min(best_r, time.perf_counter() - t0)
            out.append({"column": name, "encoding": enc, "zstd": lvl, "bytes": buf.size,
                        "bytes_per_value": buf.size / len(values), "write_s": best_w, "read_s": best_r,
                        "write_MBps": values.nbytes / best_w / 1e6, "read_MBps": values.nbytes / best_r / 1e6,
                        "read_Mvalues_per_s": len(values) / best_r / 1e6})
    return out


def run(padded: dict) -> list[dict]:
    m = padded["attention_mask"]
    lens = m.sum(1).numpy().astype(np.int64)
    off = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=off[1:])
    ids = padded["input_ids"][m].numpy()
    lp = padded["old_logprobs"][m].numpy()
    rows = measure("input_ids (int64)", ids, off)
    rows += measure("input_ids (as int32)", ids.astype(np.int32), off, levels=(3,))
    rows += measure("old_logprobs (float32)", lp, off)
    bits = padded["old_logprobs"].to(torch.bfloat16)[m].view(torch.int16).numpy().view(np.uint16)
    three = ("plain", "dictionary", "byte_stream_split")
    rows += measure("logprobs bf16 as uint16 bits (v2)", bits, off, levels=(3,), only=three)
    rows += measure("logprobs bf16 widened to float32 (v3)", dt.widen(bits, "bfloat16"), off, levels=(3,),
                    only=three, decode=lambda v: dt.narrow(v, "bfloat16"))
    return rows


@contextmanager
def bf16_as_bits():
    """Write as trajstore did before format version 3: half-precision values as their raw bits."""
    saved = dt.HALF
    dt.HALF = ()
    try:
        yield
    finally:
        dt.HALF = saved


def steps(padded: dict, repeat: int = 5) -> list[dict]:
    """One realistic step, its log-probs float32 (the workload) or bfloat16, written by trajstore
    with encodings portable / compact (bfloat16 stored as bits, as before format version 3, or
    widened): file bytes, and the median time of reading the whole step and of reading the
    log-probs alone (padded, to a bfloat16 tensor); with CUDA, of replaying the step packed to the
    GPU (``read(step, layout="packed", device="cuda")``, synchronized)."""
    half = {**padded, "old_logprobs": padded["old_logprobs"].to(torch.bfloat16)}
    out = []
    with tempfile.TemporaryDirectory(prefix="trajstore-enc-") as tmp:
        for store in ("float32 (workload)", "bits (v2)", "widened (v3)"):
            batch = padded if store.startswith("float32") else half
            for enc in ("portable", "compact"):
                d = Path(tmp) / f"{store[:4]}-{enc}"
                with (bf16_as_bits() if store.startswith("bits") else _nothing()):
                    with trajstore.Writer(d, encodings=enc) as w:
                        w.append(0, batch)
                    r = trajstore.Reader(d)
                    f = d / "train" / "step_00000000.parquet"
                    col = pq.ParquetFile(f).metadata.row_group(0)
                    j = [col.column(i).path_in_schema for i in range(col.num_columns)].index("old_logprobs.list.element")
                    lp_bytes = sum(pq.ParquetFile(f).metadata.row_group(g).column(j).total_compressed_size
                                   for g in range(pq.ParquetFile(f).metadata.num_row_groups))
                    whole, lp = [], []
                    r.read(0)  # warm: the page cache, Arrow's allocator and thread pool
                    for _ in range(repeat):
                        t0 = time.perf_counter()
                        r.read(0)
                        whole.append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        x = r.read(0, columns=["old_logprobs", "attention_mask"])["old_logprobs"]
                        lp.append(time.perf_counter() - t0)
                    assert x.dtype == batch["old_logprobs"].dtype and torch.equal(x, batch["old_logprobs"])
                    gpu = _replay(r, repeat) if torch.cuda.is_available() else None
                out.append({"logprobs": store, "encodings": enc, "file_bytes": f.stat().st_size, "logprobs_bytes": lp_bytes,
                            "read_step_s": statistics.median(whole), "read_logprobs_s": statistics.median(lp),
                            "replay_cuda_s": gpu})
    return out


def _replay(r, repeat: int) -> float:
    """Median time of one step read packed onto the GPU, the copies finished."""
    r.read(0, layout="packed", device="cuda")
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        r.read(0, layout="packed", device="cuda")
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


@contextmanager
def _nothing():
    yield
