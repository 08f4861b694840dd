"""The environment fingerprint of a dump, its comparison at replay, and ``deterministic()``.

``collect()`` is what a dump's manifest stores under ``"environment"``.  ``compare()``
lists every difference that can change numerics (library versions, world size, device,
determinism switches, thread count, the environment variables in ``ENV_VARS``).  ``device``
is the machine's GPU name (``"cpu"`` without CUDA; None when CUDA had not been initialized,
as collecting never creates a CUDA context);
keys in ``INFORMATIONAL`` (host, command line, git commit...) are kept for the record
but never compared: replaying on another host, or with changed training code, is the
point of a replay.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import random
import socket
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pyarrow

# torch is imported by the functions that ask it (collect, deterministic), not here: the manifest's
# readers (`trajstore info`, `sql`, `verify`) import this module without loading torch (docs/CLI.md).

from .._version import __version__

__all__ = ["collect", "compare", "format_differences", "deterministic", "ENV_VARS", "INFORMATIONAL"]

ENV_VARS = ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS",
            "PYTHONHASHSEED", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_CBWR", "NVIDIA_TF32_OVERRIDE",
            "TORCH_CUDNN_V8_API_DISABLED", "CUDA_LAUNCH_BLOCKING")
LIBRARIES = ("tensordict", "transformers", "flash-attn", "vllm", "sglang", "deepspeed", "megatron-core",
             "verl", "accelerate", "triton")
INFORMATIONAL = frozenset({"host", "platform", "argv", "git_commit", "rank", "local_rank"})

_applied: dict | None = None  # what deterministic() set, recorded in the fingerprint


def _git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return r.stdout.strip() or None if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _int_env(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def world() -> tuple[int, int, int]:
    """(world_size, rank, local_rank): torch.distributed when initialized, else RANK/WORLD_SIZE env."""
    dist = sys.modules.get("torch.distributed")  # not imported: not initialized either
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank(), _int_env("LOCAL_RANK", 0)
    return _int_env("WORLD_SIZE", 1), _int_env("RANK", 0), _int_env("LOCAL_RANK", 0)


def _versions() -> dict:
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _backends() -> dict:
    import torch

    b = torch.backends
    with warnings.catch_warnings():  # some torch versions deprecate the tf32 flags
        warnings.simplefilter("ignore")
        return {
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn_enabled": b.cudnn.enabled,
            "cudnn_deterministic": b.cudnn.deterministic,
            "cudnn_benchmark": b.cudnn.benchmark,
            "cudnn_allow_tf32": b.cudnn.allow_tf32,
            "matmul_allow_tf32": b.cuda.matmul.allow_tf32,
            "matmul_fp16_reduced_precision": b.cuda.matmul.allow_fp16_reduced_precision_reduction,
            "matmul_bf16_reduced_precision": b.cuda.matmul.allow_bf16_reduced_precision_reduction,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        }


def collect() -> dict:
    """The fingerprint of this process (JSON-able)."""
    import torch

    world_size, rank, local_rank = world()
    cuda = torch.cuda.is_available()
    # the GPU's name only once CUDA is initialized: collecting must not create a CUDA context
    gpu = torch.cuda.get_device_name(torch.cuda.current_device()) if cuda and torch.cuda.is_initialized() else None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "argv": list(sys.argv),
        "git_commit": _git_commit(),
        "trajstore": __version__,
        "torch": torch.__version__,
        "pyarrow": pyarrow.__version__,
        "numpy": np.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "libraries": _versions(),
        "device": gpu if cuda else "cpu",
        "device_count": torch.cuda.device_count() if cuda else 0,
        "world_size": world_size,
        "rank": rank,
        "local_rank": local_rank,
        "num_threads": torch.get_num_threads(),
        "backends": _backends(),
        "env": {k: os.environ.get(k) for k in ENV_VARS},
        "deterministic": _applied,
    }


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "deterministic":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def compare(recorded: dict, current: dict | None = None) -> dict[str, tuple[Any, Any]]:
    """``{key: (recorded, current)}`` for every compared key that differs (dotted keys
    for nested ones: ``"env.NCCL_ALGO"``, ``"backends.cudnn_benchmark"``).  A key absent
    on one side counts as None."""
    cur = _flat(collect() if current is None else current)
    rec = _flat(recorded or {})
    out = {}
    for k in sorted(set(rec) | set(cur)):
        if k.split(".")[0] in INFORMATIONAL:
            continue
        a, b = rec.get(k), cur.get(k)
        if k == "device" and (a is None or b is None):
            continue  # a GPU machine that had not initialized CUDA yet: unknown, not different
        if a != b:
            out[k] = (a, b)
    return out


def format_differences(diffs: dict) -> str:
    return "; ".join(f"{k}: recorded {a!r}, now {b!r}" for k, (a, b) in diffs.items())


def deterministic(seed: int | None = None, *, warn_only: bool = False) -> dict:
    """Set the usual switches for bit-exact reruns and record them in the fingerprint.

    Sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (unless already set; it must be set before
    the first cuBLAS call), ``torch.use_deterministic_algorithms(True)``,
    ``cudnn.deterministic=True``, ``cudnn.benchmark=False``, and with ``seed`` seeds
    ``random``, numpy and torch (every device).  TF32 and NCCL settings are left as they
    are but recorded, so a replay with different ones is reported.  Returns what was set.
    """
    import torch

    global _applied
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            warnings.warn("trajstore.deterministic(): CUDA is already initialized; CUBLAS_WORKSPACE_CONFIG "
                          "may come too late for cuBLAS: call deterministic() before any CUDA work",
                          RuntimeWarning, stacklevel=2)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if seed is not None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
    _applied = {"seed": seed, "warn_only": warn_only,
                "CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"]}
    return dict(_applied)
