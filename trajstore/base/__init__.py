"""The base room: what every layer above may use and that imports nothing of trajstore but ``errors``.

* ``text`` - step ranges and byte sizes as users type and read them;
* ``threads`` - the thread budget of a writer or reader (the cores this process may use shared among
  the ranks of its host, never ``OMP_NUM_THREADS``) and the pools it sizes;
* ``arrow_pool`` - Arrow's process-wide CPU pool raised to a read's thread budget while the read is in
  flight, and restored once no read holds it;
* ``fingerprint`` - the environment fingerprint and ``trajstore.deterministic()``.

With ``trajstore/errors.py`` (the one error hierarchy) and ``trajstore/_version.py`` this is the lowest layer.
May import: ``trajstore.errors``, ``trajstore._version``, the standard library, numpy, pyarrow (``arrow_pool``
only; torch only inside the functions that need it).
"""
