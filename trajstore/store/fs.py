"""Where a dump lives: the one place a dump location becomes a file system (docs/ARCHITECTURE.md).

``resolve(path, who, fs=None)`` returns

* a ``pathlib.Path`` for a local path or a ``file://`` URL: the local code path of the store
  (fsync, link, rename; docs/RELIABILITY.md) is used unchanged;
* a :class:`RemotePath` for any other URL (``s3://``, ``gs://``, ``hdfs://``, ``memory://``, any
  fsspec protocol), or for any path when ``fs`` (a ``pyarrow.fs.FileSystem`` or an fsspec file
  system) is given. The store then goes through :mod:`trajstore.store.remote` (object-store commit).

Which library serves a URL (``fs=`` given: that one; else ``TRAJSTORE_FS``):

* ``TRAJSTORE_FS`` unset or ``auto``: fsspec when the protocol's fsspec implementation is installed
  (``s3fs`` for ``s3://``, ``gcsfs`` for ``gs://``: ``pip install 'trajstore[s3]'``), since it
  writes a step with a conditional PUT (``If-None-Match: *``) where the store supports it; else
  pyarrow's own file system for ``s3``/``gs``/``hdfs`` (``pyarrow.fs.FileSystem.from_uri``: no
  conditional write, see docs/RELIABILITY.md); other protocols need fsspec.
* ``TRAJSTORE_FS=pyarrow`` or ``fsspec``: that library.

Credentials, endpoint and region come from the standard places of the library (``AWS_*`` variables
such as ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``, ``AWS_PROFILE``, ``~/.aws/config``, instance
metadata); trajstore never reads or stores them. A URL without a bucket, of an unknown protocol or
whose library is missing is a ConfigError here, before anything is created.
"""

from __future__ import annotations

import importlib.util
import os
import re
import urllib.parse
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from ..errors import ConfigError
from .regular import input_file, read_upto, sha256_of

__all__ = ["resolve", "RemotePath", "Store", "is_remote", "source", "ENV"]

ENV = "TRAJSTORE_FS"
URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
PYARROW = ("s3", "gs", "gcs", "hdfs")  # protocols pyarrow.fs serves itself
FSSPEC_PKG = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
              "abfss": "adlfs", "http": "aiohttp", "https": "aiohttp"}  # hdfs: pyarrow's own


class Store:
    """A file system a remote dump lives on: ``pa`` (a pyarrow FileSystem, fsspec ones wrapped in
    ``PyFileSystem(FSSpecHandler(fs))``), the fsspec file system itself when there is one (its
    ``pipe_file(mode="create")`` is the conditional write), and the URL scheme shown in messages."""

    def __init__(self, pa_fs: pafs.FileSystem, fsspec_fs: Any, scheme: str):
        self.pa, self.fsspec, self.scheme = pa_fs, fsspec_fs, scheme

    @property
    def library(self) -> str:
        return "fsspec" if self.fsspec is not None else "pyarrow"

    @property
    def conditional(self) -> bool:
        """Whether ``put(..., create=True)`` is one conditional request (no race), not check-then-put."""
        return self.fsspec is not None and type(self.fsspec).__module__.split(".")[0] == "s3fs"

    def put(self, key: str, data: bytes | pa.Buffer, create: bool) -> None:
        """Write the object ``key`` whole, in one PUT (or one completed multipart upload): readers see
        all of it or nothing. ``create``: FileExistsError if it exists (conditional where supported)."""
        parent = key.rsplit("/", 1)[0]
        if self.fsspec is not None:
            if set(_protocols(self.fsspec)) & {"file", "local"}:  # a real folder must exist first
                self.fsspec.makedirs(parent, exist_ok=True)
            self.fsspec.pipe_file(key, bytes(data) if isinstance(data, pa.Buffer) else data,
                                  mode="create" if create else "overwrite")
            return
        if create and self.pa.get_file_info(key).type != pafs.FileType.NotFound:
            raise FileExistsError(f"{key} exists")
        if self.pa.type_name not in ("s3", "gcs"):  # a file system with real folders (local, hdfs)
            self.pa.create_dir(parent, recursive=True)
        with self.pa.open_output_stream(key) as out:
            out.write(data)

    def __repr__(self) -> str:
        return f"Store({self.scheme}://, {self.library})"


class RemotePath:
    """A name in a remote dump (``<bucket>/<key>``) with the part of ``pathlib.Path`` the store's
    name handling uses: ``/``, ``name``, ``parent``, ``with_suffix``, ``exists``, ``is_dir``,
    ``iterdir``, ``read_text``... ``str()`` is its URL. It has no ``__fspath__``: ``open``/``os``
    calls on it fail instead of touching a local file."""

    __slots__ = ("store", "key", "_type", "_size")

    def __init__(self, store: Store, key: str, _type: Any = None, _size: int | None = None):
        self.store, self.key, self._type, self._size = store, key.rstrip("/"), _type, _size

    # -- names
    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(self.store, f"{self.key}/{name}")

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.store, self.key.rsplit("/", 1)[0]) if "/" in self.key else self

    @property
    def suffix(self) -> str:
        n = self.name
        return n[n.rfind("."):] if "." in n.lstrip(".") else ""

    def with_suffix(self, suffix: str) -> RemotePath:
        n = self.name
        return self.parent / ((n[: len(n) - len(self.suffix)] if self.suffix else n) + suffix)

    def resolve(self) -> RemotePath:
        return self

    def __str__(self) -> str:
        return f"{self.store.scheme}://{self.key}"

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.store is self.store and other.key == self.key

    def __hash__(self) -> int:
        return hash((id(self.store), self.key))

    # -- the file system
    def _info(self) -> pafs.FileInfo:
        try:
            return self.store.pa.get_file_info(self.key)
        except FileNotFoundError:
            return pafs.FileInfo(self.key, pafs.FileType.NotFound)

    def _kind(self) -> Any:
        if self._type is None:
            self._type = self._info().type
        return self._type

    def exists(self) -> bool:
        return self._info().type != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self._info().type == pafs.FileType.File

    def is_dir(self) -> bool:
        return self._kind() == pafs.FileType.Directory

    def listdir(self) -> list[str]:
        """The names in this folder (FileNotFoundError if none); the library pages the listing."""
        return [RemotePath(self.store, i.path).name for i in self._list()]

    def _list(self) -> list[pafs.FileInfo]:
        if self.store.fsspec is not None:  # one listing (FSSpecHandler would make two)
            try:
                entries = self.store.fsspec.ls(self.key, detail=True)
            except FileNotFoundError:
                entries = []
            out = [pafs.FileInfo(e["name"].rstrip("/"), pafs.FileType.Directory if e.get("type") == "directory"
                                 else pafs.FileType.File, size=e.get("size")) for e in entries
                   if e["name"].rstrip("/") != self.key]
        else:
            sel = pafs.FileSelector(self.key, allow_not_found=True, recursive=False)
            out = [i for i in self.store.pa.get_file_info(sel) if i.path.rstrip("/") != self.key]
        if not out:
            raise FileNotFoundError(f"{self}: no such folder")
        return out

    def iterdir(self) -> list[RemotePath]:
        return [RemotePath(self.store, i.path, i.type, i.size) for i in self._list()]

    def stat(self) -> os.stat_result:
        info = self._info()
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"{self}: no such object")
        mtime = info.mtime_ns or 0
        if not mtime and self.store.fsspec is not None:  # FSSpecHandler does not pass it on
            try:
                mtime = int(self.store.fsspec.modified(self.key).timestamp() * 1e9)
            except Exception:  # noqa: BLE001 - a file system that does not know: 0, "unknown"
                mtime = 0
        return os.stat_result((0o100644, 0, 0, 1, 0, 0, info.size or 0, mtime // 10**9, mtime // 10**9,
                               mtime // 10**9))

    def read_buffer(self) -> pa.Buffer:
        with self.store.pa.open_input_stream(self.key) as f:
            return f.read_buffer()

    def read_bytes(self) -> bytes:
        return self.read_buffer().to_pybytes()

    def read_at_most(self, n: int) -> bytes:
        """The first ``n`` bytes of the object (all of it if smaller): one bounded GET."""
        with self.store.pa.open_input_stream(self.key) as f:
            return read_upto(f.read, n)  # never one read(n): it allocates n up front

    def sha256(self) -> str:
        """The object's SHA-256, streamed (``regular.CHUNK`` bytes in memory at a time)."""
        with self.store.pa.open_input_stream(self.key) as f:
            return sha256_of(f.read)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def open_input(self) -> Any:
        """A random-access pyarrow file (Parquet reads fetch the footer, then the columns read)."""
        return self.store.pa.open_input_file(self.key)

    def unlink(self, missing_ok: bool = False) -> None:
        """Delete this one object, its key taken literally: fsspec's ``rm`` (what pyarrow's
        ``FSSpecHandler.delete_file`` calls) expands ``[ ] * ?`` as a glob, and s3fs would delete
        another run's objects (``exp[1]`` matching ``exp1``); ``rm_file`` deletes the one key."""
        try:
            if self.store.fsspec is None:
                self.store.pa.delete_file(self.key)
                return
            if not missing_ok and not self.exists():
                raise FileNotFoundError(f"{self}: no such object")
            self.store.fsspec.rm_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing: an object store has no folders, a key's prefix is one."""


def _protocols(fs: Any) -> tuple:
    return tuple(fs.protocol) if isinstance(fs.protocol, tuple | list) else (fs.protocol,)


def is_remote(p: Any) -> bool:
    return isinstance(p, RemotePath)


def source(f: Path | RemotePath) -> Any:
    """What pyarrow's Parquet readers read ``f`` from: a checked local regular file (``store/regular.py``:
    never a FIFO or a device), or a remote random-access file."""
    return f.open_input() if isinstance(f, RemotePath) else input_file(f)


def resolve(path: Any, who: str, fs: Any = None) -> Path | RemotePath:
    """The dump location ``path`` for ``who`` (``Writer('...')``...), as a local Path or a RemotePath
    (see the module doc). Builds nothing on the store and creates nothing."""
    if isinstance(path, RemotePath):
        return path
    s = os.fspath(path)
    m = URL_RE.match(s) if isinstance(s, str) else None
    scheme = m.group(1).lower() if m else None
    if fs is None and (m is None or scheme == "file"):
        return Path(s[len(m.group(0)):] or "/") if m else Path(s)
    rest = s[len(m.group(0)):] if m else s
    if scheme in (*PYARROW, "s3a") and "?" in rest:
        raise ConfigError(f"{who}: {s!r} has the character '?': in an object-storage URL pyarrow reads what follows "
                          "it as options and s3fs as a version, so it cannot name a dump literally; rename the "
                          "folder, and pass options through the environment (AWS_ENDPOINT_URL...) or fs=")
    if fs is not None:
        return _given(fs, s, rest, scheme, who)
    if scheme in ("s3", "s3a", "gs", "gcs") and not rest.split("/", 1)[0]:
        raise ConfigError(f"{who}: {s!r} names no bucket; write {scheme}://<bucket>/<folder of the dump>")
    lib = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if lib not in ("auto", "pyarrow", "fsspec"):
        raise ConfigError(f"{who}: {ENV}={lib!r}; use 'pyarrow', 'fsspec' or 'auto' (or unset it)")
    if lib == "fsspec" or (lib == "auto" and (scheme not in PYARROW or _has(FSSPEC_PKG.get(scheme)))):
        return _fsspec(s, scheme, who)
    if scheme not in PYARROW:
        raise ConfigError(f"{who}: {s!r}: pyarrow has no {scheme}:// file system ({ENV}=pyarrow); "
                          f"unset {ENV} to use fsspec, or use one of {', '.join(p + '://' for p in PYARROW)}")
    try:  # the path percent-encoded: pyarrow's URI parser takes it literally ('#', '[', '%'... included)
        pa_fs, key = pafs.FileSystem.from_uri(("gs" if scheme == "gcs" else scheme) + "://"
                                              + urllib.parse.quote(rest, safe="/:@"))
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ConfigError(f"{who}: pyarrow cannot open {s!r} ({e}); check the URL, and for hdfs:// the Hadoop "
                          f"client (libhdfs, HADOOP_HOME); or install the fsspec package "
                          f"({FSSPEC_PKG.get(scheme, 'fsspec')}) and set {ENV}=fsspec") from None
    return RemotePath(Store(pa_fs, None, scheme), key)


def _has(pkg: str | None) -> bool:
    """Whether ``pkg`` is installed (looked up, not imported)."""
    try:
        return pkg is not None and importlib.util.find_spec(pkg) is not None
    except (ImportError, ValueError):
        return False


def _fsspec(url: str, scheme: str, who: str) -> RemotePath:
    try:
        import fsspec
    except ImportError:
        raise ConfigError(f"{who}: {url!r} needs fsspec: pip install 'trajstore[s3]' (or fsspec and "
                                     f"the package of {scheme}://)") from None
    try:
        # no listings cache: a Reader's refresh must see the steps committed since (s3fs caches by default)
        fs, key = fsspec.core.url_to_fs(url, use_listings_cache=False)
    except ImportError as e:
        raise ConfigError(f"{who}: {url!r}: the fsspec implementation of {scheme}:// is not "
                                     f"installed ({e}); pip install {FSSPEC_PKG.get(scheme, 'it')}") from None
    except (ValueError, OSError, TypeError) as e:
        raise ConfigError(f"{who}: {url!r} is not a URL fsspec knows or can open ({e}); check the protocol "
                          "(s3://, gs://, hdfs://, az://, memory://...)") from None
    return _wrap(fs, key, scheme)


def _wrap(fs: Any, key: str, scheme: str) -> RemotePath:
    if isinstance(fs, pafs.FileSystem):
        return RemotePath(Store(fs, None, scheme), key)
    handler = pafs.FSSpecHandler(fs)
    return RemotePath(Store(pafs.PyFileSystem(handler), fs, scheme), key)


def _given(fs: Any, s: str, rest: str, scheme: str | None, who: str) -> RemotePath:
    """``path`` on the file system the caller gave (a pyarrow FileSystem or an fsspec one)."""
    if isinstance(fs, pafs.FileSystem):
        return RemotePath(Store(fs, None, scheme or fs.type_name), rest)
    if hasattr(fs, "pipe_file") and hasattr(fs, "_strip_protocol"):
        return _wrap(fs, fs._strip_protocol(s), scheme or str(_protocols(fs)[0]))
    raise ConfigError(f"{who}: fs must be a pyarrow.fs.FileSystem or an fsspec file system, "
                      f"got {type(fs).__name__}")
