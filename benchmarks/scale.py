"""Scale of a long run (issue 14): a split of many small steps on local disk. Opening it and
listing its steps (``trajstore.Reader(path)``), ``Reader.steps``, ``Reader.column("rewards")`` over
every step, ``describe`` (what ``trajstore info`` prints) and the Recorder's ``max_keep`` rotation.

The fixture is built fast: one step is written by ``trajstore.Writer``, the others are clones of
its file (``clone``): the same Parquet table with the step number in its trajstore metadata
changed, committed under the step's name with its checksum in ``<dump>/_trajstore/<split>/``, so
every clone is a valid step of the dump (``trajstore verify`` passes)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

import trajstore
from trajstore.inspection.describe import describe
from trajstore.store import checksums, listing, paths


def small_batch(B: int = 8, T: int = 16, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 32000, (B, T), generator=g),
            "attention_mask": torch.ones(B, T, dtype=torch.int64),
            "rewards": torch.randn(B, generator=g)}


def clone(dump: Path, steps, split: str = "train", B: int = 8, T: int = 16) -> None:
    """A dump at ``dump`` holding ``steps`` (the same small batch each): one written by the Writer,
    the rest its file with the step number rewritten, each with its checksum."""
    steps = sorted(steps)
    with trajstore.Writer(dump, split) as w:
        w.append(steps[0], small_batch(B, T))
    d = dump / split
    src = d / paths.step_name(steps[0])
    table = pq.read_table(src)
    meta = dict(table.schema.metadata)
    doc = json.loads(meta[b"trajstore"])
    side = paths.side_dir(d)
    for s in steps[1:]:
        doc["step"] = s
        meta[b"trajstore"] = json.dumps(doc).encode()
        f = d / paths.step_name(s)
        tmp = side / f".clone-{s}"
        pq.write_table(table.replace_schema_metadata(meta), tmp, compression="zstd", write_page_checksum=True)
        checksums.sum_path(f).write_text(checksums.sum_line(checksums.file_sha256(tmp), f.name))
        os.replace(tmp, f)


def _t(fn, repeat: int = 3):
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def run(tmp: Path, n: int = 10_000, keep: int = 100) -> list[tuple[str, float]]:
    """Times (best of 3, seconds) over a dump of ``n`` steps built under ``tmp``."""
    dump = tmp / "scale"
    shutil.rmtree(dump, ignore_errors=True)
    t0 = time.perf_counter()
    clone(dump, range(n))
    print(f"# scale: built {n} steps (B=8, T=16) in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    t, r = _t(lambda: trajstore.Reader(dump))
    assert len(r.steps) == n
    rows.append((f"Reader(path): open + list {n} steps", t))
    rows.append((f"Reader.steps ({n})", _t(lambda: r.steps)[0]))
    t, col = _t(lambda: trajstore.Reader(dump).column("rewards"), repeat=1)
    assert len(col) == n
    rows.append((f"Reader.column('rewards') over {n} steps", t))
    t, d = _t(lambda: describe(dump), repeat=1)
    assert d["splits"]["train"]["steps"]["count"] == n
    rows.append((f"describe() / trajstore info over {n} steps", t))
    cfg = trajstore.DumpReplayConfig(dump=True, path=str(dump), max_keep=keep, resume=True)
    t0 = time.perf_counter()
    with trajstore.Recorder(cfg) as rec:
        rec.record(n, small_batch())
        rows.append((f"Recorder max_keep={keep}: first record after resume ({n} -> {keep} steps)",
                     time.perf_counter() - t0))
    assert len(listing.list_steps(dump / "train")) == keep
    shutil.rmtree(dump, ignore_errors=True)
    return rows


def run_s3(tmp: Path, n: int = 10_000, column_steps: int = 1_000) -> list[tuple[str, float]]:
    """The same listing on object storage: a local S3 server (moto's server mode on 127.0.0.1, the
    real S3 protocol over HTTP, in a process of its own so that it does not share the client's GIL;
    needs ``moto[server]``, and ``s3fs`` for the fsspec rows) holding the
    ``n`` step objects of ``clone``'s dump, listed by ``trajstore.Reader("s3://...")`` through pyarrow's
    S3 file system and through s3fs. Returns [] (skipped) where moto is not installed."""
    try:
        import boto3
        import moto.server  # noqa: F401
    except ImportError:
        print("# scale: object-store rows skipped (pip install 'moto[server]')", flush=True)
        return []
    import socket
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    old = {k: os.environ.get(k) for k in [*env, "TRAJSTORE_FS"]}
    os.environ.update(env)
    rows = []
    try:
        client = boto3.client("s3")
        client.create_bucket(Bucket="bench")
        dump = tmp / "scale-s3"
        shutil.rmtree(dump, ignore_errors=True)
        clone(dump, range(n))
        t0 = time.perf_counter()
        files = [f for f in dump.rglob("*") if f.is_file()]
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda f: client.put_object(Bucket="bench", Key=f"scale/{f.relative_to(dump).as_posix()}",
                                                    Body=f.read_bytes()), files))
        print(f"# scale: uploaded {len(files)} objects ({n} steps and their checksums) in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        shutil.rmtree(dump, ignore_errors=True)
        url = "s3://bench/scale"
        libs = ["pyarrow"]
        try:
            import s3fs  # noqa: F401
            libs.append("fsspec")
        except ImportError:
            pass
        for lib in libs:
            os.environ["TRAJSTORE_FS"] = lib
            t, r = _t(lambda: trajstore.Reader(url))
            assert len(r.steps) == n
            rows.append((f"S3 ({lib}): Reader(url): open + list {n} steps", t))
            some = r.steps[:column_steps]
            for workers in (1, 8):
                t, col = _t(lambda: trajstore.Reader(url).column("rewards", some, workers=workers), repeat=1)
                assert len(col) == len(some)
                rows.append((f"S3 ({lib}): Reader.column('rewards') over {len(some)} steps, workers={workers}", t))
    finally:
        server.kill()
        server.wait()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return rows


if __name__ == "__main__":
    import sys
    import tempfile
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="trajstore-scale-"))
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
    what = sys.argv[3] if len(sys.argv) > 3 else "local,s3"
    rows = (run(root, n) if "local" in what else []) + (run_s3(root, n) if "s3" in what else [])
    for name, s in rows:
        print(f"| {name} | {s * 1e3:.1f} ms |", flush=True)
