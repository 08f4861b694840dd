"""``trajstore.recorder``: front door of the dump/replay switch (``trajstore/record/``); the code is in ``trajstore.record.recorder``."""

from .record.recorder import (
    Recorder,
    DumpReplayConfig,
)

__all__ = ["Recorder", "DumpReplayConfig"]
