"""verl (and ROLL, whose ``DataProto`` is verl's shape).

A ``DataProto`` is stored by ``format/batch/containers.py`` as its tensors and non-tensor arrays side by
side plus a container tag naming its class. On replay the class comes back when it is one of
``DATAPROTO_CLASSES`` and its package is installed (imported here if needed, whatever the import
order of the reading process); any other class a file names is used only if the reading process
has already imported it.
"""

from __future__ import annotations

from . import load

__all__ = ["DATAPROTO_CLASSES", "load_dataproto_module"]

# classes a step may come back as even if the reading process has not imported them yet: a fixed
# list of this library's, never a name taken from a file
DATAPROTO_CLASSES = frozenset({"verl.protocol:DataProto", "roll.distributed.scheduler.protocol:DataProto"})


def load_dataproto_module(path: str) -> None:
    """Import the module of ``path`` (``module:qualname``) if it is one of ``DATAPROTO_CLASSES``."""
    if path in DATAPROTO_CLASSES:
        load(path.partition(":")[0])
