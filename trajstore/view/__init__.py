"""``trajstore view``: read-only web pages over a dump (run curves, step tables, coloured tokens, diffs).

Needs the ``view`` extra (``pip install 'trajstore[view]'``: starlette, uvicorn, plotly). ``data``: what the
pages show, read column by column; ``pages``: each page's JSON; ``app``: the Starlette app; ``export``: one
self-contained HTML file.

May import: ``trajstore.inspection``, ``trajstore.read`` and the layers below; never the writer.
"""
