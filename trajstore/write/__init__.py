"""The write path: ``Writer.append`` returns at once, the work runs in the background.

* ``writer`` - ``Writer``: the bounded admission, errors and stats, ``on_commit`` reports (front door
  ``trajstore.writer``);
* ``pool`` - the background threads: several steps encoded and written at once, committed in order;
* ``snapshot`` - what ``append`` keeps of a batch (copies into reused buffers, its meta, a shard's rank).

May import: ``trajstore.device``, ``trajstore.store``, ``trajstore.format``, ``trajstore.base``,
``trajstore.errors``. Never ``trajstore.read``, not even through a third module.
"""
