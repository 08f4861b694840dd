"""``trajstore.reader``: front door of the read path (``trajstore/read/``); the code is in ``trajstore.read.reader``."""

from .read.reader import (
    Reader,
)

__all__ = ["Reader"]
