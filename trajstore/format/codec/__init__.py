"""Codecs: one encode/decode pair per node kind, and the walks that dispatch to them.

* ``tensors`` - tensor fields (per token, per sample, padding values, inline tensors);
* ``sequences`` - per-trajectory lists, their cells, values and structs;
* ``grouped`` - a list batch's ``[g, T]`` groups and OpenRLHF's ``[g, T-1]`` action cells;
* ``encoder`` / ``decoder`` - the walks over a batch's plan and over a spec, and layout conversion;
* ``late`` - a packed read to a GPU: int64-as-int32 and bool token columns joined as stored, converted
  on the device (``device/bridge.py``);
* ``rows`` - one decoded step as one dict per trajectory (traces, diff, ``to_pandas``).

May import: the format's shared modules, ``format/batch``, ``trajstore.errors``, ``trajstore.base``.
Never a shard or file module.
"""
