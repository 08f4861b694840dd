"""The ``trajstore`` command: look inside a dump without writing code.

    trajstore info PATH [--json]                   splits, steps, sizes, fields, environment
    trajstore show PATH --step N [--sample I] [--tokenizer T] [--logprobs]
    trajstore diff A B [--steps 0-9] [--fields f,g] [--atol X --rtol Y]
    trajstore diff A --pair logprobs old_logprobs [--mask loss_mask]
    trajstore sql PATH "SELECT step, avg(rewards) FROM train GROUP BY step"
    trajstore export PATH --format jsonl [--tokenizer T] [--max-per-step K] [-o FILE]
    trajstore verify PATH [--split S] [--deep] [--json]   checksums of every step (docs/RELIABILITY.md)
    trajstore import SRC DST [--kind pt|verl|roll] [--trust-pickle] [--strict]   other tools' dumps (docs/IMPORT.md)
    trajstore view PATH [PATH2] [--port N] [--tokenizer T] [--export FILE.html]   in the browser (trajstore[view])

Exit status: 0 success; 1 ``diff`` found a difference beyond tolerance, or ``verify`` a damaged
step; 2 an error (bad arguments, no such dump/step/field, a damaged file, a missing optional
package, an ``import`` that converted nothing or met a file that needs ``--trust-pickle``), with
one line on stderr (``--debug``: the traceback too); 130 interrupted (CTRL-C). ``PATH`` may name a
split folder or a step file of a dump (``support.locate``). ``--help``, ``info``, ``sql`` and
``verify`` (without ``--deep``) never import torch.

This module holds the parser, the dispatch (``run``) and the entry point (``main``); the commands
are in one module per group: ``inspect`` (info, show), ``compare`` (diff), ``query`` (sql),
``export`` (export), ``serve`` (view), ``data`` (verify, upgrade, import). Adding a subcommand:
write one function ``def cmd_x(args) -> int`` in its group's module and register it with one
``@command("x", "help", arg(...), ...)`` line (``registry``); a new group's module is imported below.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import support as support

try:  # a CTRL-C while the command starts up: one line and exit 130, never a traceback (docs/CLI.md)
    from .registry import COMMANDS, arg, command
    # the command modules register their commands as they are imported: in this order in ``--help``
    from . import inspect, compare, query, export, serve, data  # noqa: F401
except KeyboardInterrupt:
    raise SystemExit(support.interrupted(None)) from None

__all__ = ["main", "command", "arg"]


# ----------------------------------------------------------------------------- entry point
def parser() -> argparse.ArgumentParser:
    from .._version import __version__

    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="on an error, print the traceback as well as the one-line message")
    p = support.Parser(prog="trajstore", description="Look inside trajstore dumps.", parents=[debug])
    p.commands = [c[0] for c in COMMANDS]
    p.add_argument("--version", action="version", version=f"trajstore {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help, arguments, fn in COMMANDS:
        sp = sub.add_parser(name, help=help, description=help, parents=[debug])
        for names, kw in arguments:
            sp.add_argument(*names, **kw)
        sp.set_defaults(_fn=fn, _parser=sp)
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments; an unknown one is the subcommand's usage error (``see trajstore show --help``)."""
    args, extra = parser().parse_known_args(argv)
    if extra:
        args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def run(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status: the
    command's, 2 for an error (one line on stderr), 130 when interrupted."""
    command = None
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        args = _parse(argv)
        command, debug = args.command, getattr(args, "debug", False)
        support.locate(args)
        with support.warnings_as_lines(command):
            return args._fn(args)
    except KeyboardInterrupt:
        return support.interrupted(command)
    except BrokenPipeError:  # e.g. piped into head
        sys.stderr.close()
        return 0
    except Exception as e:  # a TrajstoreError says what to do; anything else is named with its type
        return support.report_error(command, e, debug)


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point. Called without ``argv`` (as the installed ``trajstore``), it ends
    the process with ``os._exit`` once output is flushed: a command has nothing left to clean up,
    and skipping interpreter teardown keeps the exit status exactly the command's (native
    libraries' thread pools can abort during teardown). With ``argv`` it just returns the status."""
    if argv is not None:
        return run(argv)
    try:
        rc = run()
    except SystemExit as e:  # argparse: --help, --version, usage errors
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:  # between the command's end and here
        rc = support.interrupted(None)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
