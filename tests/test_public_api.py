"""The exported names are the public API; changing them is a decision, not an accident."""

import trajstore


def test_exports():
    expected = {
        "__version__", "Writer", "Reader", "Recorder", "DumpReplayConfig", "deterministic",
        "traces", "diff", "verify",
        "TrajstoreError", "StepNotFoundError", "StepExistsError", "DumpNotFoundError", "BatchError",
        "UnsupportedTypeError", "FormatError", "FormatVersionError", "ChecksumError", "WriterError",
        "ConfigError", "EnvironmentMismatchError", "MissingDependencyError",
    }
    assert set(trajstore.__all__) == expected
    assert len(trajstore.__all__) == len(expected)
    for name in trajstore.__all__:
        assert hasattr(trajstore, name), name


def test_errors_subclass_builtins():
    assert issubclass(trajstore.StepNotFoundError, KeyError)
    assert issubclass(trajstore.StepExistsError, FileExistsError)
    assert issubclass(trajstore.DumpNotFoundError, FileNotFoundError)
    assert issubclass(trajstore.BatchError, ValueError)
    assert issubclass(trajstore.UnsupportedTypeError, TypeError)
    assert issubclass(trajstore.FormatError, ValueError)
    assert issubclass(trajstore.WriterError, RuntimeError)
    for name in trajstore.__all__:
        obj = getattr(trajstore, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, trajstore.TrajstoreError)
    # KeyError's repr-quoting is undone: the message reads as written
    assert str(trajstore.StepNotFoundError("step 3 is not in dump x")) == "step 3 is not in dump x"
