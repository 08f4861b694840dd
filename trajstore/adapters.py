"""Batch container adapters: turn container types (TensorDict, DataProto-like objects)
into the plain dict/list forms ``schema`` stores, and back.

``unwrap(batch)`` returns ``(plain, tag)``; ``tag`` is a JSON-able description of the
container (None for plain batches) stored in the spec; ``wrap(plain, tag)`` rebuilds it.
"""

from __future__ import annotations

from typing import Any


def unwrap(batch: Any) -> tuple[Any, dict | None]:
    return batch, None


def wrap(plain: Any, tag: dict | None) -> Any:
    if tag is None:
        return plain
    from .errors import FormatError

    raise FormatError(f"unknown batch container {tag.get('type')!r} in the spec; upgrade trajstore")
