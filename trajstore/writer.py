"""``trajstore.writer``: front door of the write path (``trajstore/write/``); the code is in ``trajstore.write.writer``."""

from .write.writer import (
    Writer,
    Committed,
)

__all__ = ["Writer", "Committed"]
