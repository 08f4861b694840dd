"""The smaller holes of issue 27 (item 7), each a trajstore error or the right answer now: a forged
container ``wrapper``, shard footers that contradict their names under the default ``verify``, a
stride-0 ``expand`` whose copy cannot be allocated, an empty ``[0, 10**9]`` batch, a 60 MB footer
string given to DuckDB, field names in plotly titles, a ``_trajstore`` folder in an import's source.
The memory cases run in one child process under ``RLIMIT_AS`` (``_child``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

import trajstore
from trajstore.errors import FormatError
from trajstore.inspection.importers import import_dump
from trajstore.inspection.verify import verify
from trajstore.store import checksums, paths

from _dumps import run as run_cli


def _resign(f: Path, doc: dict | None = None, extra: dict | None = None) -> None:
    """Rewrite step file ``f`` with description ``doc`` and footer key-values ``extra``, and record its checksum."""
    t = pq.read_table(f)
    md = dict(t.schema.metadata)
    if doc is not None:
        md[b"trajstore"] = json.dumps(doc).encode()
    md.update(extra or {})
    pq.write_table(t.replace_schema_metadata(md), f, compression="zstd")
    checksums.sum_path(f).write_text(checksums.sum_line(checksums.file_sha256(f), f.name))


def _doc(f: Path) -> dict:
    return json.loads(pq.ParquetFile(f).schema_arrow.metadata[b"trajstore"])


# ----------------------------------------------------------------------------- forged wrapper
def test_forged_wrapper_is_a_format_error(tmp_path):
    """A DataProto wrapper with no TensorDict that lists no field would rebuild an empty batch: every
    read (``column`` included) refuses the file instead of a KeyError or a batch without its fields."""
    with trajstore.Writer(tmp_path) as w:
        w.append(0, {"x": torch.zeros(2, 3), "r": torch.tensor([1.0, 2.0])})
    f = tmp_path / "train" / paths.step_name(0)
    doc = _doc(f)
    doc["batch"]["wrapper"] = {"type": "dataproto", "td": None, "non_tensor_keys": [], "meta_info": {}}
    _resign(f, doc)
    r = trajstore.Reader(tmp_path)
    for call in (lambda: r.column("x"), lambda: r[0], lambda: r.read(0, columns=["x"])):
        with pytest.raises(FormatError, match="non_tensor_keys") as e:
            call()
        assert str(f) in str(e.value)


# ----------------------------------------------------------------------------- shard names
def _two_shards(root: Path) -> tuple[Path, Path]:
    for rank in range(2):
        with trajstore.Writer(root, rank=rank, world_size=2) as w:
            for s in (0, 1):
                w.append(s, {"x": torch.full((2, 3), float(rank))})
    d = root / "train"
    return d / paths.shard_name(1, 0, 2), d / paths.shard_name(1, 1, 2)


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name("swap.tmp")
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    for f in (a, b):  # checksums recorded for the new names: only the footers tell
        checksums.sum_path(f).write_text(checksums.sum_line(checksums.file_sha256(f), f.name))


def test_default_verify_catches_shards_swapped(tmp_path):
    a, b = _two_shards(tmp_path)
    _swap(a, b)
    rep = verify(tmp_path)
    assert not rep.ok and list(rep.damaged) == [("train", 1)], rep.summary()
    assert "its name says rank 0 of 2" in rep.damaged[("train", 1)]
    p = run_cli("verify", tmp_path, check_rc=1)
    assert "DAMAGED train/1" in p.stdout + p.stderr
    with pytest.raises(FormatError, match="its name says"):
        trajstore.Reader(tmp_path)[1]


def test_default_verify_catches_a_shard_renamed_whole(tmp_path):
    a, b = _two_shards(tmp_path)
    whole = a.parent / paths.step_name(2)
    shutil.copyfile(a, whole)
    doc = _doc(whole)
    doc["step"] = 2
    _resign(whole, doc)  # step 2: rank 0's half of a step, named as a whole step file
    rep = verify(tmp_path)
    assert list(rep.damaged) == [("train", 2)] and "says a whole step" in rep.damaged[("train", 2)], rep.summary()
    assert verify(tmp_path, deep=True).damaged.keys() == {("train", 2)}


# ----------------------------------------------------------------------------- memory, in a child
CAP = 3 << 30

_CHILD = textwrap.dedent("""
    import json, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
    import duckdb, torch
    import trajstore

    out = {{}}
    def case(name, fn):
        try:
            out[name] = ["ok", fn()]
        except trajstore.TrajstoreError as e:
            out[name] = [type(e).__name__, str(e)]
        except BaseException as e:  # MemoryError, torch's RuntimeError...: what must not happen
            out[name] = ["raw " + type(e).__name__, str(e)[:300]]

    root = sys.argv[1]
    def expand():
        with trajstore.Writer(root + "/expand") as w:
            w.append(0, {{"x": torch.zeros(1, 1).expand(2, 5 * 10**9 // 4)}})  # 10 GB once copied
    case("expand", expand)

    def empty():
        b = {{"input_ids": torch.zeros(0, 10**9, dtype=torch.int64),
              "attention_mask": torch.zeros(0, 10**9, dtype=torch.int64), "x": torch.zeros(0, 10**9)}}
        with trajstore.Writer(root + "/empty") as w:
            w.append(0, b)
        r = trajstore.Reader(root + "/empty")
        got = r[0]
        return [list(got[k].shape) for k in b] + [list(r.read(0, layout="packed")["input_ids"].shape)]
    case("empty", empty)

    case("sql", lambda: trajstore.Reader(root + "/footer").duckdb().execute("SELECT count(*) FROM train").fetchall())
    print(json.dumps(out), flush=True)
""")


def test_memory_cases_under_rlimit(tmp_path):
    """Under a 3 GiB address space: a 10 GB stride-0 ``expand`` is a BatchError naming the field (not
    torch's allocator error, and the process lives on); an empty ``[0, 10**9]`` batch is written and
    read back as such without a ``[10**9]`` allocation; a step file with a 60 MB footer string is a
    FormatError from ``Reader.duckdb()`` instead of an abort inside DuckDB."""
    with trajstore.Writer(tmp_path / "footer") as w:
        w.append(0, {"x": torch.zeros(2, 3)})
    _resign(tmp_path / "footer" / "train" / paths.step_name(0), extra={b"pad": b"x" * (60 << 20)})
    p = subprocess.run([sys.executable, "-c", _CHILD.format(cap=CAP), str(tmp_path)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    kind, msg = got["expand"]
    assert kind == "BatchError" and "field 'x'" in msg and "expand" in msg, got["expand"]
    assert got["empty"] == ["ok", [[0, 10**9]] * 3 + [[0]]], got["empty"]
    kind, msg = got["sql"]
    assert kind == "FormatError" and "footer" in msg and paths.step_name(0) in msg, got["sql"]


# ----------------------------------------------------------------------------- plotly titles
JS = Path(trajstore.__file__).parent / "view" / "static" / "plotly_text.js"

_NODE = """
const fs = require("fs");
const calls = [];
globalThis.Plotly = {newPlot: (div, d, l, c) => calls.push([d, l]), react: (div, d, l, c) => calls.push([d, l]),
                     relayout: (div, l) => calls.push([null, l])};
eval(fs.readFileSync(process.argv[2], "utf8"));
const name = process.argv[3];
const layout = {title: {text: "reward (" + name + ")"}, xaxis: {title: {text: name}}, yaxis: {title: name},
                annotations: [{text: name}], legend: {title: {text: name}}};
Plotly.newPlot("d", [{x: [1], name: name}], layout, {});
Plotly.react("d", [{x: [1], name: name}], {title: name}, {});
Plotly.relayout("d", {"xaxis.title.text": name});
process.stdout.write(JSON.stringify({calls: calls, original: layout}));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page script")
def test_plotly_gets_field_names_as_text(tmp_path):
    name = '<a href="javascript:alert(1)">r</a><img src=x onerror=alert(2)>&amp;'
    script = tmp_path / "t.js"
    script.write_text(_NODE)
    p = subprocess.run(["node", str(script), str(JS), name], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    esc = name.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")  # what plotly draws as those characters
    (d1, l1), (d2, l2), (_, l3) = out["calls"]
    assert l1["title"]["text"] == f"reward ({esc})" and l1["xaxis"]["title"]["text"] == esc
    assert l1["yaxis"]["title"] == esc and l1["annotations"][0]["text"] == esc and l1["legend"]["title"]["text"] == esc
    assert d1[0]["name"] == esc and d2[0]["name"] == esc and l2["title"] == esc and l3["xaxis.title.text"] == esc
    assert out["original"]["xaxis"]["title"]["text"] == name  # the caller's objects are not changed
    assert "<" not in json.dumps([l1, l2, l3, d1, d2]).replace("\\u003c", "<").split("hovertemplate")[0]


def test_pages_and_export_load_the_text_guard(tmp_path):
    pytest.importorskip("starlette")
    pytest.importorskip("plotly")
    from trajstore.view.app import shell, static_files
    from trajstore.view.export import export
    from trajstore.view.pages import View

    page = shell("run", "t")
    assert page.index("plotly.min.js") < page.index("plotly_text.js") < page.index("view.js")
    assert static_files()["plotly_text.js"] == JS
    with trajstore.Writer(tmp_path / "d") as w:
        w.append(0, {"input_ids": torch.ones(2, 4, dtype=torch.int64),
                     "attention_mask": torch.ones(2, 4, dtype=torch.int64), "rewards": torch.tensor([1.0, 2.0])})
    html = export(View(tmp_path / "d"), tmp_path / "e.html").read_text()
    assert JS.read_text()[:200] in html and html.index("__trajstoreText") < html.index("trajstore view: builds")


# ----------------------------------------------------------------------------- import
def test_import_skips_a_trajstore_subfolder(tmp_path):
    """A source subfolder named ``_trajstore`` (the name a dump keeps its side files under) would be a
    split of that name: its files are skipped with the reason, the others are imported."""
    src = tmp_path / "src"
    for sub in ("train", "_trajstore"):
        (src / sub).mkdir(parents=True)
        torch.save({"x": torch.zeros(2, 3)}, src / sub / "step_1.pt")
    rep = import_dump(src, tmp_path / "out")
    assert [(i.split, i.step) for i in rep.imported] == [("train", 1)]
    assert len(rep.skipped) == 1 and rep.skipped[0].source.startswith("_trajstore")
    assert "_trajstore" in rep.skipped[0].reason and "reserved" in rep.skipped[0].reason
    assert trajstore.Reader(tmp_path / "out", "train").steps == [1]
    p = run_cli("import", src, tmp_path / "out2")
    assert "_trajstore" in p.stdout + p.stderr
