"""The package's import graph follows docs/ARCHITECTURE.md: every import (top-level or inside a
function) points down the layers, writer and reader never reach each other, and there is no cycle.

Parsed with ``ast``, nothing is imported: an edge counts wherever it is written."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "trajstore"

# the layers, lowest first; a module may import only from layers below its own, or from its own
# layer where SAME_LAYER allows it (a subpackage's modules among themselves, a front door on its parts)
LAYERS: list[tuple[str, list[str]]] = [
    ("base", ["trajstore.errors", "trajstore._version", "trajstore._text", "trajstore._threads",
              "trajstore.fingerprint"]),
    ("integrations", ["trajstore.integrations", "trajstore.integrations.*"]),
    ("format", ["trajstore.format", "trajstore.format.*"]),
    ("format front door", ["trajstore.schema"]),
    ("store", ["trajstore.store", "trajstore.store.*"]),
    ("torch bridge", ["trajstore.torch_bridge", "trajstore.device_pad", "trajstore.device_index"]),
    ("writer / reader", ["trajstore.writer", "trajstore.snapshot", "trajstore.write_pool", "trajstore.reader", "trajstore.prefetch",
                         "trajstore.tables", "trajstore.shard_read"]),
    ("recorder / inspection", ["trajstore.config", "trajstore.recorder", "trajstore.recorder_log", "trajstore.inspection",
                               "trajstore.inspection.*", "trajstore.testing", "trajstore.ray",
                               "trajstore.view", "trajstore.view.*"]),
    ("trainer switches", ["trajstore.trainers", "trajstore.trainers.*"]),
    ("cli", ["trajstore._console", "trajstore._cli_support", "trajstore.cli"]),
    ("package root", ["trajstore"]),
]
# allowed imports inside one layer: (importer pattern, imported pattern)
SAME_LAYER = [
    ("trajstore.format.*", "trajstore.format.*"),
    ("trajstore.store.*", "trajstore.store.*"),
    ("trajstore.integrations.*", "trajstore.integrations"),
    ("trajstore.inspection.*", "trajstore.inspection.*"),
    ("trajstore.view.*", "trajstore.view.*"),
    ("trajstore.view.*", "trajstore.inspection.*"),
    ("trajstore.torch_bridge", "trajstore.device_pad"),
    ("trajstore.device_pad", "trajstore.device_index"),
    ("trajstore.writer", "trajstore.snapshot"),
    ("trajstore.writer", "trajstore.write_pool"),
    ("trajstore.write_pool", "trajstore.snapshot"),
    ("trajstore.reader", "trajstore.prefetch"),
    ("trajstore.reader", "trajstore.tables"),
    ("trajstore.reader", "trajstore.shard_read"),
    ("trajstore.tables", "trajstore.shard_read"),
    ("trajstore.recorder", "trajstore.config"),
    ("trajstore.recorder", "trajstore.recorder_log"),
    ("trajstore.recorder_log", "trajstore.config"),
    ("trajstore.cli", "trajstore._console"),
    ("trajstore.cli", "trajstore._cli_support"),
    ("trajstore._text", "trajstore.errors"),
    ("trajstore._threads", "trajstore.errors"),
    ("trajstore.fingerprint", "trajstore._version"),
]
# the writer's side and the reader's side never meet below the recorder, not even through a third module
APART = ("trajstore.writer", "trajstore.reader")


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


def test_writer_and_reader_never_reach_each_other():
    a, b = APART
    assert b not in _reach(a), f"{a} reaches {b}"
    assert a not in _reach(b), f"{b} reaches {a}"


def test_no_cycles():
    for name in GRAPH:
        assert name not in _reach(name), f"{name} imports itself through {sorted(_reach(name))}"


def test_nothing_imports_the_cli_or_the_package_root():
    for name, deps in GRAPH.items():
        if name not in ("trajstore", "trajstore.cli"):
            assert "trajstore.cli" not in deps, name
        if name != "trajstore":
            assert "trajstore" not in deps, f"{name} imports the package root (import the module instead)"


def test_the_checker_sees_edges():
    """The parser is not vacuous: known edges of today's package are found, function-level ones too."""
    assert "trajstore.format.parquet" in GRAPH["trajstore.reader"]
    assert "trajstore.reader" in GRAPH["trajstore.inspection.verify"]
    assert _layer("trajstore.format.dtypes") < _layer("trajstore.store.paths") < _layer("trajstore.cli")


# imported inside functions on purpose: optional extras (an ImportError names the extra to install)
OPTIONAL = {"tensordict", "pandas", "duckdb", "polars", "tokenizers", "rich", "trackio", "safetensors", "ray",
            "fsspec", "uvicorn", "huggingface_hub"}
# the CLI loads a command's modules when the command runs, so `trajstore --help` starts at once
LAZY = {"trajstore.cli", "trajstore._cli_support"}


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
    "trajstore.fingerprint": {"torch"},
    "trajstore.format.dtypes": {"torch"},
    "trajstore.format.values": {"torch"},
    "trajstore.store.remote": {"pyarrow.dataset"},  # loads pandas; only `sql` over object storage needs it
    "trajstore.tables": {".format", ".format.rows", ".shard_read"},
    "trajstore.inspection.verify": {"..reader"},
}


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_function_level_imports_are_only_optional_extras(name):
    if name in LAZY:
        return
    bad = [(line, mod) for line, mod in _function_imports(_modules()[name])
           if mod.split(".")[0] not in OPTIONAL and mod not in DEFERRED.get(name, ())]
    assert not bad, f"{name}: imports inside functions {bad}; import at the top (only optional extras wait)"
