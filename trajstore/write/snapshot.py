"""The batch of one step as it was at ``Writer.append``, for the background thread that encodes it.

* CPU torch tensors are copied at ``append`` (the default, ``copy=True``): a large one (at least
  ``STAGE_BYTES``) into a reused buffer of the writer's host pool (plain memory, given back once
  the step is written, so a loop that refills the same tensors every step allocates nothing after
  its first steps), in about one piece per thread of the shared pool; a small one copied whole.
  With ``copy=False`` (opt-in) they are not copied: their version counters (``t._version``) are
  recorded and checked again before and after the step is encoded; if one changed (an in-place
  update after ``append``), the step is *not* written and ``WriterError`` names the step and field.
  Writes that bypass torch's counter (through a ``.numpy()`` view, ``.data`` or another alias of the
  memory) are not seen in that mode.
* CUDA tensors are copied into reused pinned host buffers on a side stream that first waits on
  the caller's current stream; the caller's stream then waits (on the GPU, the calling thread does
  not block) for that copy, so later in-place updates queued on it cannot race the copy
  (``torch_bridge.snapshot_cuda``). Both modes.
* numpy arrays have no version counter, so an in-place change could not be detected: numeric
  numpy arrays are always copied at ``append``; string arrays are copied shallowly (their items are
  immutable). Object arrays (verl's ``non_tensor_batch``, ``multi_modal_inputs``) are rebuilt item by
  item, every item taken like a batch value: tensors and arrays inside them, at any depth of dicts,
  lists, tuples and object arrays, are copied (or version-checked) like top-level ones.
* dicts, lists and tuples are rebuilt at ``append`` (a shallow copy of the structure, one level
  per container); Python scalars and strings are immutable. Other objects are kept by reference.
* AReaL ``RTensor`` values are taken as their local tensors: one whose data is local like a CPU
  tensor; remote ones are fetched in one batch on a background thread started here, through
  AReaL's own API on copies (the caller's RTensors stay remote), and ``batch()`` waits for it
  (``integrations/areal.py``).
* The step's ``meta`` is checked and copied at ``append`` (``check_meta``); a shard writer's batch may
  not have a field named ``rank``, the column its shard files add (``check_rank_field``, ``with_rank``).
"""

from __future__ import annotations

import json
from collections import OrderedDict, defaultdict
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from ..base.text import human_bytes
from ..errors import BatchError, ConfigError, TrajstoreError, WriterError
from ..format import typed
from ..format.shard.shards import RANK_COLUMN
from ..format.spec import where
from ..integrations import areal
from ..base.threads import PIECE_BYTES, run_parallel, threads
from ..device import unpad
from ..device.pinned import CudaSnapshot, PinnedPool, snapshot_cuda
from ..format.codec.unpadded import Unpadding, placeholder
from ..device.tree import map_tree

MAX_META_BYTES = 1 << 20


def check_meta(meta: Any, step: int) -> dict:
    """The step envelope's entry for ``meta`` (docs/FORMAT.md 3.6), made now (the caller may change
    ``meta`` after ``append``): ``{"meta": a copy}`` when it is plain JSON, else ``{"meta_t": its typed
    document}`` (numpy scalars, tuples, non-str keys, bytes, arrays, tensors: format/typed.py)."""
    if meta is None:
        return {}
    if type(meta) is not dict:
        raise ConfigError(f"step {step}: meta must be a dict, got {type(meta).__name__}")
    entry = {"meta_t": typed.encode(meta)} if typed.needs_typed(meta, f"step {step} meta") else {"meta": meta}
    doc = json.dumps(entry)
    if len(doc) > MAX_META_BYTES:
        raise BatchError(f"step {step}: meta is {len(doc)} bytes of JSON, the limit is {MAX_META_BYTES}; "
                         "store large values as batch fields instead")
    return json.loads(doc)


_RANK_FIELD = ("step {step}: the batch has a field named 'rank', the column a shard file keeps the writing rank in "
               "(docs/FORMAT.md section 1); rename the field (e.g. 'rank_id') to dump it from several ranks")


def check_rank_field(plain: Any, step: int) -> None:
    """A shard's batch may not have a top-level field ``rank`` (its column would collide with the rank column)."""
    elems = plain if isinstance(plain, list | tuple) else [plain]
    if any(isinstance(e, dict) and RANK_COLUMN in e for e in elems):
        raise BatchError(_RANK_FIELD.format(step=step))


def with_rank(table: pa.Table, rank: int, step: int) -> pa.Table:
    """A shard's encoded ``table`` with its int32 ``rank`` column appended."""
    if RANK_COLUMN in table.column_names:  # a list batch's element field that append did not see
        raise BatchError(_RANK_FIELD.format(step=step))
    col = pa.array(np.full(table.num_rows, rank, dtype=np.int32))
    return table.append_column(pa.field(RANK_COLUMN, pa.int32(), nullable=False), col)


__all__ = ["Snapshot", "nbytes_of", "check_meta", "check_rank_field", "with_rank", "STAGE_BYTES"]
PIECE = 4 * PIECE_BYTES  # bytes per copy task on the thread pool


class _CudaSlot:
    """Where a CUDA tensor sits in the snapshot until its host copy is ready."""

    def __init__(self, i: int):
        self.i = i


class _RemoteSlot:
    """Where a remote AReaL RTensor sits in the snapshot until its fetch is done."""

    def __init__(self, i: int):
        self.i = i


UNPAD = True  # padded CUDA token fields are unpadded on the GPU at append (device/unpad.py)
STAGE_BYTES = 1 << 20  # a CPU tensor or numpy array this large is copied into a reused pool buffer


def _stageable(t: torch.Tensor) -> bool:
    """A dense tensor whose bytes a flat copy reproduces (no sparse, quantized, nested, conj/neg views)."""
    return (t.layout == torch.strided and not t.is_quantized and not t.is_nested and not t.is_conj()
            and not t.is_neg() and t.numel() * t.element_size() >= STAGE_BYTES)


def _flat_bytes(x: Any) -> np.ndarray:
    """A contiguous tensor's or array's bytes as a flat uint8 numpy view."""
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(-1).view(torch.uint8).numpy()
    return x.reshape(-1).view(np.uint8)


def _small_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of a small (or unusual) CPU tensor: through numpy where its dtype has a numpy twin (no
    torch call: each one gives the GIL away, and the background threads may keep it for a while), else a clone."""
    if not t.requires_grad and t.layout == torch.strided and t.dtype in _NUMPY_TWINS and not t.is_conj() \
            and not t.is_neg():
        return torch.from_numpy(t.numpy().copy())
    return t.detach().clone()


_NUMPY_TWINS = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                torch.float32, torch.float64, torch.complex64, torch.complex128}


def _rebuild(x: Any, leaf: Any, path: tuple) -> Any:
    """An object array's item with its dicts, lists and tuples rebuilt (exactly those types, and
    ``OrderedDict`` / ``defaultdict`` as themselves: the encoder judges a value by its type; other
    classes are kept as they are), ``leaf(value, path)`` for every other value."""
    t = type(x)
    if t is dict or t is OrderedDict:
        return t((k, _rebuild(v, leaf, path + (k,))) for k, v in x.items())
    if t is defaultdict:
        return defaultdict(x.default_factory, ((k, _rebuild(v, leaf, path + (k,))) for k, v in x.items()))
    if t is list or t is tuple:
        out = [_rebuild(v, leaf, path + (i,)) for i, v in enumerate(x)]
        return out if t is list else tuple(out)
    return leaf(x, path)


def _object_array(v: np.ndarray, leaf: Any, path: tuple) -> np.ndarray:
    """A new object array of ``v``'s shape, each item ``_rebuild``."""
    out = np.empty(v.shape, dtype=object)
    flat = out.reshape(-1)  # a view: out is new and contiguous
    for i, x in enumerate(v.reshape(-1)):
        flat[i] = _rebuild(x, leaf, path + (i,))
    return out


def _out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation that failed (Python's, numpy's, torch's CPU or CUDA allocator)."""
    text = str(e).lower()
    return isinstance(e, MemoryError) or "can't allocate memory" in text or "out of memory" in text \
        or "unable to allocate" in text


def _no_memory(v: Any, path: tuple, e: BaseException) -> BatchError:
    """The error of a batch value whose copy at ``append`` could not be allocated."""
    shape = list(v.shape) if hasattr(v, "shape") else None
    n = v.numel() * v.element_size() if isinstance(v, torch.Tensor) else getattr(v, "nbytes", 0)
    held = v.untyped_storage().nbytes() if isinstance(v, torch.Tensor) and v.device.type != "meta" else \
        (v.base.nbytes if isinstance(v, np.ndarray) and isinstance(v.base, np.ndarray) else n)
    view = (f" It is a view of {human_bytes(held)} of memory (an expand or broadcast: stride 0); store the tensor "
            "before expanding it and expand it after reading.") if held < n else ""
    return BatchError(f"field {where(path)!r}: the copy append makes of its {shape} values ({human_bytes(n)}) could "
                      f"not be allocated ({type(e).__name__}: {str(e)[:160]}).{view} Nothing of the step was "
                      "written; free memory or store less, and append again")


def nbytes_of(obj: Any) -> int:
    """The tensor and array bytes of a plain batch, as ``Snapshot.nbytes`` will count them (before any copy)."""
    count = _ByteCount()
    map_tree(obj, count)
    return count.n


class _ByteCount:
    """``nbytes_of``'s leaf. A class, not a closure calling itself (a reference cycle the cycle
    collector would have to free: ``device/tree.py`` ``_TensorLeaf``)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, v: Any, _path: Any) -> Any:
        if isinstance(v, torch.Tensor):
            self.n += v.numel() * v.element_size()
        elif isinstance(v, np.ndarray):
            self.n += v.nbytes
            if v.dtype == object:
                _object_array(v, self, ())
        elif areal.is_rtensor(v):
            self.n += v.data.numel() * v.data.element_size() if not areal.is_remote(v) else areal.nbytes(v)
        return None


class _HostLeaf:
    """``Snapshot.batch``'s leaf: each slot replaced by its host copy or fetched tensor (a class, as
    ``_ByteCount``: a closure calling itself would hold the host copies in a reference cycle)."""

    __slots__ = ("hosts", "fetched")

    def __init__(self, hosts: list, fetched: list) -> None:
        self.hosts, self.fetched = hosts, fetched

    def __call__(self, v: Any, _path: Any) -> Any:
        if isinstance(v, _CudaSlot):
            return self.hosts[v.i]
        if isinstance(v, _RemoteSlot):
            return self.fetched[v.i]
        if isinstance(v, np.ndarray) and v.dtype == object:
            return _object_array(v, self, ())
        return v


class Snapshot:
    """Take ``batch`` (a plain batch) as it is now; ``nbytes`` is its tensor bytes. On the background
    thread, ``batch()`` waits for the CUDA copies and returns what to encode, ``check(step)`` raises
    if a CPU tensor changed since (``copy=False``), and ``release()`` gives the pooled memory back.
    ``pool`` holds the pinned buffers of CUDA copies, ``staging`` (default: ``pool``) those of CPU copies."""

    def __init__(self, batch: Any, copy: bool, pool: PinnedPool, staging: PinnedPool | None = None,
                 masks: dict | None = None):
        self.copy, self.pool = copy, pool
        self.unpadded: Unpadding | None = None  # after batch(): the fields unpadded on the GPU
        self._unpad = unpad.start(batch, masks, pool) if UNPAD else None
        self.staging = pool if staging is None else staging  # the CPU copies' buffers
        self.versions: list[tuple[str, torch.Tensor, int]] = []
        self.cuda: list[tuple[str, torch.Tensor]] = []
        self.remote: list[tuple[str, Any]] = []  # AReaL RTensors whose values are elsewhere
        self.nbytes = 0
        self._bufs: list[torch.Tensor] = []  # pool buffers this snapshot holds
        self._copies: list[tuple[Any, Any]] = []  # (destination, source), run before __init__ returns
        try:
            self._batch = map_tree(batch, self._take, ())
            self._run_copies()
        except BaseException:
            self.release()
            raise
        self._hosts: list[torch.Tensor] = []
        self._cuda_snaps: list[CudaSnapshot] = []
        if self.cuda:
            self._hosts, self._cuda_snaps = snapshot_cuda([t for _, t in self.cuda], pool)
        self._fetch = areal.fetch([rt for _, rt in self.remote]) if self.remote else None

    def _take(self, v: Any, path: tuple) -> Any:
        """One value of the batch (a ``map_tree`` leaf) as the background will encode it; a copy that
        cannot be allocated is a BatchError naming the field (``_no_memory``), not the allocator's error."""
        try:
            return self._take_one(v, path)
        except (MemoryError, RuntimeError) as e:
            if isinstance(e, TrajstoreError) or not _out_of_memory(e):
                raise
            raise _no_memory(v, path, e) from None

    def _take_one(self, v: Any, path: tuple) -> Any:
        if isinstance(v, torch.Tensor):
            self.nbytes += v.numel() * v.element_size()
            if self._unpad is not None and len(path) == 1 and path[0] in self._unpad.keys:
                return placeholder(v)  # its tokens are on their way (device/unpad.py)
            if v.device.type == "cuda":
                self.cuda.append((where(path), v))
                return _CudaSlot(len(self.cuda) - 1)
            if v.device.type != "cpu":
                return v.detach().cpu()
            if not self.copy:
                self.versions.append((where(path), v, v._version))
                return v
            if not _stageable(v):
                return _small_copy(v)
            dst = self._stage(v.numel() * v.element_size()).view(v.dtype).view(v.shape)
            self._copies.append((dst, v))
            return dst
        if isinstance(v, np.ndarray):
            self.nbytes += v.nbytes
            if v.dtype == object:  # items may be tensors, arrays, containers: each taken like a batch value
                return _object_array(v, self._take, path)
            if v.nbytes >= STAGE_BYTES and v.dtype.kind in "biufc" and v.dtype.isnative:
                dst = self._stage(v.nbytes).numpy().view(v.dtype).reshape(v.shape)
                self._copies.append((dst, v))
                return dst
            return v.copy()
        if areal.is_rtensor(v):
            if not areal.is_remote(v):
                return self._take(v.data, path)
            self.nbytes += areal.nbytes(v)
            self.remote.append((where(path), v))
            return _RemoteSlot(len(self.remote) - 1)
        return v

    def _stage(self, n: int) -> torch.Tensor:
        """``n`` bytes of a reused pool buffer (a flat uint8 tensor), held until ``release``."""
        buf = self.staging.take(n)
        self._bufs.append(buf)
        return buf[:n]

    def _run_copies(self) -> None:
        """Fill the staged destinations: contiguous sources as byte pieces on the shared thread pool
        (a large copy is memory-bound: several cores move it faster), strided ones by torch."""
        total = sum(dst.nbytes for dst, _ in self._copies)
        piece = max(PIECE, -(-total // threads()))  # about one piece per pool thread: few GIL hand-offs
        pieces = []
        for dst, src in self._copies:
            n = dst.nbytes
            contiguous = src.is_contiguous() if isinstance(src, torch.Tensor) else src.flags.c_contiguous
            if not contiguous:
                if isinstance(src, torch.Tensor):
                    dst.copy_(src.detach())
                else:
                    np.copyto(dst, src)
                continue
            d, s = _flat_bytes(dst), _flat_bytes(src)
            pieces += [(d[i:i + piece], s[i:i + piece]) for i in range(0, n, piece)]
        run_parallel(lambda p: np.copyto(p[0], p[1]), pieces, total)
        self._copies = []

    def batch(self) -> Any:
        """The batch to encode, with every CUDA tensor replaced by its host copy (waits for the copies)."""
        for c in self._cuda_snaps:
            c.wait()
        if self._unpad is not None and self.unpadded is None:
            self.unpadded = self._unpad.finish()
            if self.unpadded is None:  # the device ran out of memory: the fields' whole host copies
                self._batch.update(self._unpad.whole)
                self._unpad.whole = {}
        fetched = self._fetched()
        if not self._hosts and not fetched:
            return self._batch
        return map_tree(self._batch, _HostLeaf(self._hosts, fetched))

    def _fetched(self) -> list[torch.Tensor]:
        """The local tensors of the remote RTensors, in order (waits for their fetch)."""
        if self._fetch is None:
            return []
        try:
            return self._fetch.result()
        except Exception as e:  # noqa: BLE001 - any failure of AReaL's backend fails this step only
            raise WriterError(
                f"fetching the values of {len(self.remote)} AReaL RTensor(s) (the first: field "
                f"{self.remote[0][0]!r}) failed: {type(e).__name__}: {e}; the shards must stay stored "
                "until the fetch started at append is done"
            ) from e

    def check(self, step: int) -> None:
        for name, t, ver in self.versions:
            if t._version != ver:
                raise WriterError(
                    f"step {step}: field {name!r} was modified in place after append (its tensor "
                    "version changed); the step was not written. Leave append's copy=True (the "
                    "default) on, or do not modify the tensor before flush()", step=step
                )

    def release(self) -> None:
        """Give the pinned and staging buffers back to their pool and drop the batch."""
        for c in getattr(self, "_cuda_snaps", []):
            c.release()
        if getattr(self, "_unpad", None) is not None:
            self._unpad.release()
        self._unpad, self.unpadded = None, None
        for b in self._bufs:
            self.staging.give(b, None)
        self._batch, self._hosts, self._cuda_snaps, self.versions, self.cuda = None, [], [], [], []
        self.remote, self._fetch, self._bufs = [], None, []
