"""What trajstore knows about each RL framework's batches, one module per framework.

The format layer consults these modules; they import nothing of trajstore but the error
hierarchy, and never import a framework at module level: a framework is imported only when it is
installed and a step needs it (``load``), so trajstore works, and reads every dump, without any of
them.

* ``verl``: verl's and ROLL's ``DataProto`` classes, restored on replay whatever the import order.
* ``trl``: TRL/Qwen-VL ``pixel_values`` (and ``image_grid_thw``) split per sample by
  ``image_grid_thw`` and ``num_images``, stored as segmented tensors (docs/FORMAT.md 3.9).
* ``areal``: AReaL's single-controller ``RTensor`` values, stored as their local tensors.
* ``openrlhf``: OpenRLHF's ``Experience`` dataclass (and lists of it), restored on replay; its
  action-width fields.
* ``skyrl``: SkyRL's ``TrainingInputBatch`` / ``TrainingOutputBatch`` (dicts with ``.metadata``),
  its replay-buffer ``Experience`` and the ``TrajectoryID`` values of its generator output.

Each module says what it adapts and where the format stores it (docs/frameworks/<name>.md has the
user-facing side).

May import: ``trajstore.errors`` only (and a framework, by a fixed name, when installed).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

__all__ = ["load", "load_class", "class_path"]

log = logging.getLogger("trajstore.reader")
_failed: set[str] = set()  # framework modules whose import failed once (not tried again)


def load(mod_name: str) -> None:
    """Import framework module ``mod_name`` if its package is installed and it is not imported yet.
    Only names from this package's own lists are ever passed here (never a name read from a file);
    an import that fails is logged once and not tried again, and the caller falls back. A module
    another thread is still importing (in ``sys.modules``, its body not yet run) is waited for:
    ``import_module`` takes the module's import lock, so its classes are defined on return."""
    if mod_name in _failed:
        return
    try:
        if mod_name not in sys.modules and importlib.util.find_spec(mod_name.partition(".")[0]) is None:
            return
        importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - a broken install of the framework must not fail the read
        _failed.add(mod_name)
        log.warning("trajstore: %s is installed but cannot be imported (%s: %s); trajstore goes on "
                    "without it", mod_name, type(e).__name__, e)


def class_path(cls: type) -> str:
    """``module:qualname`` of a class, the name a step file records."""
    return f"{cls.__module__}:{cls.__qualname__}"


def load_class(path: str, allowed) -> type | None:
    """The class ``path`` (``module:qualname``) names if it is one of ``allowed`` (this package's own
    lists, never a name read from a file alone) and its package is installed (imported here if
    needed); else None."""
    if path not in allowed:
        return None
    mod_name, _, qual = path.partition(":")
    load(mod_name)
    obj = sys.modules.get(mod_name)
    for part in qual.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    return obj if isinstance(obj, type) else None
