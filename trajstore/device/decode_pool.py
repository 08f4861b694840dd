"""Arrow decoding a step straight into pinned memory, for a replay to a GPU (benchmarks/RESULTS.md, issue 23,
seventeenth round): a replay that stages through pinned memory copies each decoded value once on the host, from
Arrow's pageable buffers into the staging arena; with Arrow's large buffers pinned, the arena's joins become copies
to the device from where Arrow decoded them (``sends.py``), and that host copy is gone.

pyarrow takes no allocator from Python, but its dataset reader takes a ``pyarrow.MemoryPool``, and pyarrow's own
``box_memory_pool`` (``pyarrow.lib.__pyx_capi__``) wraps a C++ ``arrow::MemoryPool*`` as one. ``decode_pool.cc``
beside this file is that pool: buffers of ``THRESHOLD`` bytes and more from ``cudaHostAlloc`` (the CUDA runtime
torch loaded, called through its address), in power-of-two sizes, kept for reuse (the pool never shrinks: it holds
what the steps decoding at once took at most); smaller ones from Arrow's default pool. It is compiled once against
the installed pyarrow's headers with the host's C++ compiler (``$CXX``, else ``c++`` / ``g++``) into a cache
(``$TRAJSTORE_CACHE``, else ``$XDG_CACHE_HOME/trajstore``, else ``~/.cache/trajstore``), keyed by the source, the
pyarrow version and the compiler.

``$TRAJSTORE_PINNED_DECODE``: ``0`` turns it off (the arena's host copies, as before); ``1`` on, the first replay to
a GPU building the pool and waiting for it; unset: ``DEFAULT`` (on), the build started in the background by the first
replay to a GPU, whose steps stage as before until it is done (no step waits for a compiler). The ranks of a host
build it once (a file lock in the cache). Where it cannot be had (no CUDA, no compiler, a failed build),
``pinned()`` is None, the replay stages as before, and ``status()`` says why (a warning says it once where the
variable asked for it). With it, Arrow's pool under a deep prefetch takes thirteen sixteenths of the thread budget,
not three quarters (``threads.arrow_share``): no joins run beside it (benchmarks/RESULTS.md, eighteenth round)."""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: ranks building at once each replace the file with a whole one
    fcntl = None  # type: ignore[assignment]

import pyarrow as pa

from ..errors import ConfigWarning, MissingDependencyError, warn
from .pinned import cudart

__all__ = ["Pool", "pinned", "plain", "status", "wanted", "wait", "build", "compiler", "cache_dir", "cuda_host_alloc", "ENV",
           "CACHE_ENV", "DEFAULT", "THRESHOLD"]

ENV = "TRAJSTORE_PINNED_DECODE"
CACHE_ENV = "TRAJSTORE_CACHE"
DEFAULT = True  # unset: on where it can be had, built in the background (benchmarks/RESULTS.md, eighteenth round)
THRESHOLD = 1 << 16  # buffers from this size up come from the pool's own memory
SOURCE = Path(__file__).with_name("decode_pool.cc")

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "pool": the process's pinned Pool or None, "why": the reason it is None


class Pool:
    """A ``pyarrow.MemoryPool`` (``.pool``) of ``decode_pool.cc`` over ``lib`` (``build``): its large buffers from
    the allocator at address ``alloc`` (``cudaHostAlloc``'s signature), or plain cached memory where it is None.
    ``made()``: large buffers made so far (the rest were reused); ``reserved()``: their bytes."""

    def __init__(self, lib: ctypes.CDLL, alloc: int | None, threshold: int = THRESHOLD):
        self._lib = lib
        self._p = lib.cached_pool_make(alloc, threshold)  # never freed: Arrow's buffers may outlive any owner
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        capsule = pa.lib.__pyx_capi__["box_memory_pool"]
        box = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p)(get(capsule, b"PyObject *( arrow::MemoryPool *)"))
        self.pool: pa.MemoryPool = box(self._p)

    def made(self) -> int:
        return self._lib.cached_pool_made(self._p)

    def owns(self, address: int, nbytes: int) -> bool:
        """Whether those bytes lie in one of the pool's own buffers (pinned, where it is the pinned pool): not in
        one of Arrow's default pool, nor in memory a conversion made."""
        return bool(self._lib.cached_pool_owns(self._p, address, nbytes))

    def reserved(self) -> int:
        return self._lib.cached_pool_reserved(self._p)


def compiler() -> str | None:
    """The C++ compiler the pool is built with (``$CXX``, else ``c++`` / ``g++``), or None."""
    for c in (os.environ.get("CXX"), "c++", "g++"):
        if c and shutil.which(c):
            return c
    return None


def cache_dir() -> Path:
    """Where the built pool is kept (see the module doc)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trajstore"


def _libarrow() -> str:
    found = sorted((p for d in pa.get_library_dirs() for p in glob.glob(os.path.join(d, "libarrow.so*"))), key=len)
    if not found:
        raise RuntimeError(f"pyarrow's libarrow.so was not found in {pa.get_library_dirs()}")
    return found[0]


def _compile(cmd: list[str], cxx: str, out: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([tmp if a == "OUT" else a for a in cmd], capture_output=True, text=True)
        if r.returncode:
            raise MissingDependencyError(f"building {SOURCE} with {cxx} against pyarrow {pa.__version__}'s headers "
                                         f"failed ({r.stderr.strip()[-2000:]}); set $CXX to a C++17 compiler, or set "
                                         f"${ENV}=0 to stage replay through pinned memory")
        os.replace(tmp, out)  # whole or not there, even where the lock is not honoured (a network file system)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


STALE_S = 3600  # a build's temporary output this old is a dead build's (a build takes seconds)


def _sweep(dest: Path) -> None:
    """Remove the temporary outputs dead builds left in ``dest`` (a process that exited while its background build
    ran: the compiler finished, nothing renamed its output). Called under the build's lock, so no build of this host
    is writing one; the age spares a build elsewhere where the lock is not honoured (a network file system)."""
    now = time.time()
    for p in dest.glob("decode_pool-*.tmp"):
        try:
            if now - p.stat().st_mtime > STALE_S:
                p.unlink()
        except OSError:  # gone already, or not ours to remove: the build goes on
            pass


def _writable(d: Path) -> bool:
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(d, os.W_OK)


def build(dest: Path | None = None) -> ctypes.CDLL:
    """``decode_pool.cc`` compiled for this pyarrow (once: kept in ``dest``, default ``cache_dir()``, else, where that
    cannot be written, ``trajstore-<uid>`` in the system's temporary folder) and loaded.
    ``MissingDependencyError`` where there is no compiler or the build fails (the compiler's message in it)."""
    cxx = compiler()
    if cxx is None:
        raise MissingDependencyError(f"no C++ compiler ($CXX, c++ or g++) to build {SOURCE}: install one (g++) or set "
                                     f"$CXX, or set ${ENV}=0 to stage replay through pinned memory")
    src = SOURCE.read_bytes()
    lib = _libarrow()
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{pa.get_include()}", str(SOURCE), "-o", "OUT", lib]
    key = hashlib.sha256(b"\0".join([src, pa.__version__.encode(), " ".join(cmd).encode()])).hexdigest()[:16]
    name = f"decode_pool-{pa.__version__}-{key}.so"
    if dest is None:
        dest = cache_dir()
        if not (dest / name).exists() and not _writable(dest):  # a read-only home: the system's temporary folder
            dest = Path(tempfile.gettempdir()) / f"trajstore-{getattr(os, 'getuid', lambda: 'user')()}"
    dest = Path(dest)
    out = dest / name
    if not out.exists():
        dest.mkdir(parents=True, exist_ok=True)
        with open(dest / ".build.lock", "a") as lock:  # the ranks of a host: one builds, the others wait for it
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)
            if not out.exists():
                _sweep(dest)
                _compile(cmd, cxx, out)
    dll = ctypes.CDLL(str(out))  # pyarrow's libarrow, already loaded, resolves its symbols
    dll.cached_pool_make.restype, dll.cached_pool_make.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int64]
    for f in (dll.cached_pool_made, dll.cached_pool_reserved):
        f.restype, f.argtypes = ctypes.c_int64, [ctypes.c_void_p]
    dll.cached_pool_owns.restype = ctypes.c_int
    dll.cached_pool_owns.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return dll


def cuda_host_alloc() -> int:
    """The address of ``cudaHostAlloc`` in the CUDA runtime torch loaded."""
    return ctypes.cast(cudart().cudaHostAlloc, ctypes.c_void_p).value


def wanted() -> bool:
    """Whether ``$TRAJSTORE_PINNED_DECODE`` (else ``DEFAULT``) asks for the pinned decode."""
    v = os.environ.get(ENV, "").strip().lower()
    return DEFAULT if not v else v not in ("0", "false", "no", "off")


def _asked() -> bool:  # the variable set on: the first replay to a GPU waits for the build
    return bool(os.environ.get(ENV, "").strip()) and wanted()


def _make() -> tuple[Pool | None, str | None]:
    try:
        return Pool(build(), cuda_host_alloc()), None
    except Exception as e:  # noqa: BLE001 - the replay stages as before; status() says why
        return None, f"{type(e).__name__}: {e}"


def _background() -> None:
    pool, why = _make()
    with _lock:
        if "pool" not in _state:
            _state["pool"], _state["why"] = pool, why


def pinned() -> Pool | None:
    """This process's pinned pool, or None (see the module doc; ``status()``: why). Where the variable asks for it
    (``1``), the first call builds it and waits; by default (unset) the first call starts the build on a thread and
    returns None until it is done, so no replay step waits for a compiler (the steps before decode as staged)."""
    if not wanted():
        return None
    if "pool" in _state:
        return _state["pool"]
    with _lock:
        if "pool" in _state:
            return _state["pool"]
        if not _asked():
            if "building" not in _state:
                _state["building"] = threading.Thread(target=_background, name="trajstore-decode-pool", daemon=True)
                _state["building"].start()
            return None
        _state["pool"], _state["why"] = _make()
        if _state["pool"] is None:
            warn(f"${ENV}={os.environ[ENV]!r} asked for Arrow decoding into pinned memory, which is not "
                 f"available here ({_state['why']}); replay stages through pinned memory instead "
                 f"(trajstore/device/decode_pool.py)", ConfigWarning)
        return _state["pool"]


def wait(timeout: float | None = None) -> Pool | None:
    """``pinned()``, after waiting up to ``timeout`` seconds for a build it started in the background."""
    pool = pinned()
    t = _state.get("building")
    if pool is None and t is not None:
        t.join(timeout)
        pool = _state.get("pool")
    return pool


def status() -> str:
    """In words: whether a replay to a GPU decodes into pinned memory, and why not where it does not."""
    if not wanted():
        return f"off (${ENV}={os.environ.get(ENV, '')!r}, default {'on' if DEFAULT else 'off'})"
    if "pool" not in _state:
        if "building" in _state:
            return "on, being built (the replay stages through pinned memory until it is)"
        return "on, not built yet (built at the first replay to a GPU)"
    return "on" if _state["pool"] is not None else f"unavailable: {_state['why']}"


def plain(threshold: int = THRESHOLD, dest: Path | None = None) -> Pool:
    """A pool of ``decode_pool.cc`` whose large buffers are plain cached memory (tests of the pinned path on a CPU)."""
    return Pool(build(dest), None, threshold)


def _forget() -> None:  # a forked child has no CUDA context: it builds its own pool if it replays to a GPU
    global _lock
    _state.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)
