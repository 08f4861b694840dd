"""Text a user reads or types: step ranges (``"0-9,12,20:30"``) and byte sizes (``"1.5 MiB"``)."""

from __future__ import annotations

import re
from typing import Any

from ..errors import ConfigError

__all__ = ["parse_steps", "format_ranges", "runs", "human_bytes"]

_ALL = ("", "none", "null", "all")
_RANGE = re.compile(r"^([0-9]+)(?:[-:]([0-9]+))?$")


def parse_steps(value: Any, what: str = "steps") -> tuple[int, ...] | None:
    """Steps from ``"0,10,20-25"`` (``a-b`` and ``a:b`` are inclusive ranges) or from an iterable of
    ints; sorted, without repeats. None (every step) for None, ``""``, ``"all"``, ``"none"``.
    Anything else raises :class:`ConfigError` naming ``what``."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _ALL):
        return None
    if isinstance(value, str):
        out: list[int] = []
        for part in value.replace(" ", "").split(","):
            m = _RANGE.match(part)
            if m is None:
                raise ConfigError(f"{what}: cannot read {part!r} in {value!r}: give steps (ints >= 0) and "
                                  "inclusive ranges a-b or a:b, comma-separated, e.g. '0-9,12'")
            lo = int(m.group(1))
            out.extend(range(lo, int(m.group(2)) + 1) if m.group(2) else [lo])
        return tuple(sorted(set(out)))
    if isinstance(value, bool | int | float | bytes) or not hasattr(value, "__iter__"):
        raise ConfigError(f"{what}: {value!r} is not a list of steps; use e.g. [0, 10, 20] or \"0,10,20-25\"")
    return tuple(sorted({_step(s, what, value) for s in value}))


def _step(v: Any, what: str, whole: Any) -> int:
    try:
        i = int(v.strip()) if isinstance(v, str) else v.__index__() if not isinstance(v, bool) else None
    except (ValueError, AttributeError, TypeError):
        i = None
    if i is None or i < 0:
        raise ConfigError(f"{what}: {v!r} in {whole!r} is not a step; steps are ints >= 0")
    return i


def runs(steps: list[int]) -> list[list[int]]:
    """Sorted steps as inclusive ranges: ``[0, 1, 2, 7]`` -> ``[[0, 2], [7, 7]]``."""
    out: list[list[int]] = []
    for s in steps:
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return out


def format_ranges(ranges: list[list[int]]) -> str:
    """``[[0, 2], [7, 7]]`` -> ``"0-2, 7"`` (the form ``parse_steps`` reads); ``"none"`` if empty."""
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges) or "none"


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units, as ``ls -h`` and ``du -h``); None -> ``"-"``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
