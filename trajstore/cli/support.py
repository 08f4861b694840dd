"""What every ``trajstore`` command shares beyond its arguments (docs/CLI.md): a ``PATH`` that names a
step file or a split folder understood as its dump (+ split, + step), errors as one line on stderr
(``--debug``: the traceback too), CTRL-C as exit 130 with one line, and output files that appear under
their final name only once complete.

Imports of the library's layers wait for the function that needs them, so that ``trajstore --help``
starts without them (this module is listed in ``LAZY`` of tests/test_layers.py)."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import traceback
import warnings
from pathlib import Path
from typing import IO, Iterator
from contextlib import contextmanager

__all__ = ["Parser", "port", "locate", "one_line", "report_error", "interrupted", "output_file", "warnings_as_lines",
           "INTERRUPTED"]

INTERRUPTED = 130  # 128 + SIGINT, as shells report a command stopped by CTRL-C

# step_00000012.parquet, step_00000012.rank00001-of-00004.parquet (docs/FORMAT.md 1.2)
_STEP_FILE = re.compile(r"^step_(\d{8,})(?:\.rank\d{5,}-of-\d{5,})?\.parquet$")
_MANIFEST = "trajstore.json"
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def one_line(text: str) -> str:
    """``text`` on one line: its lines joined with ``"; "``, blank ones dropped."""
    return "; ".join(s.strip() for s in str(text).splitlines() if s.strip()) or "(no message)"


class Parser(argparse.ArgumentParser):
    """argparse, its usage errors on one line (``trajstore info: error: ...; see trajstore info --help``);
    a mistyped command of ``commands`` gets the closest ones (``did you mean info?``)."""

    commands: list[str] = []

    def error(self, message: str) -> None:  # type: ignore[override]
        m = re.search(r"invalid choice: '([^']*)'", message)
        if m and self.commands:  # the top-level parser: a mistyped command
            close = difflib.get_close_matches(m.group(1), self.commands, n=2, cutoff=0.5)
            message = f"{m.group(1)!r} is not a command" + (f"; did you mean {' or '.join(close)}?" if close else
                                                            f" (commands: {', '.join(self.commands)})")
        print(f"{self.prog}: error: {one_line(message)}; see {self.prog} --help", file=sys.stderr)
        raise SystemExit(2)


def port(text: str) -> int:
    """A TCP port as ``--port`` takes it: 1-65535 (argparse's usage error otherwise)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: give a number of 1-65535")
    return n


def report_error(command: str | None, e: BaseException, debug: bool) -> int:
    """Print ``e`` as ``trajstore CMD: error: ...`` (one line; the traceback first with ``--debug``) and
    return exit status 2. A trajstore error prints its own message; any other exception its type too
    (it is a bug or an unexpected condition, which ``--debug`` shows in full)."""
    from ..errors import TrajstoreError

    if debug:
        traceback.print_exception(e, file=sys.stderr)
    msg = one_line(str(e)) if isinstance(e, TrajstoreError) else f"{type(e).__name__}: {one_line(str(e))}"
    hint = "" if debug or isinstance(e, TrajstoreError) else " (run with --debug for the traceback)"
    print(f"trajstore{' ' + command if command else ''}: error: {msg}{hint}", file=sys.stderr)
    return 2


@contextmanager
def warnings_as_lines(command: str | None) -> Iterator[None]:
    """A ``TrajstoreWarning`` shown as one line ``trajstore CMD: warning: ...`` on stderr, as errors are
    (not Python's two lines naming the console script); other warnings as Python shows them."""
    from ..errors import TrajstoreWarning

    default = warnings.formatwarning

    def fmt(message, category, filename, lineno, line=None):  # noqa: ANN001 - warnings' own signature
        if issubclass(category, TrajstoreWarning):
            return f"trajstore{' ' + command if command else ''}: warning: {one_line(str(message))}\n"
        return default(message, category, filename, lineno, line)

    warnings.formatwarning = fmt
    try:
        yield
    finally:
        warnings.formatwarning = default


def interrupted(command: str | None) -> int:
    print(f"trajstore{' ' + command if command else ''}: interrupted", file=sys.stderr)
    return INTERRUPTED


def _is_dump(p: Path) -> bool:
    return (p / _MANIFEST).is_file()


def _parts(path: str) -> tuple[str, str | None, int | None]:
    """``(dump, split, step)`` of a local ``path`` naming a dump, one of its split folders or one of its
    step files; ``path`` itself (and Nones) when it is none of those (the command's own error then says
    what is missing)."""
    if _URL.match(path) and not path.lower().startswith("file://"):
        m = _STEP_FILE.match(path.rstrip("/").rsplit("/", 1)[-1])
        if m:  # a step object of a dump on object storage: <dump>/<split>/<step file>
            head = path.rstrip("/").rsplit("/", 2)
            if len(head) == 3 and not _URL.fullmatch(head[0] + "/"):
                return head[0], head[1], int(m.group(1))
        return path, None, None
    p = Path(path[len("file://"):] if path.lower().startswith("file://") else path)
    if _is_dump(p):
        return path, None, None
    m = _STEP_FILE.match(p.name)
    if m and _is_dump(p.parent.parent):
        if not p.is_file() and not os.path.lexists(p):
            _no_step_file(p, int(m.group(1)))
        return str(p.parent.parent), p.parent.name, int(m.group(1))
    if p.is_dir() and p.parent != p and _is_dump(p.parent):
        return str(p.parent), p.name, None
    return path, None, None


def _no_step_file(p: Path, step: int) -> None:
    """StepNotFoundError for a step file of a dump's split that is not there, naming the split's steps."""
    from ..base.text import format_ranges, runs
    from ..errors import StepNotFoundError
    from ..store import listing

    have = listing.list_steps(p.parent) if p.parent.is_dir() else []
    raise StepNotFoundError(f"{p}: step {step} is not in split {p.parent.name!r} of dump {p.parent.parent} "
                            f"(its steps: {format_ranges(runs(have)) if have else 'none'}); "
                            f"trajstore info {p.parent.parent} lists them", step=step)


def locate(args: argparse.Namespace) -> None:
    """Understand a step file or a split folder given where a command takes a dump: ``PATH`` becomes
    the dump, ``--split`` the file's split, and a command with ``--step`` / ``--steps`` reads that step
    unless told otherwise. A ``--split`` that names another split is an error."""
    from ..errors import ConfigError

    for attr in ("path", "path2", "a", "b"):
        given = getattr(args, attr, None)
        if not isinstance(given, str):
            continue
        dump, split, step = _parts(given)
        if split is None:
            continue
        setattr(args, attr, dump)
        if hasattr(args, "split"):
            if args.split is None:
                args.split = split
            elif args.split != split:
                raise ConfigError(f"{given} is in split {split!r} of dump {dump}, but --split {args.split} was "
                                  "given; give one of them")
        if step is not None and attr in ("path", "a"):
            if hasattr(args, "step") and args.step is None:
                args.step = step
            elif hasattr(args, "steps") and args.steps is None:
                args.steps = str(step)


@contextmanager
def output_file(name: str | None) -> Iterator[IO[str]]:
    """stdout for None; else a text file written under a temporary name next to ``name``
    (``.<name>.partial-<pid>``) and renamed to ``name`` only when the block ends normally. An error or
    CTRL-C removes the partial file, so ``name`` never holds a partial output (an older file of that
    name stays as it was)."""
    if name is None:
        yield sys.stdout
        return
    from ..errors import ConfigError

    final = Path(name)
    tmp = final.with_name(f".{final.name}.partial-{os.getpid()}")
    if final.is_dir():
        raise ConfigError(f"-o {name}: is a folder; give a file name")
    try:
        f = open(tmp, "w", encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"-o {name}: cannot be written in {final.parent} ({e.strerror or e}); check the "
                          "folder exists and is writable") from None
    try:
        yield f
        f.close()
        os.replace(tmp, final)
    except BaseException:
        f.close()
        tmp.unlink(missing_ok=True)
        raise
