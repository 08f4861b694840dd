"""What the per-step SHA-256 and the Parquet page checksums (CRC32, written and verified by default)
cost, next to encoding + zstd writing and next to reading.

    python tests/stress/hash_cost.py [--batch 64] [--tokens 8192] [--repeat 5]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import pyarrow.parquet as pq
import torch

import trajstore
from trajstore import schema
from trajstore.format.file.parquet import parquet_options
from trajstore.store import checksums, paths


def _best(fn, n):
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    B, T = a.batch, a.tokens
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    batch = {"input_ids": torch.randint(0, 150000, (B, T), generator=g).masked_fill(~mask, 0),
             "attention_mask": mask, "logprobs": (-torch.rand(B, T, generator=g) * 5).masked_fill(~mask, 0),
             "old_logprobs": (-torch.rand(B, T, generator=g) * 5).masked_fill(~mask, 0),
             "rewards": torch.randn(B, generator=g)}
    root = Path(tempfile.mkdtemp())
    try:
        i = [0]

        def write():
            with trajstore.Writer(root / "d", overwrite=True) as w:
                w.append(i[0], batch)
            i[0] += 1

        t_write = _best(write, a.repeat)
        f = root / "d" / "train" / paths.step_name(0)
        data = f.read_bytes()
        t_sha = _best(lambda: checksums.file_sha256(f), a.repeat)
        t_crc = _best(lambda: zlib.crc32(data), a.repeat)
        t_blake = _best(lambda: hashlib.blake2b(data).digest(), a.repeat)
        t_read = t_readv = float("inf")
        for _ in range(a.repeat):  # interleaved, best of: the machine may be shared
            t_read = min(t_read, _best(lambda: trajstore.Reader(root / "d", verify=False)[0], 3))
            t_readv = min(t_readv, _best(lambda: trajstore.Reader(root / "d", verify=True)[0], 3))
        mb = len(data) / 1e6
        print(f"step: B={B} T={T}, {sum(lengths.tolist())} tokens, file {mb:.1f} MB")
        print(f"append+flush (encode, zstd, fsync, commit incl. sha256): {t_write * 1e3:.1f} ms")
        print(f"sha256 of the file: {t_sha * 1e3:.2f} ms ({t_sha / t_write:.1%} of the write); "
              f"crc32 {t_crc * 1e3:.2f} ms, blake2b {t_blake * 1e3:.2f} ms")
        print(f"read verify=False: {t_read * 1e3:.1f} ms; verify=True: {t_readv * 1e3:.1f} ms "
              f"(+{(t_readv - t_read) / t_read:.1%})")
        page_checksums(root, schema.encode(batch, step=0, split="train"), a.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def page_checksums(root: Path, table, repeat: int) -> None:
    """The same step table written with and without page checksums, and read (single-threaded, as
    the decode of one row group is) with and without verifying them."""
    files, t_w = {}, {}
    for crc in (False, True):
        files[crc] = root / f"crc-{crc}.parquet"
        opts = {**parquet_options(table), "write_page_checksum": crc}
        t_w[crc] = _best(lambda: pq.write_table(table, files[crc], **opts), repeat)
    t_r = {k: float("inf") for k in ("off", "written", "verified")}
    for _ in range(repeat):  # interleaved
        for k, f, v in (("off", files[False], False), ("written", files[True], False), ("verified", files[True], True)):
            t_r[k] = min(t_r[k], _best(lambda: pq.read_table(f, use_threads=False, page_checksum_verification=v), 3))
    extra = files[True].stat().st_size - files[False].stat().st_size
    print(f"page checksums: +{extra} bytes; write {t_w[False] * 1e3:.1f} -> {t_w[True] * 1e3:.1f} ms; "
          f"read (one thread) {t_r['off'] * 1e3:.1f} ms without, {t_r['written'] * 1e3:.1f} ms written but "
          f"not checked, {t_r['verified'] * 1e3:.1f} ms verified (+{(t_r['verified'] - t_r['off']) / t_r['off']:.1%})")


if __name__ == "__main__":
    main()
