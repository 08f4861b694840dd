"""trajstore: record every step of an RL run as Parquet and replay it bit for bit.

The public names below are loaded on first use (PEP 562), so that ``import trajstore`` and the
``trajstore`` command's start-up do not import torch until a name that needs it is touched;
``from trajstore import Writer`` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _moved
from ._version import __version__

_moved.install()  # module paths of earlier releases (trajstore.snapshot, trajstore.format.layout...) still import

if TYPE_CHECKING:  # for type checkers and IDEs; at run time they load on first use (__getattr__)
    from .errors import (
        BatchError,
        ChecksumError,
        ConfigError,
        DumpNotFoundError,
        EnvironmentMismatchError,
        FormatError,
        FormatVersionError,
        MissingDependencyError,
        StepExistsError,
        StepNotFoundError,
        TrajstoreError,
        UnsupportedTypeError,
        WriterError,
    )
    from .base.fingerprint import deterministic
    from .inspection.diff import diff
    from .inspection.traces import traces
    from .inspection.verify import verify
    from .read.reader import Reader
    from .record.recorder import DumpReplayConfig, Recorder
    from .write.writer import Writer

# public name -> the module that defines it
_LAZY = {
    "Writer": ".write.writer",
    "Reader": ".read.reader",
    "Recorder": ".record.recorder",
    "DumpReplayConfig": ".record.recorder",
    "deterministic": ".base.fingerprint",
    "traces": ".inspection.traces",
    "diff": ".inspection.diff",
    "verify": ".inspection.verify",
    **{name: ".errors" for name in (
        "TrajstoreError", "StepNotFoundError", "StepExistsError", "DumpNotFoundError", "BatchError",
        "UnsupportedTypeError", "FormatError", "FormatVersionError", "ChecksumError", "WriterError",
        "ConfigError", "EnvironmentMismatchError", "MissingDependencyError")},
}

__all__ = [
    "__version__",
    "Writer",
    "Reader",
    "Recorder",
    "DumpReplayConfig",
    "deterministic",
    "traces",
    "diff",
    "verify",
    "TrajstoreError",
    "StepNotFoundError",
    "StepExistsError",
    "DumpNotFoundError",
    "BatchError",
    "UnsupportedTypeError",
    "FormatError",
    "FormatVersionError",
    "ChecksumError",
    "WriterError",
    "ConfigError",
    "EnvironmentMismatchError",
    "MissingDependencyError",
]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'trajstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value  # later lookups are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
