"""``trajstore view``: a run in the browser (curves, step tables, coloured tokens, the diff of two
dumps), served on this machine or written as one self-contained HTML file (``--export``).

The web stack (the ``view`` extra) is imported when the command runs."""

from __future__ import annotations

import argparse

from . import support as support
from ..base.text import parse_steps
from ..errors import ConfigError, MissingDependencyError
from .registry import PATH, SPLIT, TOKENIZER, arg, command

__all__ = ["cmd_view"]


@command("view", "look at a run in the browser: curves, step tables, coloured tokens, a diff of two dumps",
         PATH, arg("path2", nargs="?", metavar="PATH2", help="a second dump: the diff page compares the two"),
         SPLIT, TOKENIZER, arg("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)"),
         arg("--port", type=support.port, default=8000, help="port, 1-65535 (default: 8000)"),
         arg("--export", metavar="FILE.html", help="write one self-contained HTML file instead of serving"),
         arg("--steps", help="--export: the steps whose trajectories go in the file, e.g. 0-9,12 (default: the last)"),
         arg("--max-per-step", type=int, default=4, metavar="K", help="--export: trajectories per step (default: 4)"))
def cmd_view(args: argparse.Namespace) -> int:
    from ..view.pages import View

    try:
        from ..view import app, export
    except ImportError as e:
        raise MissingDependencyError(f"trajstore view needs the 'view' extra ({e.name}): "
                                     "pip install 'trajstore[view]'") from None
    v = View(args.path, args.split, args.tokenizer, other=args.path2)
    if args.path2 is not None:  # a second dump that does not open is an error now, not on the diff page
        from ..read.reader import Reader

        Reader(args.path2, v.split)
    if args.export:
        want = parse_steps(args.steps, "--steps")
        steps = None if want is None else [s for s in want if s in v.reader(None).steps]
        if want is not None and not steps:
            raise ConfigError(f"--steps {args.steps}: none of these steps is in {args.path} split {v.split!r}")
        try:
            f = export.export(v, args.export, steps, args.max_per_step)
        except OSError as e:
            raise ConfigError(f"--export {args.export}: cannot be written ({e.strerror or e}); check that its "
                              "folder exists and is writable") from None
        print(f"wrote {f} (opens with no network)")
        return 0
    sock = app.listen(args.host, args.port)  # bound (or a one-line error) before the line saying it serves
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"trajstore view: http://{host}:{sock.getsockname()[1]}/  (split {v.split}; Ctrl-C stops)", flush=True)
    app.serve(v, args.host, args.port, sock)
    return 0
