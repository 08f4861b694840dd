"""The read path: a dump's steps decoded into tensors, replayed with read-ahead, sliced per rank.

* ``reader`` - ``Reader``: open, list, check, ``read``, ``column``, ``iter`` (front door ``trajstore.reader``);
* ``decode`` - one step file's columns read (those a read of ``columns`` in ``layout`` needs) and decoded,
  into the pinned arena for a GPU;
* ``shards`` - a step written by N ranks, a replaying rank's slice, ``Reader.shard``;
* ``prefetch`` - read-ahead for ``Reader.iter`` and the Recorder's replay;
* ``tables`` - ``Reader.to_pandas``, ``Reader.duckdb``, the rows of a step.

May import: ``trajstore.device``, ``trajstore.store``, ``trajstore.format``, ``trajstore.base``,
``trajstore.errors``. Never ``trajstore.write``, not even through a third module.
"""
