"""The on-disk format, one owner: the spec as typed data, dtypes, value checks, and one encode/decode
pair per node kind. ``trajstore/schema.py`` is its front door; docs/FORMAT.md is the normative text.

Nothing here touches the file system: a batch becomes an Arrow table (with its spec in the schema
metadata) and back. The shared vocabulary sits at the top of the room, every sub-room below it:

* ``spec`` - the spec's node kinds as typed data, the step envelope, the format version, column
  names, the predicates other modules ask of nodes; ``dtypes`` - dtype names and storage types;
  ``limits`` - the one set of limits of writer and reader and the decode budget;
* ``values`` - checks of tensor-likes and JSON values; ``typed`` - the typed encoding of the
  non-tensor values plain JSON cannot hold exactly (numpy scalars, tuples, bytes...); ``arrow`` -
  building and reading Arrow columns.

The sub-rooms, lowest first (each imports the shared modules and the rooms before it, never after):

* ``file/`` - file checks and Parquet options (validate, envelope, parquet, columns);
* ``batch/`` - batch structure, asked once per batch (layout, check, containers, classes);
* ``codec/`` - one encode/decode pair per node kind and the walks over them (tensors, sequences,
  grouped, encoder, decoder, rows);
* ``shard/`` - the shards of N ranks joined, sliced and partitioned (shards, join, masks, elements, ids).

May import: ``trajstore.errors``, ``trajstore.base``, ``trajstore.integrations``; pyarrow, numpy, torch.
"""
