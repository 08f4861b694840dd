"""One memory budget everywhere (issue 27, item 5): ``Reader(verify=True)`` and ``verify --deep`` hash a
step file in bounded chunks instead of holding it whole; the viewer's column reads (its pages and
``view --export``) open each step file as every reader does (its description checked against its
columns, the decode budget before pyarrow decompresses); an index segment is hashed before it is held,
and no read of a dump's file asks for its cap (16 GiB + 1) up front, so a healthy index is used under
``ulimit -v``. The memory cases run in one child process under ``RLIMIT_AS`` and report its peak RSS
growth (``VmHWM``, reset before each case) per case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

import trajstore
from trajstore.errors import FormatError
from trajstore.format import limits
from trajstore.store import checksums, index, paths

CAP = 3 << 30  # the child's address space: below the default decode budget (16 GiB)
SPARSE = 256 << 20  # a step file or segment of this many bytes, all holes
GROWTH = 96 << 20  # what a refused or bounded read may add to the child's peak RSS

_CHILD = textwrap.dedent("""
    import json, logging, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
    import pandas, torch  # loaded before the first peak
    import trajstore
    import trajstore.read.reader
    from trajstore.format import limits
    from trajstore.inspection.verify import verify

    def peak():
        return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024

    ignored = []
    class Catch(logging.Handler):
        def emit(self, rec):
            ignored.append(rec.getMessage())
    logging.getLogger("trajstore.reader").addHandler(Catch())

    def view(d):
        from trajstore.view.pages import View
        return View(d)

    root = sys.argv[1]
    CASES = {{
        "verify_read": lambda: trajstore.Reader(root + "/sparse", verify=True)[0],
        "verify_deep": lambda: verify(root + "/sparse", deep=True).damaged,
        "segment_damaged": lambda: trajstore.Reader(root + "/badseg").column("rewards"),
        "segment_healthy": lambda: trajstore.Reader(root + "/goodseg").column("rewards"),
        "view_step": lambda: view(root + "/bomb").step(None, 0),
        "view_traj": lambda: view(root + "/bomb").traj(None, 0, 0),
    }}
    for name, fn in CASES.items():
        limits.MAX_DECODED_BYTES = (8 << 20) if name.startswith("view") else limits.MAX_DECODED_BYTES
        del ignored[:]
        try:
            open("/proc/self/clear_refs", "w").write("5")  # VmHWM starts again from VmRSS (Linux >= 4.0)
        except OSError:
            pass
        base = peak()
        try:
            got = fn()
            res = ["ok", str(got)[:300]]
        except trajstore.TrajstoreError as e:
            res = [type(e).__name__, str(e)]
        except BaseException as e:  # MemoryError, ArrowMemoryError, AttributeError...: what must not happen
            res = ["raw " + type(e).__name__, str(e)[:300]]
        print(json.dumps({{name: res + [peak() - base, list(ignored)]}}), flush=True)
""")


def _sign(f: Path) -> None:
    checksums.sum_path(f).write_text(checksums.sum_line(checksums.file_sha256(f), f.name))


def _batch(T: int = 4) -> dict:
    return {"input_ids": torch.zeros(2, T, dtype=torch.int32), "attention_mask": torch.ones(2, T, dtype=torch.bool),
            "rewards": torch.tensor([1.0, 2.0])}


def _dump(d: Path, T: int = 4) -> Path:
    with trajstore.Writer(d) as w:
        w.append(0, _batch(T))
    return d / "train" / paths.step_name(0)


@pytest.fixture(scope="module")
def child(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("budget")
    f = _dump(root / "sparse")
    with open(f, "r+b") as fh:  # the step becomes SPARSE bytes of holes, its checksum recorded
        fh.truncate(SPARSE)
    _sign(f)
    _dump(root / "badseg")
    seg = next(p for p in index.dirs(root / "badseg" / "train")[0].iterdir() if index.SEGMENT_RE.match(p.name))
    with open(seg, "r+b") as fh:  # a damaged segment of SPARSE bytes: its recorded checksum no longer fits
        fh.truncate(SPARSE)
    _dump(root / "goodseg")
    _dump(root / "bomb", T=8 << 20)  # 2 x 8 Mi int32 zeros: 64 MiB once decoded, a few KB in the file
    env = {**os.environ, "ARROW_DEFAULT_MEMORY_POOL": "system"}  # freed buffers go back: each case's peak is its own
    p = subprocess.run([sys.executable, "-c", _CHILD.format(cap=CAP), str(root)], capture_output=True, text=True,
                       timeout=300, env=env)
    got = {"root": root, "stderr": p.stderr[-3000:]}  # one line per case: a case that kills the child has none
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            got.update(json.loads(line))
    return got


def _case(child: dict, name: str) -> list:
    assert name in child, f"the child process died before case {name!r}:\n{child['stderr']}"
    return child[name]


def test_verified_read_hashes_in_chunks(child):
    kind, msg, growth, _ = _case(child, "verify_read")
    assert kind == "FormatError" and paths.step_name(0) in msg, child["verify_read"]  # hashed, then not Parquet
    assert growth < GROWTH, f"peak RSS grew by {growth >> 20} MiB reading a {SPARSE >> 20} MiB step"


def test_verify_deep_hashes_in_chunks(child):
    kind, damaged, growth, _ = _case(child, "verify_deep")
    assert kind == "ok" and "(\'train\', 0)" in damaged, child["verify_deep"]
    assert growth < GROWTH, f"peak RSS grew by {growth >> 20} MiB"


def test_damaged_segment_is_not_held_before_its_checksum(child):
    kind, got, growth, ignored = _case(child, "segment_damaged")
    assert kind == "ok" and "1., 2." in got.replace("1.0", "1.").replace("2.0", "2."), child["segment_damaged"]
    assert any("SHA-256" in m and "read from their files" in m for m in ignored), ignored  # the step file instead
    assert growth < GROWTH, f"peak RSS grew by {growth >> 20} MiB for a {SPARSE >> 20} MiB damaged segment"


def test_healthy_segment_is_used_under_an_address_space_limit(child):
    """The segment read asked for its cap (the decode budget + 1 = 16 GiB) up front: under ``ulimit -v``
    that failed and every healthy index was ignored."""
    kind, _, _, ignored = _case(child, "segment_healthy")
    assert kind == "ok" and ignored == [], child["segment_healthy"]


@pytest.mark.parametrize("case", ["view_step", "view_traj"])
def test_viewer_reads_under_the_budget(child, case):
    kind, msg, growth, _ = _case(child, case)
    assert kind == "FormatError" and limits.KNOB in msg and paths.step_name(0) in msg, child[case]
    assert growth < 48 << 20, f"peak RSS grew by {growth >> 20} MiB"


def test_export_reads_under_the_budget(child, monkeypatch, tmp_path):
    pytest.importorskip("plotly")
    from trajstore.view.export import export
    from trajstore.view.pages import View

    monkeypatch.setattr(limits, "MAX_DECODED_BYTES", 8 << 20)
    with pytest.raises(FormatError, match=limits.KNOB):
        export(View(child["root"] / "bomb"), tmp_path / "e.html")


def _forge(d: Path, edit) -> Path:
    f = _dump(d)
    t = pq.read_table(f)
    doc = json.loads(t.schema.metadata[b"trajstore"])
    edit(doc["batch"])
    pq.write_table(t.replace_schema_metadata({**t.schema.metadata, b"trajstore": json.dumps(doc).encode()}), f)
    _sign(f)
    return f


def _keys(b: dict) -> dict:
    return dict(b["keys"])


FORGERIES = {
    "token column points at a scalar column": lambda b: _keys(b)["input_ids"].update(col="rewards"),
    "token column points at no column": lambda b: _keys(b)["attention_mask"].update(col="nowhere"),
    "scalar points at a token column": lambda b: _keys(b)["rewards"].update(col="input_ids"),
    "length column missing": lambda b: b.update(len_col="nowhere"),
    "more rows than the file": lambda b: b.update(B=5),
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_viewer_refuses_what_the_reader_refuses(tmp_path, name):
    """A forged description is a FormatError on every viewer path, as on ``Reader.read`` (before: an
    AttributeError in store/digest.py, or the forged step served)."""
    pytest.importorskip("plotly")
    from trajstore.view.pages import View

    f = _forge(tmp_path / "d", FORGERIES[name])
    with pytest.raises(FormatError):
        trajstore.Reader(tmp_path / "d")[0]
    v = View(tmp_path / "d")
    for call in (lambda: v.step(None, 0), lambda: v.traj(None, 0, 0)):
        with pytest.raises(FormatError) as e:
            call()
        assert str(f) in str(e.value)
