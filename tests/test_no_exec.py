"""Nothing executes: no pickle, eval, exec or weights_only=False in trajstore, and reading
any batch form (or a hostile file) never calls an unpickler or the code evaluators.

The one exception is fenced: ``trajstore/inspection/legacy_load.py`` may import pickle, and only its
two functions ``load_weights_only`` (``torch.load(weights_only=True)``) and ``unpickle_trusted`` (the
``--trust-pickle`` legacy import of ``trajstore import``) may use it; only the importer imports that
module (test_trusted_loader_is_fenced; tests/test_import_*.py check nothing is unpickled without
the flag)."""

import ast
import builtins
import io
import pickle
import tokenize
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings

import trajstore
from trajstore.store import checksums
from trajstore.testing import assert_batch_equal, batches

PKG = Path(trajstore.__file__).parent
SOURCES = sorted(PKG.rglob("*.py"))
BANNED_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib",
                  "copyreg", "code", "codeop"}
BANNED_CALLS = {"eval", "exec", "compile", "__import__", "execfile", "input", "breakpoint"}
BANNED_WORDS = {"pickle", "marshal", "shelve", "eval", "exec", "read_pickle", "allow_pickle", "cloudpickle",
                "dill", "import_module", "load_module", "exec_module", "run_path", "run_module"}


TRUSTED = PKG / "inspection" / "legacy_load.py"
TRUSTED_FUNCS = {"load_weights_only", "unpickle_trusted"}
# the one import by name: framework modules from the integrations' own fixed lists (integrations/__init__.py)
FRAMEWORK_IMPORT = (PKG / "integrations" / "__init__.py", "load")
# the package root's lazy names: a module of trajstore named in its own fixed table, never a name from a file
LAZY_IMPORT = (PKG / "__init__.py", "__getattr__")
# module paths of earlier releases: the loader imports the module named in its own fixed table (MOVED)
MOVED_IMPORT = (PKG / "_moved.py", "_Alias")


def _exempt_lines(src: Path, tree: ast.AST) -> set[int]:
    """Lines of the fenced trusted loader (its ``import pickle`` and its two functions) and of the
    framework-class import (and the package root's lazy import of its own modules)."""
    out = set()
    for node in tree.body:
        if src == TRUSTED and isinstance(node, ast.Import) and [a.name for a in node.names] == ["pickle"]:
            out.add(node.lineno)
        if isinstance(node, ast.FunctionDef) and (
                (src == TRUSTED and node.name in TRUSTED_FUNCS) or (src, node.name) in (FRAMEWORK_IMPORT, LAZY_IMPORT)):
            out.update(range(node.lineno, node.end_lineno + 1))
        if isinstance(node, ast.ClassDef) and (src, node.name) == MOVED_IMPORT:
            out.update(range(node.lineno, node.end_lineno + 1))
    return out


def test_sources_found():
    assert len(SOURCES) >= 8 and PKG / "reader.py" in SOURCES


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_no_code_execution_in_package_source(src):
    text = src.read_text()
    tree = ast.parse(text, str(src))
    exempt = _exempt_lines(src, tree)
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in exempt:
            continue
        if isinstance(node, ast.Import):
            names = {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names = {(node.module or "").split(".")[0]}
        else:
            names = set()
        assert not names & BANNED_MODULES, f"{src.name}:{node.lineno}: imports {names & BANNED_MODULES}"
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if isinstance(f, ast.Name):
                assert name not in BANNED_CALLS, f"{src.name}:{node.lineno}: calls {name}()"
            if isinstance(f, ast.Attribute) and name == "load":  # torch.load / np.load
                base = ast.unparse(f.value)
                assert base not in ("torch", "np", "numpy"), f"{src.name}:{node.lineno}: {base}.load()"
            for kw in node.keywords:
                if kw.arg in ("weights_only", "allow_pickle"):
                    assert not (isinstance(kw.value, ast.Constant) and kw.value.value is not True
                                and kw.arg == "weights_only"), f"{src.name}:{node.lineno}: weights_only=False"
                    assert kw.arg != "allow_pickle", f"{src.name}:{node.lineno}: allow_pickle"
    # and as words of code (comments and docstrings may mention them)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NAME and tok.start[0] not in exempt:
            assert tok.string not in BANNED_WORDS, f"{src.name}:{tok.start[0]}: {tok.string}"
    kept = "\n".join(line for i, line in enumerate(text.splitlines(), 1) if i not in exempt)
    assert "weights_only=False" not in kept.replace(" ", "")


def test_trusted_loader_is_fenced():
    """The exemption above stays narrow: load_weights_only loads with weights_only=True only,
    weights_only=False appears only in unpickle_trusted, and only the importer imports the module."""
    tree = ast.parse(TRUSTED.read_text())
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert TRUSTED_FUNCS <= set(funcs) and len(_exempt_lines(TRUSTED, tree)) > 10
    for name, fn in funcs.items():
        loads = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.load"]
        flags = [kw.value.value for n in loads for kw in n.keywords if kw.arg == "weights_only"]
        assert len(flags) == len(loads), f"{name}: torch.load without an explicit weights_only"
        if name != "unpickle_trusted":
            assert all(f is True for f in flags), f"{name}: torch.load(weights_only=False)"
    assert any(f is False for n in ast.walk(funcs["unpickle_trusted"]) if isinstance(n, ast.Call)
               for kw in n.keywords if kw.arg == "weights_only" for f in [kw.value.value])
    users = sorted(f.name for f in SOURCES if f != TRUSTED and "legacy_load" in f.read_text())
    assert users == ["importers.py"], users


def test_scanner_is_not_vacuous(tmp_path):
    """The same checks flag a file that does use them."""
    bad = "import pickle\nx = eval('1')\nimport torch\ntorch.load('f', weights_only=False)\n"
    tree = ast.parse(bad)
    calls = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    imports = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert "eval" in calls and "pickle" in imports and "weights_only=False" in bad


def _warm_up(tmp):
    """Import what pyarrow / numpy import lazily (their imports may use eval for namedtuples)."""
    import pandas  # noqa: F401

    with trajstore.Writer(tmp) as w:
        w.append(0, {"x": torch.arange(3), "y": ["a", None, "b"]})
    trajstore.Reader(tmp)[0]


@settings(max_examples=40)
@given(batch=batches())
def test_reading_any_batch_runs_no_loader(tmp_path_factory, batch):
    p = tmp_path_factory.mktemp("noexec")
    with trajstore.Writer(p) as w:
        w.append(0, batch)
    _warm_up(tmp_path_factory.mktemp("warm"))
    with pytest.MonkeyPatch.context() as mp:
        def boom(*a, **k):
            raise AssertionError("unpickler or evaluator called while reading")
        for mod, names in [(pickle, ["loads", "load", "Unpickler"]),
                           (builtins, ["eval"])]:
            for n in names:
                mp.setattr(mod, n, boom)
        mp.setattr(torch, "load", boom)
        got = trajstore.Reader(p)[0]
    assert_batch_equal(got, batch)


class _Evil:
    marker = ""

    def __reduce__(self):
        return (Path(self.marker).touch, ())


def test_hostile_pickled_extension_type_is_not_unpickled(tmp_path):
    """A Parquet file declaring pyarrow's pickle-based extension type (CVE-2023-47248)."""
    with trajstore.Writer(tmp_path) as w:
        w.append(0, {"x": torch.arange(4)})
    f = tmp_path / "train" / "step_00000000.parquet"
    table = pq.read_table(f)
    evil_obj = _Evil()
    evil_obj.marker = str(tmp_path / "EXECUTED")
    payload = pickle.dumps(evil_obj)
    evil = {b"ARROW:extension:name": b"arrow.py_extension_type", b"ARROW:extension:metadata": payload}
    fields = [fl.with_metadata({**(fl.metadata or {}), **evil}) for fl in table.schema]
    pq.write_table(pa.Table.from_arrays(table.columns, schema=pa.schema(fields, table.schema.metadata)), f)
    checksums.sum_path(f).write_text(checksums.sum_line(checksums.file_sha256(f), f.name))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pickle, "loads", _refuse)
        mp.setattr(pickle, "load", _refuse)
        _read_hostile(tmp_path, f)
    assert not (tmp_path / "EXECUTED").exists()


def _refuse(*a, **k):
    raise AssertionError("pickle called while reading")


def _read_hostile(tmp_path, f):
    try:
        got = trajstore.Reader(tmp_path)[0]
        assert torch.equal(got["x"], torch.arange(4))
    except trajstore.TrajstoreError as e:
        assert f.name in str(e)


def test_moved_loader_imports_only_its_table():
    """The earlier-paths loader stays narrow: the only names it imports are the targets of its fixed table
    (trajstore modules), and a path outside the table is not found by it."""
    from trajstore import _moved

    tree = ast.parse(MOVED_IMPORT[0].read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_Alias")
    calls = [ast.unparse(n) for n in ast.walk(cls) if isinstance(n, ast.Call)]
    assert calls == ["importlib.import_module(self.target)"], calls
    assert all(v.startswith("trajstore.") for v in _moved.MOVED.values())
    assert _moved._Finder().find_spec("os") is None and _moved._Finder().find_spec("trajstore.nope") is None
