"""The text of each token on the trajectory and diff pages, and numbers at their stored precision.

A byte-level tokenizer (GPT-2 style BPE, SentencePiece with byte fallback) may cut a multi-byte UTF-8
character between tokens: decoded alone, each piece is U+FFFD. ``token_texts`` decodes such tokens
as one run, the shortest run whose text is whole (up to ``RUN`` tokens), and gives each token of the
run its bytes (``part``, hex) and the run's first token the run's text (``whole``) and length
(``span``); the page shows the whole characters once and each token as its bytes. A token whose run
never becomes whole (a cut-off last character) keeps its own text and shows its bytes.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ..inspection.traces import decode_ids

__all__ = ["token_texts", "number"]

RUN = 8  # the longest run of tokens decoded together to make whole characters (a character is <= 4 bytes)
BAD = "\ufffd"
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece's byte fallback


def _byte_level() -> dict[str, int]:
    """GPT-2's byte-level alphabet (the table of ``tokenizers``' ByteLevel): character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


_BYTES = _byte_level()


def _piece_bytes(tok: Any, tid: int, text: str) -> bytes | None:
    """The bytes of token ``tid``: its byte-level piece mapped back, a ``<0xNN>`` piece, else None."""
    piece = None
    for name in ("id_to_token", "convert_ids_to_tokens"):
        f = getattr(tok, name, None)
        if f is not None:
            try:
                piece = f(tid)
            except Exception:  # noqa: BLE001 -- a tokenizer of another kind: no piece
                piece = None
            break
    if not isinstance(piece, str):
        return None
    m = _BYTE_PIECE.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    if piece and all(c in _BYTES for c in piece):
        return bytes(_BYTES[c] for c in piece)
    return None


def token_texts(tok: Any, ids: list[int]) -> list[dict]:
    """One dict per token: ``text`` (decoded alone); for a token of a run that only decodes whole
    together, ``part`` (its bytes as hex, else its text) and, on the run's first token, ``whole`` (the
    run's text) and ``span`` (its tokens)."""
    texts = [decode_ids(tok, [t]) for t in ids]
    out = [{"text": t} for t in texts]
    j = 0
    while j < len(ids):
        if BAD not in texts[j] or _piece_bytes(tok, ids[j], texts[j]) == BAD.encode():
            j += 1
            continue
        k, whole = j, None
        while k + 1 < min(len(ids), j + RUN):
            k += 1
            got = decode_ids(tok, ids[j:k + 1])
            if BAD not in got:
                whole = got
                break
        if whole is None:
            k = j
        for m in range(j, k + 1):
            b = _piece_bytes(tok, ids[m], texts[m])
            out[m]["part"] = b.hex(" ") if b is not None else texts[m]
        if whole is not None:
            out[j]["whole"], out[j]["span"] = whole, k - j + 1
        j = k + 1
    return out


def number(v: Any, dtype: Any = None) -> str:
    """A stored number as text at its own precision: a float32 (or float16 / bfloat16 held as float32)
    value by its shortest float32 repr (``0.2``, not ``0.20000000298023224``), a float64 by ``repr``."""
    if dtype is not None and np.dtype(dtype).kind == "f" and np.dtype(dtype).itemsize <= 4:
        return str(np.float32(v))
    if isinstance(v, np.floating) and v.dtype.itemsize <= 4:
        return str(np.float32(v))
    if isinstance(v, float | np.floating):
        return repr(float(v))
    return str(v)
