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


def test_testing_exports():
    """``trajstore.testing`` keeps its public names, each the strategy or function itself (never one of the
    package's modules of the same name), importable from the package."""
    import types

    import trajstore.testing as testing

    assert testing.__all__ == [
        "TORCH_DTYPES", "tensors", "padded_batches", "trajectory_lists", "group_lists", "packed_batches",
        "multimodal_batches", "non_tensor_values", "non_tensor_batches", "typed_values", "typed_batches",
        "two_sided_batches", "prompt_completion_batches", "image_batches", "batches", "assert_batch_equal",
    ]
    for name in testing.__all__:
        obj = getattr(testing, name)
        assert not isinstance(obj, types.ModuleType), name
        assert name == "TORCH_DTYPES" or callable(obj), name
    assert all(isinstance(d, type(testing.TORCH_DTYPES[0])) for d in testing.TORCH_DTYPES)
