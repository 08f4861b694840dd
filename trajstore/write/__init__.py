"""The write path: ``Writer.append`` returns at once, the work runs in the background.

* ``writer`` - ``Writer``: ``append`` on the caller's thread, the bounded admission, ``flush``/``close``
  (front door ``trajstore.writer``);
* ``reports`` - what a writer tells of its steps: ``Committed`` records to ``on_commit``, background
  failures (skipped records, the ``WriterError`` raised or logged), waits at the limit, ``stats`` counters;
* ``pool`` - the background threads: several steps encoded and written at once, committed in order;
* ``snapshot`` - what ``append`` keeps of a batch (copies into reused buffers, its meta, a shard's rank).

May import: ``trajstore.device``, ``trajstore.store``, ``trajstore.format``, ``trajstore.base``,
``trajstore.errors``. Never ``trajstore.read``, not even through a third module.
"""
