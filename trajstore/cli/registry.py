"""The list of ``trajstore`` commands and the arguments several of them share: a command module
registers each of its commands with one ``@command("x", "help", arg(...), ...)`` line above
``def cmd_x(args) -> int``; ``main.parser`` builds the parser from ``COMMANDS``, in the order they
were registered (the order ``trajstore --help`` lists them)."""

from __future__ import annotations

import argparse
from typing import Any, Callable

__all__ = ["Command", "COMMANDS", "arg", "command", "fields", "PATH", "SPLIT", "JSON", "TOKENIZER", "OVERRIDES"]

Command = Callable[[argparse.Namespace], int]
COMMANDS: list[tuple[str, str, tuple, Command]] = []


def arg(*names: str, **kw: Any) -> tuple:
    """An argparse argument of a subcommand (same arguments as ``add_argument``)."""
    return names, kw


def command(name: str, help: str, *arguments: tuple) -> Callable[[Command], Command]:
    """Register ``fn(args) -> exit status`` as subcommand ``name``."""
    def deco(fn: Command) -> Command:
        COMMANDS.append((name, help, arguments, fn))
        return fn
    return deco


PATH = arg("path", help="dump directory (holds trajstore.json), or one of its split folders or step files")
SPLIT = arg("--split", default=None, help="split to read (default: train, else the dump's only split; "
                                           "see docs/CLI.md for rank dumps)")
JSON = arg("--json", action="store_true", help="machine-readable JSON on stdout")
TOKENIZER = arg("--tokenizer", metavar="T", help="local tokenizer.json or HF model directory (no network)")
OVERRIDES = [arg(f"--{k}-field", dest=f"f_{k}", metavar="NAME", help=f"field holding the {k} (default: by name)")
             for k in ("tokens", "prompt", "completion", "mask", "reward", "versions", "logprobs")]


def fields(args: argparse.Namespace) -> dict:
    """The ``--tokens-field NAME`` ... overrides given: ``{"tokens": NAME, ...}``."""
    return {k[2:]: v for k, v in vars(args).items() if k.startswith("f_") and v}
