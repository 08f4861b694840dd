"""A packed read to a GPU sends int64 identifiers stored as int32 as their int32 values and bool token
fields as their bitmap bytes, widened and unpacked on the device (trajstore/format/codec/late.py,
trajstore/device/bridge.py); a padded read sends such ids as int32 too, widened where the pad plan places
them (trajstore/device/plan.py, pad.py). Run here with the CPU as the device: the batch equals the CPU read bit for
bit whatever the row groups, a rank's slice (bitmaps starting inside a byte), the fields' libraries;
the staged bytes are the stored ones; a placeholder used on the host or not sent is filled there."""

import tempfile

import numpy as np
import pyarrow as pa
import pytest
import torch
from _dumps import many_row_groups, write
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore.device import bridge as torch_bridge
from trajstore.device import plan as pad_plan
from trajstore.format.codec import late as late_mod
from trajstore.testing import assert_batch_equal

CPU = torch.device("cpu")


def staged_read(r, step, layout="packed", columns=None):
    """``read(step, device=...)``'s path with the CPU as the device: (batch, the Staged batch)."""
    pool = torch_bridge.PinnedPool()
    arena = torch_bridge.Arena(pool, defer=True)
    staged = torch_bridge.stage(r._read(step, columns, layout, arena), pool, arena)
    kinds = [None if x is None else x.kind for x in staged.late]
    out, ev = torch_bridge.launch(staged, CPU, None)
    assert ev is None and pool.in_use == 0
    return out, kinds, staged


@st.composite
def padded(draw, world=1):
    B, T = world * draw(st.integers(1, 4)), draw(st.integers(1, 40))
    lens = torch.tensor(draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))
    m = torch.arange(T)[None, :] < lens[:, None]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    ids = torch.randint(-2 ** 31, 2 ** 31 - 1, (B, T), generator=g, dtype=torch.int64)
    if draw(st.booleans()):  # ids beyond int32 (where a token holds it): stored as int64, sent as they are
        ids[0, 0] = 2 ** 40
    b = {"input_ids": ids.masked_fill(~m, 0), "attention_mask": m.long(),
         "loss_mask": (torch.rand(B, T, generator=g) < 0.5) & m,
         "logprobs": torch.randn(B, T, generator=g).masked_fill(~m, 0.0), "rewards": torch.rand(B, generator=g)}
    if draw(st.booleans()):
        b["position_ids"] = (torch.arange(T)[None, :].expand(B, T) * m).contiguous()
    return b


@settings(max_examples=40, deadline=None)
@given(st.booleans(), st.integers(1, 3), st.data())
def test_a_packed_read_sent_as_stored_equals_the_cpu_read(many_groups, world, data):
    b = data.draw(padded(world))
    mp = pytest.MonkeyPatch()
    if many_groups:
        many_row_groups(mp)
    try:
        with tempfile.TemporaryDirectory() as d:
            write(d, {0: b})
            rank = data.draw(st.integers(0, world - 1))
            r = trajstore.Reader(d, rank=rank, world_size=world) if world > 1 else trajstore.Reader(d)
            want = r.read(0, layout="packed")
            got, kinds, staged = staged_read(r, 0)
            assert_batch_equal(want, got)
            tokens = int(want["input_ids"].numel())
            if tokens:  # the bool field's bitmap and (ids within int32) the int32 ids were what was sent
                assert kinds.count("bool") == 1
                big = int(r.read(0)["input_ids"].max()) >= 2 ** 31 if world == 1 else None
                assert kinds.count("int64") - ("position_ids" in b) == (not big) or big is None
            for t in (got["input_ids"], got["loss_mask"]):
                assert not t.is_meta
    finally:
        mp.undo()


def test_the_stored_bytes_are_what_is_staged(tmp_path):
    """Ids of 10,000 tokens stage 40,000 bytes (not 80,000), the mask 1,250 (not 10,000)."""
    B, T = 10, 1000
    m = torch.ones(B, T, dtype=torch.bool)
    b = {"input_ids": torch.arange(B * T).reshape(B, T), "attention_mask": m.long(), "loss_mask": m.clone()}
    r = write(tmp_path, {0: b})
    got, kinds, staged = staged_read(r, 0)
    assert_batch_equal(r.read(0, layout="packed"), got)
    assert kinds[:2] == ["int64", "bool"]
    assert staged.offsets[1] - staged.offsets[0] < 40_000 + 1024 and staged.total < 40_000 + 1_250 + 4096


def test_numpy_fields_and_host_uses_are_filled_on_the_host(tmp_path):
    """A numpy token field's placeholder is not a tensor the stager sends: it is filled on the host; a
    column handed out and then wanted on the host (``list_parts``) is filled and no longer sent late."""
    B, T = 4, 9
    m = np.arange(T)[None, :] < np.array([9, 3, 0, 5])[:, None]
    b = {"input_ids": np.where(m, np.arange(B * T).reshape(B, T) + 7, 0), "attention_mask": m.astype(np.int64),
         "loss_mask": m.copy()}
    r = write(tmp_path, {0: b})
    got, kinds, _ = staged_read(r, 0)
    want = r.read(0, layout="packed")
    assert isinstance(got["input_ids"], np.ndarray) and set(kinds) <= {None}
    assert_batch_equal(want, got)

    t = pa.table({"c": pa.array([[1, 2, 3], [], [4]], pa.large_list(pa.int32())),
                  "m": pa.array([[True, False], [True], []], pa.large_list(pa.bool_()))})
    late: list = []
    cols = late_mod.LateColumns(t, "t", None, None, late, {"c", "m"})
    cols.join([("c", "int64"), ("m", "bool")])
    off, v = cols.flat_parts("c", "int64")
    assert len(late) == 1 and v.dtype == np.int64 and off.tolist() == [0, 3, 3, 4]
    off, v = cols.list_parts("c", "int64")  # the host wants it too
    assert late == [] and v.tolist() == [1, 2, 3, 4]
    off, v = cols.list_parts("m", "bool")  # never handed out: converted from its bitmap on the host
    assert v.tolist() == [True, False, True] and cols.offsets("m", "bool").tolist() == [0, 2, 3, 3]


@given(st.lists(st.booleans(), max_size=70), st.integers(0, 7))
def test_bitmaps_unpack_from_any_bit(bits, shift):
    """The device's unpack (``bridge._convert``, run on CPU tensors) and the host's (``host_values``) of a
    bitmap whose first value is bit ``shift``: the values, bit for bit."""
    n = len(bits)
    packed = np.packbits(np.array([False] * shift + bits, dtype=bool), bitorder="little")
    rec = late_mod.Late(np.empty(n, np.bool_), packed, "bool", shift)
    out = torch.empty(n, dtype=torch.bool)
    torch_bridge._convert(rec, torch.from_numpy(packed), out)
    assert out.tolist() == bits == late_mod.host_values(packed, "bool", shift, n).tolist()


@given(st.lists(st.lists(st.booleans(), max_size=12), min_size=1, max_size=8), st.data())
def test_a_sliced_bool_column_is_sent_from_the_bit_it_starts_at(rows, data):
    """A column whose chunk is a slice (its values starting inside a byte of the bitmap): the bytes staged
    and the bit it starts at give its values, on the device and on the host."""
    a, b = sorted(data.draw(st.tuples(st.integers(0, len(rows)), st.integers(0, len(rows)))))
    arr = pa.array(rows, pa.large_list(pa.bool_())).slice(a, b - a)
    want = [v for r in rows[a:b] for v in r]
    late: list = []
    cols = late_mod.LateColumns(pa.table({"m": arr}), "t", None, None, late, {"m"})
    off, v = cols.flat_parts("m", "bool")
    assert off.tolist() == [0, *np.cumsum([len(r) for r in rows[a:b]]).tolist()]
    if not want:
        assert late == [] and v.tolist() == []
        return
    (rec,) = late
    out = torch.empty(len(want), dtype=torch.bool)
    torch_bridge._convert(rec, torch.from_numpy(rec.stored), out)
    assert out.tolist() == want
    rec.fill()
    assert rec.out.tolist() == want


@pytest.mark.parametrize("piece", [4, 64, 1 << 20])
def test_ids_joined_as_stored_in_pieces_on_the_pool(tmp_path, monkeypatch, piece):
    """The int32 values of several row groups copied into the arena in pieces of ``piece`` bytes on the pool
    (a read outside a deep prefetch): every piece lands where its values go."""
    from trajstore.base import threads as _threads

    many_row_groups(monkeypatch)
    monkeypatch.setattr(late_mod, "PIECE_BYTES", piece)
    monkeypatch.setattr(_threads, "PARALLEL_BYTES", 0)
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(0, 300, (24,), generator=g)
    m = torch.arange(300)[None, :] < lens[:, None]
    b = {"input_ids": torch.randint(0, 2 ** 31 - 1, (24, 300), generator=g).masked_fill(~m, 0),
         "attention_mask": m, "loss_mask": (torch.rand(24, 300, generator=g) < 0.3) & m}
    r = write(tmp_path, {0: b})
    got, kinds, _ = staged_read(r, 0)
    assert kinds[:2] == ["int64", "bool"]
    assert_batch_equal(r.read(0, layout="packed"), got)
    assert torch.equal(got["input_ids"], b["input_ids"][m])


@settings(max_examples=40, deadline=None)
@given(st.booleans(), st.booleans(), st.sampled_from([0, 151_643, -5, 2 ** 40]), st.data())
def test_a_padded_read_with_ids_as_stored_equals_the_cpu_read(many_groups, flat, pad, data):
    """Padded as recorded for the GPU (run on CPU tensors): ids joined as int32 and widened where the plan
    places them in the arena; a pad value beyond int32, a flat buffer's output or one repeated value widened
    on the host instead; bit for bit the CPU read either way."""
    b = data.draw(padded())
    b.pop("position_ids", None)  # (an id field too: input_ids is the one looked at here)
    m = b["attention_mask"].bool()
    b["input_ids"] = b["input_ids"].masked_fill(~m, pad)
    pad = pad if bool((~m).any()) else 0  # (no padding: no pad value recorded)
    mp = pytest.MonkeyPatch()
    mp.setattr(pad_plan, "FLAT_BYTES", 1 << 30 if flat else 0)
    if many_groups:
        many_row_groups(mp)
    try:
        with tempfile.TemporaryDirectory() as d:
            r = write(d, {0: b})
            want = r.read(0)
            got, _, staged = staged_read(r, 0, layout=None)
            assert_batch_equal(want, got)
            tokens = b["input_ids"][m]
            narrow = [p.narrow for p in staged.plan.pads] if staged.plan is not None else []
            stored32 = bool(tokens.numel()) and int(tokens.max()) < 2 ** 31
            if stored32 and not flat and pad < 2 ** 31 and len(tokens.unique()) > 1:
                assert narrow.count(True) == 1
            if not stored32 or flat or pad >= 2 ** 31:
                assert True not in narrow
    finally:
        mp.undo()
