"""The spec as typed data: the JSON description of a step's batch stored in each step file's schema
metadata (docs/FORMAT.md sections 3.6 and 3.7), the step envelope around it, the one format version,
the column-name rules, and the predicates other modules ask of spec nodes.

Nodes are plain dicts (they are read from files as JSON); the ``TypedDict`` classes below name their
keys and types. ``format/file/validate.py`` checks a stored spec against these before anything decodes it.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

from .._version import __version__
from ..errors import ConfigError, FormatError, FormatVersionError
from . import dtypes as dt

__all__ = [
    "FORMAT_VERSION", "MANIFEST_VERSION", "RESERVED", "STEP_COLUMN", "SHAPE_PREFIX", "PAD_PREFIX", "START_PREFIX",
    "RUNS_PREFIX", "RUNS_COL", "RUNS_ACTION", "LEN_PREFIX", "COMPANION_PREFIXES",
    "StepDoc", "BatchNode", "SeqNode", "TensorNode", "SegTensorNode", "GTensorNode", "JsonNode", "TValueNode", "GroupNode", "EmptyElem",
    "CellElem", "ValueElem", "StructElem",
    "FieldNode", "ElemNode", "step_doc", "fields", "is_token", "is_flat", "is_segments", "counted_masks", "is_tokenlike",
    "is_plain_sample",
    "node_columns", "columns_for", "where",
]

FORMAT_VERSION = 6  # the newest step-file version this library reads and writes
MANIFEST_VERSION = 2  # the dump layout (trajstore.json, folders, names; 2: _trajstore/ side folder); steps carry their own version
RESERVED = ("step",)  # column names a batch field may not take
STEP_COLUMN = "step"
# Companion columns (docs/FORMAT.md 3.1): the prefix joined to the column they describe with no dot,
# which fastparquet takes for a path separator (files of trajstore 0.1 used "__shape__." etc.; readers
# take every companion's name from the spec). A field's column may not start with one of them.
SHAPE_PREFIX = "__shape__"  # per-row shapes of a cell column
PAD_PREFIX = "__pad__"  # the values at padded positions of a token column
START_PREFIX = "__start__"  # per-row first valid positions of a mask group padded on both sides
RUNS_PREFIX = "__runs__"  # per-row runs of a list batch's groups stored unpadded
RUNS_COL = RUNS_PREFIX + "attention_mask"  # the runs column of a list batch (format/codec/grouped.py)
RUNS_ACTION = RUNS_COL + "__action"  # OpenRLHF's [g, T-1] action cells: the runs of the mask's columns 1..T-1
LEN_PREFIX = "__len__"  # per-row valid token counts of a mask group, for readers without trajstore
COMPANION_PREFIXES = (SHAPE_PREFIX, PAD_PREFIX, START_PREFIX, RUNS_PREFIX, LEN_PREFIX)


# ----------------------------------------------------------------------------- field nodes
class TensorNode(TypedDict):
    """A batched tensor in column ``col``: per-token (``kind`` token) or per-trajectory (sample)."""

    t: Literal["tensor"]
    col: str
    lib: Literal["torch", "numpy"]
    dtype: str
    kind: Literal["token", "sample"]
    trail: list[int]  # the shape after [B] (sample) or after the token dimension (token)
    pad: NotRequired[int | None]  # token, padded batch: the padded positions' bits, one value for all
    pad_col: NotRequired[str]  # token, padded batch: the padded positions' values, row by row
    tokenlike: NotRequired[bool]  # sample: a [B, T, 0...] field of a padded batch, stored whole
    axis: NotRequired[Literal["last"]]  # token: the field is [B, *trail, T], stored as [B, T, *trail] (version 3)
    mask: NotRequired[int]  # masked batch: the mask group it follows


class SegTensorNode(TypedDict):
    """A tensor ``[sum(counts), *trail]`` whose leading dimension is cut into one run of rows per
    trajectory: row *i* of column ``col`` holds rows ``sum(counts[:i]) .. + counts[i] - 1``,
    flattened (TRL/Qwen-VL ``pixel_values`` split by ``image_grid_thw``; format version 3)."""

    t: Literal["segtensor"]
    col: str
    lib: Literal["torch", "numpy"]
    dtype: str
    trail: list[int]
    counts: list[int]  # leading-dimension rows per trajectory, B entries


class GTensorNode(TypedDict):
    """An unbatched tensor (0-d, or ``cu_seqlens``) inline: base64 of its little-endian storage bytes."""

    t: Literal["gtensor"]
    lib: Literal["torch", "numpy", "np_scalar"]
    dtype: str
    shape: list[int]
    data: str
    col: NotRequired[str]  # a packed step's cu_seqlens: also column ``col``, row i = cu_seqlens[i + 1]


class JsonNode(TypedDict):
    """An unbatched Python scalar."""

    t: Literal["json"]
    v: None | bool | int | float | str


class TValueNode(TypedDict):
    """An unbatched value plain JSON cannot hold exactly, as a typed document (format/typed.py;
    format version 2)."""

    t: Literal["tvalue"]
    v: Any


class GroupNode(TypedDict):
    """A nested dict of fields with the batch's size."""

    t: Literal["group"]
    keys: list[list]  # [[name, FieldNode], ...]


class SeqNode(TypedDict):
    """A per-trajectory list, tuple or 1-D numpy object/str array (also the top level of a list batch)."""

    t: Literal["seq"]
    container: Literal["list", "tuple", "ndarray"]
    np_dtype: NotRequired[str]  # ndarray: numpy's dtype.str
    trail: NotRequired[list[int]]  # ndarray of more than one dimension: each row's shape (version 2)
    elem: ElemNode
    wrapper: NotRequired[dict]  # top level only


# ----------------------------------------------------------------------------- element nodes (one value per row)
class _Rows(TypedDict, total=False):
    none: list[int]  # rows whose value is None
    missing: list[int]  # inside a struct: rows whose dict lacks the key


class EmptyElem(_Rows):
    t: Literal["empty"]


class CellElem(_Rows):
    """Per-row tensors of varying shape: values in ``col``, each row's shape in ``shape_col``."""

    t: Literal["cell"]
    col: str
    shape_col: str
    lib: Literal["torch", "numpy", "np_scalar"]
    dtype: str
    kind: NotRequired[Literal["token"]]  # shaped like the row's attention_mask (list batches)


class ValueElem(_Rows):
    """Per-row Python scalars of one type; ``json`` rows are compact JSON text."""

    t: Literal["value"]
    col: str
    ptype: Literal["str", "bool", "int", "float", "num", "json", "tjson", "ilist", "flist"]  # tjson: 2; num: 3; lists: 4
    ints: NotRequired[Any]  # num: true (every non-null row was an int) or the rows that were ints


class StructElem(_Rows):
    """Per-row dicts built from their children."""

    t: Literal["struct"]
    keys: list[list]  # [[name, ElemNode], ...]


FieldNode = TensorNode | SegTensorNode | GTensorNode | JsonNode | TValueNode | GroupNode | SeqNode
ElemNode = EmptyElem | CellElem | ValueElem | StructElem


# ----------------------------------------------------------------------------- the top level
class BatchNode(TypedDict):
    """A dict batch; ``T`` and ``side`` only for the padded form."""

    t: Literal["batch"]
    form: Literal["padded", "packed", "plain"]
    B: int
    T: NotRequired[int]
    side: NotRequired[Literal["right", "left"] | None]
    keys: list[list]  # [[name, FieldNode], ...], in the batch's order
    wrapper: NotRequired[dict]  # the container the batch came in (format/batch/containers.py)


class StepDoc(TypedDict):
    """The step envelope: the JSON object under the ``trajstore`` key of a step file's metadata."""

    format_version: int
    library: NotRequired[str]  # "trajstore": who wrote the file (absent in files of trajstore 0.1.0)
    library_version: NotRequired[str]  # the writing library's version
    step: int
    split: str
    num_rows: int
    meta: NotRequired[dict]  # the step metadata when it is plain JSON
    meta_t: NotRequired[Any]  # else its typed document, in place of meta (format/typed.py; format version 3)
    batch: BatchNode | SeqNode


def step_doc(step: int, split: str, num_rows: int, meta: dict | None, batch: BatchNode | SeqNode,
             extra: dict | None = None, version: int = 1) -> StepDoc:
    """The envelope of one step's spec. ``version`` is the lowest format version that can read this
    step (the encoder raises it only when the step uses something newer readers alone know), so a
    step that needs nothing new stays readable by older trajstore versions. Step metadata plain JSON
    cannot hold comes as ``extra["meta_t"]`` (its typed document) and replaces ``meta`` (version 3)."""
    assert 1 <= version <= FORMAT_VERSION
    doc = {"format_version": version, "library": "trajstore", "library_version": __version__,
           "step": step, "split": split, "num_rows": num_rows,
           "meta": meta or {}, "batch": batch, **(extra or {})}
    if "meta_t" in doc:
        del doc["meta"]
        doc["format_version"] = max(version, 3)
    if "shard" in doc:  # one rank's shard of a logical step (docs/FORMAT.md section 1): older readers refuse it
        doc["format_version"] = max(doc["format_version"], 3)
    return doc  # type: ignore[return-value]


def check_version(v: Any, where: str, what: str, newest: int = FORMAT_VERSION) -> int:
    """The format version ``v`` read from ``what`` (a step file; the manifest with ``newest=
    MANIFEST_VERSION``) at ``where``: a positive int up to ``newest``, else FormatError
    (FormatVersionError when written by a newer version)."""
    if type(v) is not int or v < 1:
        raise FormatError(f"{where}: format version {v!r} is missing or not a positive int; {what} is damaged")
    if v > newest:
        raise FormatVersionError(f"{where}: written with format version {v}; this trajstore reads up to "
                                 f"{newest}; upgrade trajstore")
    return v


# ----------------------------------------------------------------------------- predicates
def is_dict_batch(spec: Any) -> bool:
    """A step appended as a dict (form padded, packed or plain), not as a list of trajectories."""
    return isinstance(spec, dict) and spec.get("t") == "batch" and isinstance(spec.get("keys"), list)


def fields(spec: BatchNode | SeqNode) -> dict[str, Any]:
    """The top-level fields of a step: a dict batch's keys, or a list batch's per-row dict keys."""
    return dict(spec["keys"] if spec["t"] == "batch" else spec["elem"].get("keys", []))


def is_token(node: Any) -> bool:
    """A per-token tensor field (a token column)."""
    return isinstance(node, dict) and node.get("t") == "tensor" and node.get("kind") == "token"


def is_token_cell(node: Any) -> bool:
    """In a list batch, a per-row tensor shaped like the row's attention mask (a token cell)."""
    return isinstance(node, dict) and node.get("t") == "cell" and node.get("kind") == "token"


def is_segments(node: Any) -> bool:
    """A segmented tensor field (one run of leading-dimension rows per trajectory, version 3)."""
    return isinstance(node, dict) and node.get("t") == "segtensor"


def is_flat(node: Any) -> bool:
    """A tensor field stored as a ``large_list`` column (token, or sample with trailing dims)."""
    return (isinstance(node, dict) and node.get("t") == "tensor" and isinstance(node.get("col"), str)
            and (node.get("kind") == "token" or bool(node.get("trail"))))


def counted_masks(spec: Any) -> list[int] | None:
    """A masked batch's mask groups whose tokens make up the trajectories (docs/FORMAT.md 3.4): the
    attention mask's own group if there is one, else every whole mask field (a prompt's and a
    completion's). None for other forms."""
    if not (isinstance(spec, dict) and spec.get("form") == "masked" and isinstance(spec.get("masks"), list)):
        return None
    groups = [g for g in spec["masks"] if isinstance(g, dict)]
    main = [i for i, g in enumerate(groups) if g.get("key") == "" and g.get("src") == "attention_mask"]
    return main or [i for i, g in enumerate(groups) if g.get("src") != "attention_mask"]


def is_tokenlike(node: Any) -> bool:
    """A tensor field with one entry per token: a token column, or a ``[B, T, 0...]`` one stored whole."""
    return isinstance(node, dict) and node.get("t") == "tensor" and (
        node.get("kind") == "token" or bool(node.get("tokenlike")))


def is_plain_sample(node: Any) -> bool:
    """A per-trajectory tensor field with no trailing dims: one primitive value per row."""
    if not (isinstance(node, dict) and node.get("t") == "tensor" and node.get("kind") == "sample"
            and node.get("trail") == [] and not node.get("tokenlike") and isinstance(node.get("col"), str)):
        return False
    d, lib = node.get("dtype"), node.get("lib")  # anything unusual takes the fully checked path
    return type(d) is str and dt.known(d) and (lib == "numpy" and d != "bfloat16" or
                                               lib == "torch" and (d == "uint8" or not d.startswith("uint")))


# ----------------------------------------------------------------------------- columns
def node_columns(node: dict, out: list[str], masks: list | None = None) -> None:
    """Append every Arrow column ``node`` (and the nodes below it) is stored in to ``out``;
    ``masks``: a masked batch's mask groups (a field following a span group needs its starts)."""
    for key in ("col", "shape_col", "pad_col", "runs"):  # runs: a group's cell stored by runs (shared)
        if key in node and node[key] not in out:
            out.append(node[key])
    if masks and type(node.get("mask")) is int and 0 <= node["mask"] < len(masks):
        g = masks[node["mask"]]
        if isinstance(g, dict) and isinstance(g.get("start_col"), str) and g["start_col"] not in out:
            out.append(g["start_col"])
    for _, child in node.get("keys", []):
        node_columns(child, out, masks)
    if "elem" in node:
        node_columns(node["elem"], out)


def columns_for(spec: BatchNode | SeqNode, columns: list[str] | None) -> list[str] | None:
    """Arrow columns needed to decode the top-level fields ``columns`` (None: all)."""
    if columns is None:
        return None
    keys = fields(spec)
    out: list[str] = []
    for c in columns:
        if c not in keys:
            raise ConfigError(f"field {c!r} is not in this step; fields: {sorted(keys)}")
        node_columns(keys[c], out, spec.get("masks"))  # type: ignore[arg-type]
    return out


def where(path: tuple) -> str:
    """A field's dotted path for messages (``"extra.score"``; ``"<batch>"`` for the batch itself)."""
    return ".".join(str(p) for p in path) if path else "<batch>"
