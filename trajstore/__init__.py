"""trajstore: record every step of an RL run as Parquet and replay it bit for bit."""

from ._version import __version__
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
from .fingerprint import deterministic
from .inspection.diff import diff
from .inspection.traces import traces
from .inspection.verify import verify
from .reader import Reader
from .recorder import DumpReplayConfig, Recorder
from .writer import Writer

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
