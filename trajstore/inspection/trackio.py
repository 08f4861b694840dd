"""Export readable traces to Trackio (``pip install 'trajstore[trackio]'``), locally and offline.

Each step becomes one ``trackio.log`` call at that step: ``traces`` holds one ``trackio.Trace`` per
kept trajectory (OpenAI-style messages: prompt -> ``user``, model turns -> ``assistant``,
environment turns -> ``tool``; a maskless sequence -> ``user``), with step, index, reward, versions,
lengths and the other scalar fields as metadata; ``trajstore/trajectories`` and
``trajstore/rejected`` count the step's kept and rejected trajectories. Trackio stores runs under
``$TRACKIO_DIR`` (default ``~/.cache/huggingface/trackio``); nothing is uploaded unless Trackio
itself is configured to.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterable

from ..errors import MissingDependencyError
from .traces import traces

ROLES = {"prompt": "user", "model": "assistant", "env": "tool", "sequence": "user"}


def _messages(t: dict) -> list[dict]:
    msgs = t.get("messages")
    if msgs is None:  # single turn with decoded text
        return [{"role": "user", "content": t.get("prompt", "")},
                {"role": "assistant", "content": t.get("completion", "")}]
    return [{"role": ROLES.get(m["role"], "user"),
             "content": m["text"] if "text" in m else " ".join(map(str, m.get("ids", [])))} for m in msgs]


def export_trackio(reader: Any, steps: list[int], tokenizer: Any, max_per_step: int | None, *,
                   project: str, name: str | None = None, fields: dict | None = None,
                   progress: Callable[[Iterable], Iterable] | None = None) -> tuple[int, int]:
    """Log the traces of ``steps`` to Trackio project ``project`` (run ``name``); returns
    (trajectories logged, rejected trajectories counted)."""
    try:
        import trackio
    except ImportError:
        raise MissingDependencyError("Trackio export needs trackio: pip install 'trajstore[trackio]'") from None
    n = rejected = 0
    with contextlib.redirect_stdout(sys.stderr):  # trackio prints banners
        trackio.init(project=project, name=name, config={"trajstore_dump": str(reader.path),
                                                         "split": reader.split},
                     auto_log_gpu=False, auto_log_cpu=False)
        try:
            for s in (progress(steps) if progress else steps):
                ts = traces(reader, s, tokenizer, max_per_step, fields=fields)
                kept = [t for t in ts if not t["rejected"]]
                n_rej = len(ts) - len(kept)
                objs = []
                for t in kept:
                    meta = {k: t[k] for k in ("step", "index", "reward", "versions", "lengths", "fields") if k in t}
                    objs.append(trackio.Trace(messages=_messages(t), metadata=meta))
                trackio.log({"traces": objs, "trajstore/trajectories": len(kept),
                             "trajstore/rejected": n_rej}, step=s)
                n += len(kept)
                rejected += n_rej
        finally:
            trackio.finish()
    return n, rejected
