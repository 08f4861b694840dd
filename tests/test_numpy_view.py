"""``format.numpy_view.to_numpy``: a null-free numeric Arrow array read as numpy is a zero-copy view of its
data buffer taken without pyarrow's conversion (which releases and retakes the GIL on each call, a
wait per chunk when several steps decode at once: benchmarks/RESULTS.md). The view is what pyarrow's
``to_numpy`` gives, bit for bit: dtype, length, values, of any slice (an array's offset, a list
chunk's offsets, the values of a sliced list); arrays with nulls, bools and empty arrays keep their
own paths."""

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from trajstore.format.numpy_view import _offsets, _sliced, to_numpy

NUMERIC = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64(),
           pa.float16(), pa.float32(), pa.float64()]


def _array(t: pa.DataType, raw: bytes) -> pa.Array:
    """An array of type ``t`` over arbitrary bits (NaN payloads and signed zeros included)."""
    w = t.bit_width // 8
    n = len(raw) // w
    return pa.Array.from_buffers(t, n, [None, pa.py_buffer(raw[:n * w])])


def _same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()  # bit for bit (NaN payloads, -0.0)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(NUMERIC), st.binary(max_size=512), st.integers(0, 80), st.integers(0, 80))
def test_a_numeric_array_is_a_view_of_its_buffer_equal_to_pyarrows(t, raw, start, length):
    a = _array(t, raw)
    s = a.slice(min(start, len(a)), length)
    got, want = to_numpy(s), s.to_numpy(zero_copy_only=False)
    _same(got, want)
    assert not got.flags.writeable  # Arrow's memory: read-only, as pyarrow's view is
    if len(s):  # no copy: the view starts at the slice's first value in the Arrow buffer
        assert got.ctypes.data == s.buffers()[1].address + s.offset * got.itemsize


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(NUMERIC), st.lists(st.integers(0, 7), max_size=30), st.integers(0, 30), st.integers(0, 30),
       st.randoms(use_true_random=False))
def test_list_chunks_sliced_read_their_offsets_and_values_exactly(t, lengths, start, length, rnd):
    """A large_list column of chunks, each a slice of a longer list array (what a shard slice reads):
    the offsets counted across the chunks and each chunk's values equal pyarrow's own conversion."""
    w = t.bit_width // 8
    values = _array(t, rnd.randbytes(sum(lengths) * w))
    offs = pa.array(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]), pa.int64())
    full = pa.LargeListArray.from_arrays(offs, values)
    s = full.slice(min(start, len(full)), length)
    cut = rnd.randint(0, len(s))
    chunks = [s.slice(0, cut), s.slice(cut)]
    want_vals = s.flatten().to_numpy(zero_copy_only=False)
    got_vals = np.concatenate([to_numpy(_sliced(c)) for c in chunks]) if len(s) else want_vals[:0]
    _same(got_vals, want_vals)
    want_off = np.concatenate([[0], np.cumsum(pa.compute.list_value_length(s).to_numpy(zero_copy_only=False),
                                              dtype=np.int64)]).astype(np.int64)
    _same(_offsets(chunks), want_off)
    for c in chunks:  # a chunk's offsets as numpy: its own slice of the offsets buffer
        _same(to_numpy(c.offsets), c.offsets.to_numpy(zero_copy_only=False))


@pytest.mark.parametrize("t", NUMERIC)
def test_arrays_with_nulls_and_empty_arrays_keep_pyarrows_conversion(t):
    a = pa.array([1, None, 3], t)
    got, want = to_numpy(a), a.to_numpy(zero_copy_only=False)
    assert got.dtype == want.dtype and len(got) == 3
    assert np.array_equal(got, want, equal_nan=True) if got.dtype.kind == "f" else list(got) == list(want)
    e = pa.array([], t)
    _same(to_numpy(e), e.to_numpy(zero_copy_only=False))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), max_size=70), st.integers(0, 70), st.integers(0, 70))
def test_bools_are_unpacked_exactly_from_any_offset(bits, start, length):
    a = pa.array(bits, pa.bool_()).slice(min(start, len(bits)), length)
    got = to_numpy(a)
    assert got.dtype == np.bool_ and got.tolist() == a.to_pylist()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 255), max_size=300), st.integers(1, 3), st.integers(0, 2**31 - 1),
       st.booleans())
def test_list_array_of_bools_is_pyarrows_packing(raw, step, seed, nulls):
    """``list_array`` packs numpy bools with ``np.packbits`` instead of pyarrow's conversion: the same
    Arrow array (values, offsets, nulls, type) for any bytes behind the bools (non-zero is True), any
    stride, and the same Parquet bytes."""
    import io

    import pyarrow.parquet as pq

    from trajstore.format.arrow import list_array

    vals = np.frombuffer(bytes(raw), np.uint8).view(np.bool_)[::step]
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, len(vals) + 1, rng.integers(0, 5)))
    offsets = np.concatenate([[0], cuts, [len(vals)]]).astype(np.int64)
    mask = rng.random(len(offsets) - 1) < 0.3 if nulls else None
    got = list_array(offsets, vals, mask)
    want_vals = pa.array(vals != 0)
    want = (pa.LargeListArray.from_arrays(pa.array(offsets), want_vals, mask=pa.array(mask))
            if mask is not None and mask.any() else
            pa.LargeListArray.from_arrays(pa.array(offsets), want_vals,
                                          type=pa.large_list(pa.field("element", pa.bool_(), nullable=False))))
    assert got.type == want.type and got.equals(want) and got.to_pylist() == want.to_pylist()

    def parquet(a: pa.Array) -> bytes:
        sink = io.BytesIO()
        pq.write_table(pa.table({"m": a}), sink)
        return sink.getvalue()

    assert parquet(got) == parquet(want)
