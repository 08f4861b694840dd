"""The dump on disk: its folder layout and manifest, durable atomic commits with checksums, records of
skipped steps, and the per-split column index. Nothing here knows how a batch is encoded beyond the
spec nodes the index keeps (``trajstore.format``).

May import: ``trajstore.format``, ``trajstore.base``, ``trajstore.errors``; fsspec and pyarrow's file systems.
"""
