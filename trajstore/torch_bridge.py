"""``trajstore.torch_bridge``: front door of the GPU path (``trajstore/device/``); the code is in ``trajstore.device.bridge``."""

from .device.bridge import (
    PinnedPool,
    Arena,
    Staged,
    snapshot_cuda,
    host_arena,
    stage,
    launch,
    to_device,
    as_device,
    on_device,
    map_tree,
    map_tensors,
)

__all__ = ["PinnedPool", "Arena", "Staged", "snapshot_cuda", "host_arena", "stage", "launch", "to_device", "as_device", "on_device", "map_tree", "map_tensors"]
