"""Shards: the steps written by N ranks, joined, sliced and partitioned (docs/FORMAT.md 3.12, 3.13).

* ``shards`` - a step's shards joined into the logical batch (``join``), its rows sliced (``take``),
  token counts and the replaying ranks' partitions;
* ``join`` - the shards' specs merged, with ``masks`` (mask groups and pads) and ``elements``
  (per-row elements);
* ``ids`` - trajectory ids ``(step, row)``, implicit or stored in ``traj_step``/``traj_row``.

May import: the format's shared modules, ``format/batch``, ``format/codec``, ``trajstore.errors``,
``trajstore.base``.
"""
