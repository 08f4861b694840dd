"""The package's import graph follows docs/ARCHITECTURE.md: every import (top-level or inside a
function) points down the layers, writer and reader never reach each other, and there is no cycle.

Parsed with ``ast``, nothing is imported: an edge counts wherever it is written."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "trajstore"

# the layers, lowest first, each a folder (a "room") of trajstore/, or one of ROOT's files; a module may import
# only from layers below its own, or from its own layer where SAME_LAYER allows it (a room's modules among
# themselves, a front door on its room)
# the format's shared vocabulary at the top of format/: every format room may import these, they import no room
FORMAT_SHARED = ["spec", "dtypes", "limits", "values", "typed", "arrow", "numpy_view"]
LAYERS: list[tuple[str, list[str]]] = [
    ("base", ["trajstore.errors", "trajstore._version", "trajstore._moved", "trajstore.base", "trajstore.base.*"]),
    ("integrations", ["trajstore.integrations", "trajstore.integrations.*"]),
    ("format: shared", ["trajstore.format", *(f"trajstore.format.{m}" for m in FORMAT_SHARED)]),
    ("format: file checks", ["trajstore.format.file", "trajstore.format.file.*"]),
    ("format: batch structure", ["trajstore.format.batch", "trajstore.format.batch.*"]),
    ("format: codecs", ["trajstore.format.codec", "trajstore.format.codec.*"]),
    ("format: shards", ["trajstore.format.shard", "trajstore.format.shard.*"]),
    ("format front door", ["trajstore.schema"]),
    ("store", ["trajstore.store", "trajstore.store.*"]),
    ("torch bridge", ["trajstore.device", "trajstore.device.*", "trajstore.torch_bridge"]),
    ("writer / reader", ["trajstore.write", "trajstore.write.*", "trajstore.writer",
                         "trajstore.read", "trajstore.read.*", "trajstore.reader"]),
    ("recorder / inspection", ["trajstore.record", "trajstore.record.*", "trajstore.recorder", "trajstore.config",
                               "trajstore.inspection", "trajstore.inspection.*", "trajstore.testing",
                               "trajstore.testing.*", "trajstore.ray", "trajstore.view", "trajstore.view.*"]),
    ("trainer switches", ["trajstore.trainers", "trajstore.trainers.*"]),
    ("cli", ["trajstore.cli", "trajstore.cli.*"]),
    ("package root", ["trajstore"]),
]
# the rooms: a module of a room may import the room's other modules
ROOMS = ["base", "integrations", "format.file", "format.batch", "format.codec", "format.shard", "store", "device",
         "write", "read", "record", "inspection", "testing", "view", "trainers", "cli"]
# the front doors at the package's top, each on its room (trajstore.schema is the format's)
FRONT_DOORS = {"trajstore.writer": "write", "trajstore.reader": "read", "trajstore.torch_bridge": "device",
               "trajstore.recorder": "record", "trajstore.config": "record"}
# allowed imports inside one layer: (importer pattern, imported pattern)
SAME_LAYER = [
    *((f"trajstore.{r}.*", f"trajstore.{r}.*") for r in ROOMS),
    *((f"trajstore.{r}", f"trajstore.{r}.*") for r in ROOMS),
    *((door, f"trajstore.{room}.*") for door, room in FRONT_DOORS.items()),
    *((f"trajstore.format.{a}", f"trajstore.format.{b}") for a in FORMAT_SHARED for b in FORMAT_SHARED),
    ("trajstore.integrations.*", "trajstore.integrations"),
    ("trajstore.view.*", "trajstore.inspection.*"),
    ("trajstore.base.*", "trajstore.errors"),
    ("trajstore.base.*", "trajstore._version"),
]
# the writer's room and the reader's room never meet below the recorder, not even through a third module
APART = ("trajstore.write", "trajstore.read")
# the package's top holds only the public entry points and the lowest modules; everything else is in a room
ROOT = {"trajstore", "trajstore._version", "trajstore._moved", "trajstore.errors", "trajstore.schema", "trajstore.ray",
        *FRONT_DOORS}


def _match(name: str, pattern: str) -> bool:
    return name == pattern or (pattern.endswith(".*") and name.startswith(pattern[:-1]))


def _layer(name: str) -> int:
    for i, (_, pats) in enumerate(LAYERS):
        if any(_match(name, p) for p in pats):
            return i
    raise AssertionError(f"{name} is in no layer of tests/test_layers.py; add it where docs/ARCHITECTURE.md says")


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _imports(name: str, f: Path, known: set[str]) -> set[str]:
    """Every trajstore module ``name`` imports, anywhere in the file."""
    is_pkg = f.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (here[: len(here) - node.level + 1] if node.level else [])
            mod = ".".join(base + ([node.module] if node.module else []))
            # "from . import x": x may be a module or a name
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # "trajstore.format.dtypes.as_value" -> the module
                t = t.rpartition(".")[0]
            if t.startswith("trajstore") and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {n: _imports(n, f, set(mods)) for n, f in mods.items()}


GRAPH = _graph()


def test_every_module_has_a_layer():
    for name in GRAPH:
        _layer(name)


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_imports_point_down(name):
    me = _layer(name)
    for dep in sorted(GRAPH[name]):
        if name == "trajstore":  # the package root re-exports the public API from any layer
            continue
        other = _layer(dep)
        if other < me:
            continue
        ok = other == me and any(_match(name, a) and _match(dep, b) for a, b in SAME_LAYER)
        assert ok, (f"{name} ({LAYERS[me][0]}) imports {dep} ({LAYERS[other][0]}): imports must point down "
                    "the layers of docs/ARCHITECTURE.md")


def _reach(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for d in GRAPH.get(todo.pop(), ()):
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def _room(prefix: str) -> set[str]:
    return {n for n in GRAPH if n == prefix or n.startswith(prefix + ".")}


def test_writer_and_reader_never_reach_each_other():
    a, b = APART
    for name in _room(a):
        assert not _reach(name) & _room(b), f"{name} reaches {sorted(_reach(name) & _room(b))}"
    for name in _room(b):
        assert not _reach(name) & _room(a), f"{name} reaches {sorted(_reach(name) & _room(a))}"


def test_no_cycles():
    for name in GRAPH:
        assert name not in _reach(name), f"{name} imports itself through {sorted(_reach(name))}"


def test_nothing_imports_the_cli_or_the_package_root():
    for name, deps in GRAPH.items():
        if not _match(name, "trajstore.cli.*") and name not in ("trajstore", "trajstore.cli"):
            assert not any(_match(d, "trajstore.cli.*") or d == "trajstore.cli" for d in deps), name
        if name != "trajstore":
            assert "trajstore" not in deps, f"{name} imports the package root (import the module instead)"


def test_the_checker_sees_edges():
    """The parser is not vacuous: known edges of today's package are found, function-level ones too."""
    assert "trajstore.format.file.parquet" in GRAPH["trajstore.read.reader"]
    assert "trajstore.read.reader" in GRAPH["trajstore.inspection.verify"]
    assert "trajstore.format.batch.check" in GRAPH["trajstore.format.codec.tensors"]
    assert _layer("trajstore.format.dtypes") < _layer("trajstore.store.paths") < _layer("trajstore.cli.main")


# imported inside functions on purpose: optional extras (an ImportError names the extra to install)
OPTIONAL = {"tensordict", "pandas", "duckdb", "polars", "tokenizers", "rich", "trackio", "safetensors", "ray",
            "fsspec", "uvicorn", "huggingface_hub"}
# the CLI loads a command's modules when the command runs, so `trajstore --help` starts at once
LAZY = {"trajstore.cli.main", "trajstore.cli.support", *(f"trajstore.cli.{m}" for m in
        ("inspect", "compare", "query", "export", "serve", "data"))}


def _function_imports(f: Path) -> list[tuple[int, str]]:
    out = []
    for fn in ast.walk(ast.parse(f.read_text(), str(f))):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                out += [(node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                out.append((node.lineno, "." * node.level + (node.module or "")))
    return out


# modules that `trajstore --help`, `info`, `sql` and `verify` load, with what they import inside the functions
# that need it (torch, and the decoding modules that import torch), so that those commands start without
# torch (docs/CLI.md; tests/test_cli_contract.py runs them and checks that torch was not loaded)
DEFERRED = {
    "trajstore.base.fingerprint": {"torch"},
    "trajstore.format.dtypes": {"torch"},
    "trajstore.format.values": {"torch"},
    "trajstore.store.remote": {"pyarrow.dataset"},  # loads pandas; only `sql` over object storage needs it
    "trajstore.format.file.parquet": {"pyarrow.dataset"},  # loads pandas; only a large step read needs it
    "trajstore.read.tables": {"..format.batch", "..format.codec.rows", ".shards"},
    "trajstore.inspection.verify": {"..read.reader"},
}


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_function_level_imports_are_only_optional_extras(name):
    if name in LAZY:
        return
    bad = [(line, mod) for line, mod in _function_imports(_modules()[name])
           if mod.split(".")[0] not in OPTIONAL and mod not in DEFERRED.get(name, ())]
    assert not bad, f"{name}: imports inside functions {bad}; import at the top (only optional extras wait)"


def test_every_module_is_in_a_room():
    """The tree shows the layers: a module is in its layer's folder, or one of the few files at the top."""
    loose = sorted(n for n in GRAPH if n not in ROOT and not any(_match(n, f"trajstore.{r}.*") or n == f"trajstore.{r}"
                                                                 for r in [*ROOMS, "format"]))
    assert not loose, f"modules outside a room: {loose}; put each in its layer's folder (docs/ARCHITECTURE.md)"


@pytest.mark.parametrize("room", ["format", *ROOMS])
def test_each_room_says_what_it_owns_and_may_import(room):
    f = PKG.joinpath(*room.split("."), "__init__.py")
    doc = ast.get_docstring(ast.parse(f.read_text())) or ""
    assert "May import" in doc or "may import" in doc, f"{f}: its docstring says what the room owns and what it may import"


@pytest.mark.parametrize("door", sorted(FRONT_DOORS))
def test_front_doors_only_re_export_their_room(door):
    deps = GRAPH[door]
    assert deps and all(_match(d, f"trajstore.{FRONT_DOORS[door]}.*") for d in deps), (door, deps)
    tree = ast.parse(_modules()[door].read_text())
    assert all(isinstance(n, ast.ImportFrom | ast.Assign | ast.Expr) for n in tree.body), f"{door} holds code"



LONGEST = 400  # lines of a module (docs/ARCHITECTURE.md, "Module size")


def test_modules_stay_short():
    """Every module of the package, and every page script of the viewer, is at most LONGEST lines, or
    docs/ARCHITECTURE.md names it under "Module size" with the reason."""
    doc = (PKG.parent / "docs" / "ARCHITECTURE.md").read_text()
    allowed = doc.split("## Module size", 1)[1].split("\n## ", 1)[0] if "## Module size" in doc else ""
    long = {str(f.relative_to(PKG.parent)): n for f in [*PKG.rglob("*.py"), *PKG.rglob("static/*.js")]
            if (n := len(f.read_text().splitlines())) > LONGEST}
    bad = {p: n for p, n in long.items() if f"`{p}`" not in allowed}
    assert not bad, f"modules over {LONGEST} lines: {bad}; split by responsibility, or say why in docs/ARCHITECTURE.md"
