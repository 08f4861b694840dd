"""A dump as a Ray Data ``Dataset`` of trajectories, for analysis across many machines
(``pip install 'trajstore[ray]'``; Ray is imported when ``read_dump`` is called).

>>> import trajstore.ray
>>> ds = trajstore.ray.read_dump("dumps/run1", columns=["rewards", "input_ids"])
>>> ds.groupby("step").mean("rewards").take_all()

One row per trajectory, the rows ``Reader.to_pandas`` gives (``trajstore/format/codec/rows.py``):

* ``step`` and ``index`` (the trajectory's position in the step file), ``rejected`` (True for a
  ``None`` trajectory of a list batch, whose fields are then None), ``rank`` for the rows of a
  shard file (a step written by several ranks: ``(rank, index)`` orders its logical batch), then
  the fields, nested ones with dotted names (``extra.score``); a field named like one of those
  (OpenRLHF's ``index``) is ``<name>_field``, as in ``Reader.to_pandas``;
* tensors as numpy arrays of the trajectory's own shape: per-token fields cut to its tokens
  (padding removed, packed rows split), so a token field is a variable-shaped tensor column;
  bfloat16 as float32 (the bfloat16 numbers themselves, which float32 holds exactly); a
  per-trajectory scalar (``rewards``) a plain numeric column;
* ``columns`` names the top-level fields to decode: only their Parquet columns are read, plus the
  mask or ``cu_seqlens`` a per-token field is cut by (dropped from the rows when not asked for).
  A step without one of them is a ConfigError naming the step and its fields.

Each step file (each shard file of a step written by several ranks) is one read task and one
block, decoded by trajstore's own reader in the task (``Reader`` on the one file, with all of its
checks, and ``verify=True`` its SHA-256 first), so the values are bit for bit those of ``Reader[s]``.
A dump named by a URL (object storage) is read the same way; the workers find credentials where
the Reader does (the environment, profiles) on their own nodes. Ray splits a block larger than
``DataContext.target_max_block_size`` (128 MiB by default) into several; the files are listed once,
on the driver, through the Reader. ``read_dump`` returns a lazy dataset: nothing is read before it
is consumed. ``examples/ray_stats.py`` computes per-step statistics with it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .base.text import parse_steps
from .errors import ConfigError, MissingDependencyError
from .format.batch import containers
from .format.codec.rows import rows
from .format.spec import fields, is_plain_sample
from .read.reader import Reader
from .read.tables import OWN

if TYPE_CHECKING:  # an optional extra, imported when used
    import ray.data

__all__ = ["read_dump", "step_table"]

BASE = ("step", "index", "rejected")  # the columns every row has, before its fields


class _Part(NamedTuple):
    """One read task: a step file (its path or URL) and its step."""

    step: int
    target: str


def read_dump(path: str | os.PathLike, split: str | None = None, *, columns: list[str] | None = None,
              steps: Iterable[int] | str | None = None, verify: bool = False,
              **map_args: Any) -> ray.data.Dataset:
    """The trajectories of ``split`` of the dump at ``path`` as a ``ray.data.Dataset``, one block
    per step file (see the module's docstring for the rows).

    ``split``: as ``Reader`` chooses it (``train``, else the dump's only split). ``columns``: the
    top-level fields to read (None: all). ``steps``: a list of steps or ``"0-99,200"`` (None: all);
    steps the split does not hold are left out, and none held is a ConfigError. ``verify``: check
    each file's recorded SHA-256 before decoding it. ``map_args`` go to ``Dataset.map_batches``
    of the read (``num_cpus``, ``memory``, ``concurrency``, ...)."""
    try:
        import ray.data
    except ImportError:
        raise MissingDependencyError("trajstore.ray needs Ray Data: pip install 'trajstore[ray]'") from None
    if columns is not None and (isinstance(columns, str) or not all(type(c) is str for c in columns)):
        raise ConfigError(f"columns must be a list of field names, got {columns!r}")
    reader = Reader(path, split, verify=verify)
    want = parse_steps(steps, "steps")
    have = set(reader.steps)
    chosen = reader.steps if want is None else [s for s in want if s in have]
    if want is not None and not chosen:
        raise ConfigError(f"steps {steps!r}: none of these steps is in {path} split {reader.split!r} "
                          f"(it holds {len(reader.steps)} step(s))")
    parts = [p for s in chosen for p in _parts(path, reader, s)]
    items = [{"step": p.step, "target": p.target} for p in parts]
    cols = None if columns is None else list(columns)
    # one block per item, so one map task per step file (batch_size=None: the block is the batch)
    ds = ray.data.from_items(items, override_num_blocks=max(1, len(items)))
    return ds.map_batches(_ReadTask(cols, verify), batch_size=None, batch_format="numpy", **map_args)


def _parts(path: str | os.PathLike, reader: Reader, step: int) -> list[_Part]:
    """The files of ``step``, each one read task: the one place the driver names a step's files,
    through the Reader's listing (``Reader.files``: a step written by N ranks is N shard files). A
    file is named by the path the Reader gives, or, for a dump named by a URL (object storage), by
    the URL of the file under the dump's URL."""
    files = reader.files(step) if hasattr(reader, "files") else [reader.file(step)]
    root = os.fspath(path)
    out = []
    for f in map(str, files):
        if "://" in root and "://" not in f:
            f = f"{str(root).rstrip('/')}/{reader.split}/{PurePosixPath(f).name}"
        out.append(_Part(step, f))
    return out


class _ReadTask:
    """The function of the read's map: one item (a step file) in, its trajectories out."""

    def __init__(self, columns: list[str] | None, verify: bool):
        self.columns, self.verify = columns, verify

    def __call__(self, item: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if len(item["step"]) != 1:  # from_items made one block per item
            raise AssertionError(f"a read task got {len(item['step'])} step files; expected one")
        return step_table(str(item["target"][0]), int(item["step"][0]), self.columns, verify=self.verify)


def step_table(target: str | os.PathLike, step: int, columns: list[str] | None = None, *,
               verify: bool = False) -> dict[str, np.ndarray]:
    """The rows of one step file (path or URL) as columns of numpy arrays: what one read task of
    ``read_dump`` returns (a tensor column is an object array of per-trajectory arrays). A shard
    file (one rank's part of a step) gives its own rows, with ``rank``."""
    recs, rank = _rows(target, step, columns, verify)
    n = len(recs)
    out: dict[str, Any] = {"step": np.full(n, step, dtype=np.int64), "index": np.arange(n, dtype=np.int64),
                           "rejected": np.array([r is None for r in recs], dtype=bool)}
    if rank is not None:
        out["rank"] = np.full(n, rank, dtype=np.int32)
    names: dict[str, None] = {}
    for r in recs:
        names.update(dict.fromkeys(r or ()))
    for name in names:  # a field named like an own column keeps its values under <name>_field (to_pandas' rule)
        out[f"{name}_field" if name in OWN else name] = _column([None if r is None else r.get(name) for r in recs])
    return out


def _rows(target: str | os.PathLike, step: int, columns: list[str] | None,
          verify: bool) -> tuple[list[dict | None], int | None]:
    """One step file decoded by trajstore's reader into one dict per trajectory (``format.rows``),
    with the fields of ``columns`` alone (None: all), and the rank that wrote it if it is a shard.
    The one place a read task opens a file."""
    reader = Reader(target, verify=verify)  # the step file on its own: no listing of its split
    doc = reader.info(step)
    spec, shard = doc["batch"], doc.get("shard")
    rank = shard.get("rank") if isinstance(shard, dict) else None
    if columns is None:
        return rows(containers.unwrap(reader.read(step))[0], spec), rank
    keys = fields(spec)
    missing = [c for c in columns if c not in keys]
    if missing:
        raise ConfigError(f"{target}: step {step} has no field {', '.join(map(repr, missing))}; its fields: "
                          f"{', '.join(sorted(keys))}")
    need = list(columns) + [c for c in _cut_by(spec, columns) if c not in columns]
    got = rows(containers.unwrap(reader.read(step, columns=need))[0], spec)
    keep = set(columns) | ({"group"} if spec.get("t") == "seq" else set())  # a list batch's group index
    return [None if r is None else {k: v for k, v in r.items() if any(k == c or k.startswith(c + ".") for c in keep)}
            for r in got], rank


def _cut_by(spec: dict, columns: list[str]) -> list[str]:
    """The fields ``rows`` cuts the fields ``columns`` by (attention mask, verl's prompts and
    responses, the mask fields of a masked batch, ``cu_seqlens``); none when every one of them is
    one value per trajectory, which no mask cuts."""
    keys = fields(spec)
    if all(is_plain_sample(keys[c]) or keys[c].get("t") in ("json", "gtensor", "tvalue")
           or keys[c].get("t") == "seq" and not keys[c].get("trail") for c in columns):
        return []
    form = spec.get("form")
    if spec.get("t") == "seq":
        out = ["attention_mask"]
    elif form == "padded":
        out = ["attention_mask", "prompts", "responses"]
    elif form == "packed":
        out = ["cu_seqlens"]
    elif form == "masked":
        out = [str(g.get("src", "")).split(".", 1)[0] for g in spec.get("masks", []) if isinstance(g, dict)]
    else:
        out = []
    return [c for c in dict.fromkeys(out) if c in keys]


def _column(values: list) -> np.ndarray:
    """One column of a block: numbers of one dtype as a typed array; arrays (a tensor per
    trajectory, of its own shape) and anything else as an object array Ray converts."""
    if values and all(isinstance(v, np.generic) for v in values) and len({v.dtype for v in values}) == 1:
        return np.array(values)
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out
