import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", max_examples=int(os.environ.get("TRAJSTORE_EXAMPLES", "60")), deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile("default")


def pytest_addoption(parser):
    parser.addoption("--screenshots", metavar="DIR", default=None,
                     help="tests/test_view_browser.py also saves its PNG of each page in DIR (docs/img)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def s3_server():
    """A local S3-compatible server (moto's server mode, tests/_s3server.py) for the whole session;
    skipped where moto[server] is not installed (`pip install -e '.[test]'` installs it)."""
    pytest.importorskip("moto.server")
    pytest.importorskip("boto3")
    from _s3server import S3Server

    srv = S3Server()
    yield srv
    srv.stop()


@pytest.fixture(params=["pyarrow", "fsspec"])
def s3_dump(request, s3_server, monkeypatch):
    """``s3://<new bucket>/run``, with the server's endpoint and test credentials in the environment and
    ``TRAJSTORE_FS`` choosing the library (both: pyarrow's S3 file system, fsspec/s3fs)."""
    if request.param == "fsspec":
        pytest.importorskip("s3fs")
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TRAJSTORE_FS", request.param)
    return f"s3://{s3_server.bucket()}/run"


@pytest.fixture
def int64_tokens():
    """Token columns of int64 stored as int64, as before format version 6 (docs/FORMAT.md 3.2): for
    tests of the lowest version another construct records (a step of int64 token ids records 6)."""
    from _dumps import int64_tokens as int64_token_columns

    with int64_token_columns():
        yield


@pytest.fixture(autouse=True)
def process_state_restored(request):
    """Every test leaves the process's thread settings as it found them: the calling thread's serial
    budget (``trajstore.base.threads.serial``), Arrow's CPU pool (once no read holds it raised:
    ``base/arrow_pool.py``) and torch's thread count. A test (or a benchmark it runs) that leaves one
    changed would change how every later test in its process reads and writes, and fail or pass there
    for that reason alone."""
    import pyarrow as pa

    from trajstore.base import arrow_pool, threads

    arrow_pool.settle()  # a read's raised pool lingers LINGER seconds for the next read: given back now
    before = (threads.is_serial(), pa.cpu_count(), torch.get_num_threads())
    yield
    idle = arrow_pool.settle()  # False: a read still runs on another thread (its pool is compared no more)
    after = (threads.is_serial(), pa.cpu_count() if idle else before[1], torch.get_num_threads())
    assert after == before, (f"{request.node.nodeid} left (serial, Arrow's pool, torch threads) {after}, "
                             f"found {before}: restore them")
