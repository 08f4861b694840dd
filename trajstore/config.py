"""``trajstore.config``: front door of the switch's configuration (``trajstore/record/``); the code is in ``trajstore.record.config``."""

from .record.config import (
    DumpReplayConfig,
    default_run_id,
    location,
    ENV_VARIABLES,
    check_env,
)

__all__ = ["DumpReplayConfig", "default_run_id", "location", "ENV_VARIABLES", "check_env"]
