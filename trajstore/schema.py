"""Batch <-> Arrow table: the front door of the on-disk format (``trajstore/format/``).

``encode`` turns a batch into an Arrow table (one row per trajectory) plus a JSON *spec* that says
how to rebuild the exact Python structure; ``decode`` does the reverse. docs/FORMAT.md is the
normative description of both; docs/ARCHITECTURE.md says which module of ``format/`` owns what.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from .format.batch import containers
from .format.codec.decoder import decode
from .format.codec.encoder import encode_plain
from .format.spec import RESERVED, columns_for
from .format.values import check_json

__all__ = ["encode", "encode_plain", "decode", "columns_for", "check_json", "RESERVED"]


def encode(batch: Any, *, step: int, split: str, meta: dict | None = None,
           extra: dict | None = None) -> pa.Table:
    """Encode ``batch`` into an Arrow table whose schema metadata holds the spec."""
    plain, container = containers.unwrap(batch)
    return encode_plain(plain, container, step=step, split=split, meta=meta, extra=extra)
