"""The dump/replay switch a training loop flips.

* ``config`` - ``DumpReplayConfig`` from dicts and ``TRAJSTORE_*``, where a dump goes, every variable
  the package reads (front door ``trajstore.config``);
* ``recorder`` - ``Recorder``: dump, replay, off (front door ``trajstore.recorder``);
* ``log`` - its log lines and disk estimate.

May import: ``trajstore.write``, ``trajstore.read``, and every layer below them.
"""
