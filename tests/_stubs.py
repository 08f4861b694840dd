"""Import stubs for the optional packages a framework's modules import but a test does not use (logging
back ends, inference servers, CUDA kernels): ``import_with_stubs`` imports modules with stubs standing in
for those of ``roots`` that are not installed, then takes the stubs out of ``sys.modules``. Each name of a
stub module is a class that takes any arguments and does nothing (``wandb.init(mode="disabled")``, say);
calling what it makes raises."""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def called(*a, **k):
            raise RuntimeError(f"{self.__name__}.{name} is an import stub; the test must not call it")

        value = type(name, (), {"__init__": lambda s, *a, **k: None, "__call__": called})
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Stub(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def import_with_stubs(roots, *modules):
    """``modules`` imported with stubs for those of ``roots`` that are not installed; the stubs are taken
    out of ``sys.modules`` afterwards (the imported modules keep their references)."""
    missing = tuple(m for m in roots if importlib.util.find_spec(m) is None)
    finder = _StubFinder(missing)
    sys.meta_path.insert(0, finder)
    try:
        return [importlib.import_module(m) for m in modules]
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.partition(".")[0] in missing]:
            del sys.modules[name]
