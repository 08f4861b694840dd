"""``trajstore view PATH --export FILE.html``: one self-contained HTML file (no network needed to open it).

The file holds plotly's bundle (from the ``plotly`` package), the page scripts (``app.VIEW_SCRIPTS``, in
the order the server's pages load them) and style of ``static/``, and the data as JSON in
``<script id="trajstore-data" type="application/json">`` with ``<``, ``>`` and ``&`` written as
``\\u003c``... (a ``</script>`` in a completion cannot end the block; the script reads it with
``JSON.parse`` and sets every text with ``textContent``). Content: the run
curves of every split, and for each chosen step (``steps``, default: the last step of the split) its
trajectory table and its first ``per_step`` trajectories with their tokens. Element ids in the file:
``curve-<metric>`` (default split) / ``curve-<split>-<metric>`` as on the run page,
``traj-table-<split>-<step>``, ``tokens-<split>-<step>-<index>``, ``colour-<split>-<step>-<index>``.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from .app import PLOTLY_JS, STATIC, VIEW_SCRIPTS
from .pages import View


def _safe_json(obj: Any) -> str:
    s = json.dumps(obj, allow_nan=False, separators=(",", ":"))
    return s.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def _inline_js(text: str) -> str:
    return text.replace("</script", "<\\/script")


def export(view: View, out: str | Path, steps: list[int] | None = None, per_step: int = 4) -> Path:
    """Write the export of ``view`` to ``out`` and return its path."""
    runs = [view.run(view.split)] + [view.run(s) for s in view.splits if s != view.split]
    r = view.reader(None)
    chosen = steps if steps is not None else r.steps[-1:]
    step_data, trajs = [], []
    for s in chosen:
        d = view.step(None, s)
        step_data.append(d)
        for i in range(min(per_step, len(d["rows"]))):
            trajs.append(view.traj(None, s, i))
    data = {"path": str(view.path), "runs": runs, "steps": step_data, "trajs": trajs}
    title = html.escape(f"trajstore export: {view.path}")
    page = (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>\n'
            f'<style>{(STATIC / "view.css").read_text()}</style></head>\n'
            f'<body data-page="run" data-export="1" data-split="{html.escape(view.split, quote=True)}">'
            f'<h1>{title}</h1><div id="app"></div>\n'
            f'<script id="trajstore-data" type="application/json">{_safe_json(data)}</script>\n'
            + "".join(f'<script>{_inline_js(p.read_text(encoding="utf-8"))}</script>\n'
                      for p in [PLOTLY_JS] + [STATIC / n for n in VIEW_SCRIPTS])
            + '</body></html>\n')
    out = Path(out)
    out.write_text(page, encoding="utf-8")
    return out
