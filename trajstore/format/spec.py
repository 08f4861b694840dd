"""The spec: the JSON description of a step's batch stored in each step file's schema metadata
(docs/FORMAT.md section 4), and the one format version."""

from __future__ import annotations

from typing import Any

from . import dtypes as dt

__all__ = ["FORMAT_VERSION", "is_plain_sample", "where"]

FORMAT_VERSION = 1


def is_plain_sample(node: Any) -> bool:
    """A per-trajectory tensor field with no trailing dims: one primitive value per row."""
    if not (isinstance(node, dict) and node.get("t") == "tensor" and node.get("kind") == "sample"
            and node.get("trail") == [] and not node.get("tokenlike") and isinstance(node.get("col"), str)):
        return False
    d, lib = node.get("dtype"), node.get("lib")  # anything unusual takes the fully checked path
    return type(d) is str and dt.known(d) and (lib == "numpy" and d != "bfloat16" or
                                               lib == "torch" and (d == "uint8" or not d.startswith("uint")))


def where(path: tuple) -> str:
    """A field's dotted path for messages (``"extra.score"``; ``"<batch>"`` for the batch itself)."""
    return ".".join(str(p) for p in path) if path else "<batch>"
