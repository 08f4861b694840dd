"""Module paths of earlier releases, still importable.

The package's modules live in rooms named after their layer (docs/ARCHITECTURE.md). Code that imported a
module by its earlier path (``trajstore.snapshot``, ``trajstore.format.layout``...) gets the module at its
new place: the same module object, so its names and patches are shared. The public front doors
(``trajstore.writer``, ``trajstore.reader``, ``trajstore.torch_bridge``, ``trajstore.recorder``,
``trajstore.config``) are real files; this table is for the rest.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

__all__ = ["MOVED", "install"]

# earlier path -> where the module is now
MOVED = {
    "trajstore._text": "trajstore.base.text",
    "trajstore._threads": "trajstore.base.threads",
    "trajstore.fingerprint": "trajstore.base.fingerprint",
    "trajstore.format.layout": "trajstore.format.batch.layout",
    "trajstore.format.check": "trajstore.format.batch.check",
    "trajstore.format.classes": "trajstore.format.batch.classes",
    "trajstore.format.containers": "trajstore.format.batch.containers",
    "trajstore.format.tensors": "trajstore.format.codec.tensors",
    "trajstore.format.sequences": "trajstore.format.codec.sequences",
    "trajstore.format.grouped": "trajstore.format.codec.grouped",
    "trajstore.format.encoder": "trajstore.format.codec.encoder",
    "trajstore.format.decoder": "trajstore.format.codec.decoder",
    "trajstore.format.rows": "trajstore.format.codec.rows",
    "trajstore.format.shards": "trajstore.format.shard.shards",
    "trajstore.format.shard_join": "trajstore.format.shard.join",
    "trajstore.format.shard_masks": "trajstore.format.shard.masks",
    "trajstore.format.shard_rows": "trajstore.format.shard.elements",
    "trajstore.format.ids": "trajstore.format.shard.ids",
    "trajstore.format.validate": "trajstore.format.file.validate",
    "trajstore.format.validate_envelope": "trajstore.format.file.envelope",
    "trajstore.format.parquet": "trajstore.format.file.parquet",
    "trajstore.format.columns": "trajstore.format.file.columns",
    "trajstore.device_pad": "trajstore.device.pad",
    "trajstore.device_index": "trajstore.device.index",
    "trajstore.write_pool": "trajstore.write.pool",
    "trajstore.snapshot": "trajstore.write.snapshot",
    "trajstore.prefetch": "trajstore.read.prefetch",
    "trajstore.tables": "trajstore.read.tables",
    "trajstore.shard_read": "trajstore.read.shards",
    "trajstore.recorder_log": "trajstore.record.log",
    "trajstore._console": "trajstore.cli.console",
    "trajstore._cli_support": "trajstore.cli.support",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """The module at its new place is already executed."""


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
