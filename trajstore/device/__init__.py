"""The GPU path: pinned host memory, CUDA streams and events, device moves (the torch bridge layer).

* ``bridge`` - pinned pools, staging arenas, side-stream copies, the one tensor-tree walker
  (``map_tree``); front door ``trajstore.torch_bridge``;
* ``pad`` - a padded step replayed to a GPU, its ``[B, T]`` fields built on the device;
* ``index`` - the index tensors of those scatters and gathers.

May import: ``trajstore.format``, ``trajstore.store``, ``trajstore.base``, ``trajstore.errors``.
Never the write or read rooms (they use it; it imports neither).
"""
