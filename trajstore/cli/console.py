"""Terminal output for the CLI: rich tables and progress bars on a terminal, plain text when piped.

rich is optional: without it, output is plain text everywhere.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Sequence, TextIO


def _rich() -> bool:
    try:
        import rich  # noqa: F401
        return True
    except ImportError:
        return False


def fancy(stream: TextIO | None = None) -> bool:
    stream = stream or sys.stdout
    return bool(getattr(stream, "isatty", lambda: False)()) and _rich()


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None,
          stream: TextIO | None = None) -> None:
    """Print a table: a rich table on a terminal, aligned plain columns otherwise."""
    stream = stream or sys.stdout
    rows = [[fmt(v) for v in r] for r in rows]
    if fancy(stream):
        from rich.console import Console
        from rich.table import Table

        console = Console(file=stream)
        need = sum(max([len(h)] + [len(r[i]) for r in rows]) + 3 for i, h in enumerate(headers)) + 1
        if need > console.width and len(headers) > 2:  # too wide: one stacked block per row, no column cut
            for n, r in enumerate(rows):
                t = Table(title=title if n == 0 else None, title_justify="left", show_header=False)
                t.add_column(no_wrap=True, style="bold")
                t.add_column(overflow="fold")
                for h, v in zip(headers, r):
                    t.add_row(h, v)
                console.print(t)
            return
        t = Table(title=title, title_justify="left")
        for i, h in enumerate(headers):
            last = i == len(headers) - 1
            t.add_column(h, overflow="fold", no_wrap=not last, min_width=None if last else len(h))
        for r in rows:
            t.add_row(*r)
        console.print(t)
        return
    if title:
        print(f"{title}", file=stream)
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(), file=stream)
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=stream)


def heading(text: str, stream: TextIO | None = None) -> None:
    stream = stream or sys.stdout
    if fancy(stream):
        from rich.console import Console
        from rich.rule import Rule

        Console(file=stream).print(Rule(text, align="left"))
    else:
        print(f"== {text}", file=stream)


def block(title: str, text: str, style: str = "", stream: TextIO | None = None) -> None:
    """A titled block of text (a panel on a terminal)."""
    stream = stream or sys.stdout
    if fancy(stream):
        from rich.console import Console
        from rich.panel import Panel
        from rich.text import Text

        Console(file=stream).print(Panel(Text(text), title=title, title_align="left", border_style=style or "none"))
    else:
        print(f"--- {title}", file=stream)
        print(text, file=stream)


def progress(items: Sequence, description: str = "") -> Iterable:
    """Iterate ``items`` with a progress bar on stderr when it is a terminal."""
    if not (sys.stderr.isatty() and _rich()) or len(items) < 2:
        return items
    from rich.console import Console
    from rich.progress import track

    return track(items, description=description, transient=True, console=Console(file=sys.stderr))
