import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", max_examples=int(os.environ.get("TRAJSTORE_EXAMPLES", "60")), deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile("default")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
