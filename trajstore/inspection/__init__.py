"""Looking at dumps: ``describe`` (what is in a dump), ``diff``, readable ``traces`` (and their Trackio
export), and ``verify``. Each works through ``trajstore.reader``; nothing here writes a dump.

May import: ``trajstore.read``, ``trajstore.write`` (``importers`` writes the dumps it imports), and every
layer below them.
"""
