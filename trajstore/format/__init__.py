"""The on-disk format, one owner: the spec as typed data, dtypes, value checks, and one encode/decode
pair per node kind. ``trajstore/schema.py`` is its front door; docs/FORMAT.md is the normative text.

Nothing here touches the file system: a batch becomes an Arrow table (with its spec in the schema
metadata) and back. The modules, lowest first:

* ``spec`` - the spec's node kinds as typed data, the step envelope, the format version, column
  names, the predicates other modules ask of nodes; ``dtypes`` - dtype names and storage types;
* ``values`` - checks of tensor-likes and JSON values; ``typed`` - the typed encoding of the
  non-tensor values plain JSON cannot hold exactly (numpy scalars, tuples, bytes...); ``layout`` - the batch form (padded,
  packed, plain) and token masks; ``arrow`` - building and reading Arrow columns;
* ``check`` - the one walk over a batch's structure (``Writer.append`` and the encoder);
* ``tensors``, ``sequences`` - each node kind's encode and decode, side by side;
* ``encoder``, ``decoder`` - the walks over a batch and over a spec; ``containers`` - TensorDict
  and DataProto wrapping; ``validate`` - a stored spec checked against its file before decoding;
  ``rows`` - a step's trajectories one by one, for the inspection tools.
"""
