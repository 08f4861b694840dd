"""The on-disk format, one owner: the spec as typed data, dtypes, value checks, and one encode/decode
pair per node kind. ``trajstore/schema.py`` is its front door; docs/FORMAT.md is the normative text.

Nothing here touches the file system: a batch becomes an Arrow table (with its spec in the schema
metadata) and back.
"""
