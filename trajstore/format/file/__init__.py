"""File checks and Parquet options: what a stored file may hold before anything is decoded.

* ``validate`` - a file's spec against its Parquet schema, and the memory a decode may allocate;
  ``checker`` - what each node's check asks of the file (its columns, dtypes, row indices) and the running
  decode budget; ``envelope`` - the envelope's parts (a shard's rank, container wrappers, struct key orders);
* ``parquet`` - encodings, codecs (``compression=``), row groups, a step's row groups read on Arrow's
  pool raised to the reader's thread budget (``base/arrow_pool.py``); ``joining`` - a read's token
  columns joined row group by row group as the reader yields them;
* ``columns`` - one column type per name in a split (docs/FORMAT.md 3.10).

May import: the format's shared modules (spec, dtypes, limits, values, typed, arrow), ``trajstore.errors``,
``trajstore.base``. Never a batch, codec or shard module.
"""
