"""The one error hierarchy of trajstore.

Every class also derives from the builtin exception a caller would already
catch, so ``except KeyError`` around ``reader[step]`` keeps working::

    TrajstoreError(Exception)
    ├── StepNotFoundError(KeyError)       a step that is not in the dump
    ├── StepExistsError(FileExistsError)  appending a step that is already committed
    ├── DumpNotFoundError(FileNotFoundError)  no dump (or no such split) at the path
    ├── BatchError(ValueError)            a batch that cannot be stored exactly
    │   └── UnsupportedTypeError(TypeError)   a value of a type the format cannot hold
    ├── FormatError(ValueError)           a file that is not a valid trajstore file
    │   ├── FormatVersionError            written by a newer format version
    │   └── ChecksumError                 a step file does not match its recorded checksum
    ├── WriterError(RuntimeError)         a background write failed
    │   └── BatchWriteError(BatchError)   ... because of the batch (what only its values show)
    ├── ConfigError(ValueError)           an invalid option or argument
    ├── EnvironmentMismatchError(RuntimeError)  replay environment differs from the dump's (strict mode)
    └── MissingDependencyError(ImportError)  an optional package (an extra) is not installed

    TrajstoreWarning(UserWarning)         a likely mistake that does not stop the run
    ├── BatchWarning                      a batch that is stored, but probably not as meant
    └── ConfigWarning                     a setting that is probably a typo (TRAJSTORE_DUMPP)

Messages name the step, field or file, say why, and say what to do.

Foreign errors are mapped in one place: :func:`foreign_errors` turns what pyarrow (or the
file system) raises while reading untrusted bytes into :class:`FormatError` naming the file.
Nothing else is translated, so a bug of trajstore's own surfaces as itself.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import pyarrow as pa

__all__ = [
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
    "BatchWriteError",
    "ConfigError",
    "EnvironmentMismatchError",
    "MissingDependencyError",
    "TrajstoreWarning",
    "BatchWarning",
    "ConfigWarning",
    "foreign_errors",
]


class TrajstoreError(Exception):
    """Base class of every error raised by trajstore."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class StepNotFoundError(TrajstoreError, KeyError):
    """The requested step is not in the dump (also a ``KeyError``); ``step`` is that step."""

    step: int | None

    def __init__(self, message: str, *, step: int | None = None):
        super().__init__(message)
        self.step = step


class StepExistsError(TrajstoreError, FileExistsError):
    """The step is already committed and ``overwrite`` was not given."""


class DumpNotFoundError(TrajstoreError, FileNotFoundError):
    """There is no dump, or no such split, at the given path."""


class BatchError(TrajstoreError, ValueError):
    """The batch cannot be stored exactly (bad lengths, bad mask, bad names...)."""


class UnsupportedTypeError(BatchError, TypeError):
    """A value's type or dtype has no exact representation in the format."""


class FormatError(TrajstoreError, ValueError):
    """A file on disk is not a valid trajstore file (corrupt, truncated, foreign)."""


class FormatVersionError(FormatError):
    """A file was written by a newer format version than this library reads."""


class ChecksumError(FormatError):
    """A step file's bytes do not match a checksum recorded when it was written: the SHA-256 of
    the whole file (``verify=True``, ``trajstore verify``) or the CRC32 of one of its Parquet pages
    (checked on every read)."""


class WriterError(TrajstoreError, RuntimeError):
    """Writing a step failed (in the background or on disk).

    ``step`` is the (first) step that failed, ``steps`` every step reported by this error; both
    None when the error concerns no particular step (a closed writer, a stopped thread)."""

    step: int | None
    steps: list[int] | None

    def __init__(self, message: str, *, step: int | None = None, steps: list[int] | None = None):
        super().__init__(message)
        self.step = step
        self.steps = steps if steps is not None else (None if step is None else [step])


class BatchWriteError(WriterError, BatchError):
    """A step failed in the background because of its batch (what only tensor values show, such
    as an attention mask of other values than 0 and 1): both a ``WriterError`` (it arrives at a
    later call) and a ``BatchError``, so ``except BatchError`` catches every batch problem."""


class ConfigError(TrajstoreError, ValueError):
    """An option or argument is invalid."""


class EnvironmentMismatchError(TrajstoreError, RuntimeError):
    """A strict replay found the environment differs from the one recorded at dump time."""


class MissingDependencyError(TrajstoreError, ImportError):
    """An optional package is needed; the message names the extra to install."""


class TrajstoreWarning(UserWarning):
    """Base class of every warning of trajstore: a likely mistake that does not stop the run
    (``warnings.simplefilter("error", trajstore.TrajstoreWarning)`` makes them errors)."""


class BatchWarning(TrajstoreWarning):
    """A batch is stored exactly, but probably not as meant (a mask of another width than the
    tensors next to it makes them per-sample fields); the message names the fields and shapes."""


class ConfigWarning(TrajstoreWarning):
    """A setting is probably a typo (an unknown ``TRAJSTORE_*`` environment variable), or cannot be honoured here
    (``TRAJSTORE_PINNED_DECODE=1`` where the pool it needs cannot be built)."""


def warn(message: str, category: type[TrajstoreWarning]) -> None:
    """``warnings.warn`` attributed to the first caller outside the trajstore package (the user's
    ``append`` or ``from_env`` line, however deep the call came through trajstore)."""
    f, level = sys._getframe(1), 2
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE):
        f, level = f.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


class foreign_errors:
    """A context manager mapping what pyarrow and the file system raise inside the block to
    :class:`FormatError` ``"<where>: <doing> failed (<error>); <then>"``, where ``doing`` is
    ``doing.format(*args)``: the message is built only on failure, so the block costs nothing on
    the hot path. trajstore's own errors pass through, and so does anything else (a ``KeyError``
    or ``TypeError`` of ours is a bug, not a damaged file)."""

    __slots__ = ("where", "doing", "args", "then")
    # pyarrow's ArrowIOError is OSError (its zstd and thrift errors are ArrowException or OSError;
    # ArrowMemoryError is an ArrowException); a damaged footer can hold names that are not UTF-8, which
    # pyarrow decodes with Python's codec (UnicodeDecodeError); JSONDecodeError: the JSON parser's
    # own error on a document read from a file (any other ValueError is ours, and not mapped)
    MAPPED = (pa.ArrowException, OSError, UnicodeDecodeError, json.JSONDecodeError)

    def __init__(self, where: object, doing: str = "reading it", *args: object,
                 then: str = "the file is damaged or was not written by trajstore"):
        self.where, self.doing, self.args, self.then = where, doing, args, then

    def __enter__(self) -> None:
        return None

    def __exit__(self, tp: type[BaseException] | None, e: BaseException | None, tb: object) -> bool:
        if tp is None or issubclass(tp, TrajstoreError) or not issubclass(tp, self.MAPPED):
            return False
        doing = self.doing.format(*self.args)
        if "CRC checksum verification failed" in str(e):  # pyarrow's page_checksum_verification
            raise ChecksumError(f"{self.where}: {doing} failed: a Parquet page does not match the CRC32 checksum "
                                f"written with it ({e}), so the file is damaged; run `trajstore verify` on the "
                                "dump to find every damaged step, and restore them from a copy or write them "
                                "again") from None
        raise FormatError(f"{self.where}: {doing} failed ({tp.__name__}: {e}); {self.then}") from None
