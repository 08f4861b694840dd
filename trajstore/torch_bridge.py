"""``trajstore.torch_bridge``: front door of the GPU path (``trajstore/device/``); the code is in
``trajstore.device.pinned`` (pinned pools, the writer's device -> host copies), ``trajstore.device.bridge``
(the reader's staging and host -> device copies) and ``trajstore.device.tree`` (the tensor-tree walker)."""

from .device.pinned import (
    PinnedPool,
    snapshot_cuda,
)
from .device.bridge import (
    Arena,
    Staged,
    host_arena,
    stage,
    launch,
    to_device,
    as_device,
    on_device,
)
from .device.tree import (
    map_tree,
    map_tensors,
)

__all__ = ["PinnedPool", "Arena", "Staged", "snapshot_cuda", "host_arena", "stage", "launch", "to_device", "as_device", "on_device", "map_tree", "map_tensors"]
