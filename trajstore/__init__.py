"""trajstore: record every step of an RL run as Parquet and replay it bit for bit."""

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    BatchError,
    ConfigError,
    DumpNotFoundError,
    FormatError,
    FormatVersionError,
    StepExistsError,
    StepNotFoundError,
    TrajstoreError,
    UnsupportedTypeError,
    WriterError,
)
from .reader import Reader  # noqa: E402
from .writer import Writer  # noqa: E402

__all__ = [
    "__version__",
    "Writer",
    "Reader",
    "TrajstoreError",
    "StepNotFoundError",
    "StepExistsError",
    "DumpNotFoundError",
    "BatchError",
    "UnsupportedTypeError",
    "FormatError",
    "FormatVersionError",
    "WriterError",
    "ConfigError",
]
