"""trajstore: record every step of an RL run as Parquet and replay it bit for bit."""

__version__ = "0.1.0"

from .errors import (  # noqa: E402
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
from .reader import Reader  # noqa: E402
from .writer import Writer  # noqa: E402
from .recorder import DumpReplayConfig, Recorder  # noqa: E402
from .fingerprint import deterministic  # noqa: E402
from ._diff import diff  # noqa: E402
from ._traces import traces  # noqa: E402
from .integrity import verify  # noqa: E402

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
