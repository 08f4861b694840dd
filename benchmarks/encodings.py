"""Parquet encodings for the two columns that dominate a dump: token ids and log-probs.

Each option writes the step's flat values (as the writer stores them: the leaf values of a
``large_list`` column, one row per trajectory, 8 row groups) to memory with zstd, then reads
them back on one thread; we report bytes, write and read time. ``trajstore.format.parquet.parquet_options`` follows
the result (see RESULTS.md).
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

OPTIONS = {
    "plain": {"use_dictionary": False},
    "dictionary": {"use_dictionary": True},
    "byte_stream_split": {"use_dictionary": False, "use_byte_stream_split": True},
    "delta_binary_packed": {"use_dictionary": False, "column_encoding": "DELTA_BINARY_PACKED"},
}


def _table(values: np.ndarray, offsets: np.ndarray) -> pa.Table:
    arr = pa.LargeListArray.from_arrays(pa.array(offsets.astype(np.int64)), pa.array(values))
    return pa.table({"x": arr})


def measure(name: str, values: np.ndarray, offsets: np.ndarray, levels=(1, 3, 9), repeat: int = 2) -> list[dict]:
    t = _table(values, offsets)
    rg = max(1, -(-t.num_rows // 8))
    out = []
    for enc, kw in OPTIONS.items():
        if enc == "delta_binary_packed" and values.dtype.kind != "i":
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
                pq.ParquetFile(pa.BufferReader(buf)).read(use_threads=False)  # one thread
                best_r = min(best_r, time.perf_counter() - t0)
            out.append({"column": name, "encoding": enc, "zstd": lvl, "bytes": buf.size,
                        "bytes_per_value": buf.size / len(values), "write_s": best_w, "read_s": best_r,
                        "write_MBps": values.nbytes / best_w / 1e6, "read_MBps": values.nbytes / best_r / 1e6})
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
    return rows
