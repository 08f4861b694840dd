"""The GPU path: pinned host memory, CUDA streams and events, device moves (the torch bridge layer).

* ``tree`` - the one tensor-tree walker (``map_tree``, ``map_tensors``);
* ``pinned`` - pinned pools, the per-device copy stream, the writer's device -> host copies
  (``snapshot_cuda``);
* ``bridge`` - the reader's staging arenas and side-stream host -> device copies (``stage``,
  ``launch``, ``to_device``); front door ``trajstore.torch_bridge`` (with ``pinned`` and ``tree``);
* ``plan`` - what a padded step stages, on the host, for its ``[B, T]`` fields to be built on the device;
* ``pad`` - those outputs (``Pad``, ``Flat``, ``Plan``) and the torch ops that build them;
* ``index`` - the index tensors of those scatters and gathers.
* ``decode_pool`` - Arrow's memory pool of pinned buffers a replay to a GPU decodes into (the default where a C++
  compiler builds it), built in the background on first use;
* ``sends`` - the values a step sends to the device from where Arrow decoded them, instead of the arena.

May import: ``trajstore.format``, ``trajstore.store``, ``trajstore.base``, ``trajstore.errors``.
Never the write or read rooms (they use it; it imports neither).
"""
