"""Padded fields built on the device (trajstore/device/pad.py): the builder's torch ops, run here on
CPU tensors, give the CPU decode's batch bit for bit for every batch form; the `cuda` tests compare
``iter(device="cuda")`` and the Recorder's replay with the CPU replay."""

import tempfile

import numpy as np
import pytest
import torch
from _dumps import cuda_replay_equals_cpu, many_row_groups, on_cuda_equal, read_as
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore.device import pad as device_pad, bridge as torch_bridge, plan as pad_plan
from trajstore.format.file import parquet
from trajstore.read.decode import read_table
from trajstore.testing import (
    assert_batch_equal,
    batches,
    group_lists,
    packed_batches,
    padded_batches,
    prompt_completion_batches,
    two_sided_batches,
)

CPU = torch.device("cpu")


def device_read(r, step, layout=None, columns=None):
    """``Reader.read(step, device=...)``'s path with the CPU as the device: decode into a deferring
    arena, stage, build. Returns (batch, plan)."""
    pool = torch_bridge.PinnedPool()
    arena = torch_bridge.Arena(pool, defer=True)
    staged = torch_bridge.stage(r._read(step, columns, layout, arena), pool, arena)
    plan = staged.plan
    out, ev = torch_bridge.launch(staged, CPU, None)
    assert ev is None and pool.in_use == 0  # both staging buffers went back
    return out, plan


def padded_batch(B=5, T=11, side="right", seed=0, pads="zero"):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, T + 1, (B,), generator=g)
    ar = torch.arange(T)[None, :]
    m = ar < lens[:, None] if side == "right" else ar >= (T - lens)[:, None]
    b = {"input_ids": torch.randint(0, 152_000, (B, T), generator=g).masked_fill(~m, 151_643),
         "attention_mask": m.long(),
         "logprobs": torch.randn(B, T, generator=g).to(torch.bfloat16).masked_fill(~m, 0.0),
         "values": torch.randn(B, T, 3, generator=g).masked_fill(~m[..., None], -1.0),
         "loss_mask": m.clone(),
         "rewards": torch.randn(B, generator=g)}
    if pads == "garbage":  # padded positions of their own: stored in __pad__ columns
        b["logprobs"] = torch.randn(B, T, generator=g).to(torch.bfloat16)
        b["logprobs"][~m] = torch.randn(int((~m).sum()), generator=g).to(torch.bfloat16)
    return b


@settings(max_examples=60, deadline=None)
@given(st.one_of(batches(), padded_batches(), packed_batches(), two_sided_batches(), prompt_completion_batches(),
                 group_lists()),
       st.sampled_from([None, "padded", "packed"]), st.booleans(), st.booleans())
def test_device_builder_on_cpu_equals_the_padded_decode(batch, layout, many_groups, flat):
    mp = pytest.MonkeyPatch()
    mp.setattr(pad_plan, "FLAT_BYTES", 1 << 30 if flat else 0)  # small outputs built together, or one by one
    if many_groups:  # several row groups: one fill job per chunk
        many_row_groups(mp)
    try:
        with tempfile.TemporaryDirectory() as d:
            step = read_as(d, batch, layout)
            if step is None:
                return  # no layout to convert
            r, want = step
            got, _ = device_read(r, 0, layout)
            assert_batch_equal(want, got)
            assert all(not t.is_meta for t in torch_bridge._leaves(got))
    finally:
        mp.undo()


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("pads", ["zero", "garbage"])
def test_padded_fields_are_built_from_their_unpadded_values(tmp_path, side, pads, monkeypatch):
    """Every torch per-token field of a padded batch is built, not staged padded: the staged bytes
    hold the tokens (the mask of ones: one value), not the padded width."""
    monkeypatch.setattr(parquet, "ROW_GROUP_BYTES", 256)  # several chunks per field
    monkeypatch.setattr(parquet, "PARALLEL_READ_BYTES", 0)
    b = padded_batch(B=40, T=50, side=side, pads=pads)
    with trajstore.Writer(tmp_path) as w:
        w.append(0, b)
    r = trajstore.Reader(tmp_path)
    got, plan = device_read(r, 0)
    assert_batch_equal(r.read(0), got)
    assert_batch_equal(b, got)
    assert plan is not None and len(plan.pads) == 5
    (mask_pad,) = [p for p in plan.pads if p.dtype == torch.int64 and p.const]
    assert mask_pad.rows == 1  # attention_mask: ones, staged as one value
    tokens = int(b["attention_mask"].sum())
    padded = sum(t.numel() * t.element_size() for k, t in b.items() if k != "rewards")
    assert plan.total < padded * (tokens / b["attention_mask"].numel()) + 40 * 50 * 2 + 4096


def test_a_packed_step_read_padded_builds_its_mask_too(tmp_path):
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 5, 5, 12, 13], dtype=torch.int32)
    b = {"input_ids": torch.randint(0, 99, (13,), generator=g), "cu_seqlens": cu, "max_seqlen": 7,
         "logprobs": torch.randn(13, generator=g).to(torch.bfloat16), "rewards": torch.randn(4, generator=g)}
    with trajstore.Writer(tmp_path) as w:
        w.append(0, b)
    r = trajstore.Reader(tmp_path)
    got, plan = device_read(r, 0, "padded")
    assert_batch_equal(r.read(0, layout="padded"), got)
    assert [(p.dtype, p.const) for p in plan.pads] == [(torch.int64, False), (torch.bfloat16, False),
                                                       (torch.bool, True)]  # the mask: one value


def test_numpy_fields_stay_on_the_host_filled_on_the_cpu(tmp_path):
    b = padded_batch()
    b["np_logprobs"] = b["logprobs"].float().numpy()
    with trajstore.Writer(tmp_path) as w:
        w.append(0, b)
    r = trajstore.Reader(tmp_path)
    got, plan = device_read(r, 0)
    assert isinstance(got["np_logprobs"], np.ndarray)
    assert_batch_equal(r.read(0), got)
    assert len(plan.pads) == 5


def test_an_output_also_seen_through_a_view_is_filled_on_the_host(tmp_path):
    b = padded_batch()
    with trajstore.Writer(tmp_path) as w:
        w.append(0, b)
    r = trajstore.Reader(tmp_path)
    pool = torch_bridge.PinnedPool()
    arena = torch_bridge.Arena(pool, defer=True)
    got = r._read(0, None, None, arena)
    got["tail"] = got["input_ids"][1:]  # a view of part of a deferred output
    staged = torch_bridge.stage(got, pool, arena)
    out, _ = torch_bridge.launch(staged, CPU, None)
    assert_batch_equal(b | {"tail": b["input_ids"][1:]}, out)
    assert len(staged.plan.pads) == 4  # input_ids filled on the host, the others built


def test_a_cpu_device_read_fills_deferred_fields(tmp_path):
    """An arena that deferred its padded fields, handed to a CPU ``to_device``, fills them there."""
    b = padded_batch(side="left")
    with trajstore.Writer(tmp_path) as w:
        w.append(0, b)
    r = trajstore.Reader(tmp_path)
    arena = torch_bridge.Arena(torch_bridge.PinnedPool(), defer=True)
    got = torch_bridge.to_device(r._read(0, None, None, arena), "cpu", arena)
    assert_batch_equal(b, got)


def test_last_axis_and_masked_fields(tmp_path):
    """A [B, C, T] field (token axis last) and the fields of a two-sided (span) mask are built too."""
    g = torch.Generator().manual_seed(1)
    B, T = 4, 9
    starts, lens = torch.tensor([0, 2, 5, 3]), torch.tensor([9, 4, 0, 6])
    ar = torch.arange(T)[None, :]
    m = (ar >= starts[:, None]) & (ar < (starts + lens)[:, None])
    b = {"input_ids": torch.randint(0, 99, (B, T), generator=g).masked_fill(~m, 0), "attention_mask": m.long(),
         "position_ids": torch.randint(0, 99, (B, 4, T), generator=g).masked_fill(~m[:, None, :], 1)}
    with trajstore.Writer(tmp_path) as w:
        w.append(0, b)
        w.append(1, {"input_ids": b["input_ids"][:, :8], "attention_mask": (ar < lens[:, None]).long()[:, :8],
                     "position_ids": b["position_ids"][..., :8]})
    r = trajstore.Reader(tmp_path)
    for s in (0, 1):
        got, plan = device_read(r, s)
        assert_batch_equal(r.read(s), got)
        assert plan is not None and any(p.last for p in plan.pads) and len(plan.pads) == 3


@pytest.mark.parametrize("flat", [True, False])
def test_areal_groups_are_built_on_the_device(tmp_path, flat, monkeypatch):
    """A list batch of AReaL [g, T] groups: each group's token cells are built from their runs, all
    groups of a dtype by one gather (``flat``), or one by one."""
    monkeypatch.setattr(pad_plan, "FLAT_BYTES", pad_plan.FLAT_BYTES if flat else 0)
    groups = []
    for i, side in enumerate(["right", "left", "right"]):
        b = padded_batch(B=3 + i, T=7 + i, side=side, seed=i, pads="garbage" if i else "zero")
        groups.append({k: v for k, v in b.items() if k != "rewards"} | {"uid": f"g{i}"})
    groups.insert(1, None)
    with trajstore.Writer(tmp_path) as w:
        w.append(0, groups)
    r = trajstore.Reader(tmp_path)
    got, plan = device_read(r, 0)
    assert_batch_equal(r.read(0), got)
    assert_batch_equal(groups, got)
    assert plan is not None and len(plan.pads) == 15 and len(plan.groups) >= 3
    assert len(plan.flats) == (4 if flat else 0)  # int64, bool, bf16, float32 [g, T, 3]


@pytest.mark.parametrize("pads", ["zero", "garbage"])
def test_areal_groups_of_a_joined_column_keep_their_neighbours_values(tmp_path, monkeypatch, pads):
    """A large list batch (several row groups) joins each cell column into the pinned arena, each group's
    values a slice of it, one after the other. A group built one by one (not by a flat gather) whose
    values lie in the arena keeps them there only where its pad row, written after them, lands on no
    other group's values: the next group comes back exact."""
    many_row_groups(monkeypatch)
    monkeypatch.setattr(pad_plan, "FLAT_BYTES", 0)
    groups = []
    for i, side in enumerate(["right", "left", "right", "left"]):
        b = padded_batch(B=3 + i, T=7 + i, side=side, seed=i, pads=pads)
        groups.append({k: v for k, v in b.items() if k != "rewards"} | {"uid": f"g{i}"})
    with trajstore.Writer(tmp_path) as w:
        w.append(0, groups)
    r = trajstore.Reader(tmp_path)
    got, plan = device_read(r, 0)
    assert plan is not None and any(p.home for p in plan.pads)  # the last group's values stay at home
    assert_batch_equal(groups, got)
    assert_batch_equal(r.read(0), got)


def test_tensordict_and_dataproto_batches(tmp_path):
    """Containers are rebuilt around the built fields, as around the staged ones."""
    tensordict = pytest.importorskip("tensordict")
    b = padded_batch(side="left", pads="garbage")
    td = tensordict.TensorDict({k: v for k, v in b.items()}, batch_size=[5])
    dp = trajstore.format.batch.containers.DataProtoLike(batch=td, non_tensor_batch={"uid": np.array(list("abcde"), dtype=object)},
                                                   meta_info={"temperature": 1.0})
    with trajstore.Writer(tmp_path) as w:
        w.append(0, td)
        w.append(1, dp)
    r = trajstore.Reader(tmp_path)
    for s in (0, 1):
        got, plan = device_read(r, s)
        want = r.read(s)
        assert type(got) is type(want) and plan is not None and len(plan.pads) == 5
        a, g = (want, got) if s == 0 else (want.batch, got.batch)
        assert list(a.batch_size) == list(g.batch_size) and list(a.keys()) == list(g.keys())
        assert_batch_equal(dict(a.items()), dict(g.items()))
        assert_batch_equal(b, dict(g.items()))


def test_the_index_math_alone():
    """``build`` on a hand-made plan: right, left and span rows, a pad row, recorded padded values."""
    n, T = 3, 5
    starts, lens = np.array([0, 2, 1]), np.array([2, 3, 0])
    vals = torch.arange(10, 15, dtype=torch.int16)  # 5 tokens
    pv = torch.arange(100, 110, dtype=torch.int16)  # 15 - 5 = 10 padded positions
    buf = torch.zeros(4096, dtype=torch.uint8)
    buf[:48].view(torch.int64).copy_(torch.from_numpy(np.stack([starts, lens]).reshape(-1)))
    buf[256:256 + 30].view(torch.int16).copy_(torch.cat([vals, pv]))
    buf[512:512 + 12].view(torch.int16).copy_(torch.cat([vals, torch.tensor([-7], dtype=torch.int16)]))
    plan = device_pad.Plan([device_pad.Pad((n, T), torch.int16, 1, False, 0, 256, 5, False, True),
                            device_pad.Pad((n, T), torch.int16, 1, False, 0, 512, 5, False, False)],
                           [(0, n, T)], None, 4096)
    outs = [torch.empty(n, T, dtype=torch.int16) for _ in range(2)]
    device_pad.build(plan, buf, outs, [])
    assert outs[0].tolist() == [[10, 11, 100, 101, 102], [103, 104, 12, 13, 14], [105, 106, 107, 108, 109]]
    assert outs[1].tolist() == [[10, 11, -7, -7, -7], [-7, -7, 12, 13, 14], [-7, -7, -7, -7, -7]]


def test_the_scatter_math_alone():
    """``build`` on a hand-made plan whose rows carry their base (``plan``'s third row): an output
    with one pad value and a one-value output are filled and their tokens scattered, rows of no
    tokens included; the gather (``SCATTER`` off) gives the same."""
    n, T = 4, 5
    starts, lens = np.array([0, 2, 1, 0]), np.array([2, 3, 0, 5])
    base = np.arange(n) * T + starts - (np.cumsum(lens) - lens)
    vals = torch.arange(10, 20, dtype=torch.int16)  # 10 tokens
    buf = torch.zeros(4096, dtype=torch.uint8)
    buf[:96].view(torch.int64).copy_(torch.from_numpy(np.stack([starts, lens, base]).reshape(-1)))
    buf[512:512 + 22].view(torch.int16).copy_(torch.cat([vals, torch.tensor([-7], dtype=torch.int16)]))
    buf[1024:1028].view(torch.int16).copy_(torch.tensor([3, 0], dtype=torch.int16))  # the value, the pad
    plan = device_pad.Plan([device_pad.Pad((n, T), torch.int16, 1, False, 0, 512, 10, False, False, fillv=-7),
                            device_pad.Pad((n, T), torch.int16, 1, False, 0, 1024, 1, True, False, cval=3)],
                           [(0, n, T)], None, 4096, tokens=[10])
    want = [[[10, 11, -7, -7, -7], [-7, -7, 12, 13, 14], [-7] * 5, [15, 16, 17, 18, 19]],
            [[3, 3, 0, 0, 0], [0, 0, 3, 3, 3], [0] * 5, [3] * 5]]
    for scatter in (True, False):
        device_pad.SCATTER = scatter
        try:
            outs = [torch.full((n, T), 99, dtype=torch.int16) for _ in range(2)]
            device_pad.build(plan, buf, outs, [])
        finally:
            device_pad.SCATTER = True
        assert [o.tolist() for o in outs] == want


def test_the_bitmap_unpacking_math_alone():
    """A bool output whose table is a bitmap (``Pad.bits``: its first value at that bit of the first byte,
    least significant bit first, as Arrow packs them) is the output of the bytes it stands for, scattered
    or gathered (with its pad row made on the device)."""
    n, T = 4, 5
    starts, lens = np.array([0, 2, 1, 0]), np.array([2, 3, 0, 5])
    base = np.arange(n) * T + starts - (np.cumsum(lens) - lens)
    vals = np.array([1, 0, 1, 1, 0, 0, 1, 0, 1, 1], np.bool_)
    for shift in (0, 3, 7):
        buf = torch.zeros(4096, dtype=torch.uint8)
        buf[:96].view(torch.int64).copy_(torch.from_numpy(np.stack([starts, lens, base]).reshape(-1)))
        packed = np.packbits(np.concatenate([np.zeros(shift, np.bool_), vals]), bitorder="little")
        buf[512:512 + len(packed)] = torch.from_numpy(packed)
        buf[512 + len(packed)] = 0xFF  # the next byte: not read
        for fill in (0, 1):
            plan = device_pad.Plan([device_pad.Pad((n, T), torch.bool, 1, False, 0, 512, 10, False, False,
                                                   fillv=fill, bits=shift)], [(0, n, T)], None, 4096, tokens=[10])
            want = torch.full((n, T), bool(fill))
            for i, (s, ln, b0) in enumerate(zip(starts, lens, np.cumsum(lens) - lens)):
                want[i, s:s + ln] = torch.from_numpy(vals[b0:b0 + ln])
            for scatter in (True, False):
                device_pad.SCATTER = scatter
                try:
                    out = torch.zeros((n, T), dtype=torch.bool)
                    device_pad.build(plan, buf, [out], [])
                finally:
                    device_pad.SCATTER = True
                assert torch.equal(out, want), (shift, fill, scatter)


@settings(max_examples=15, deadline=None)
@given(B=st.integers(1, 24), T=st.integers(1, 40), side=st.sampled_from(["right", "left"]), seed=st.integers(0, 9),
       data=st.data())
def test_a_bool_field_goes_to_the_device_as_its_bitmap(tmp_path_factory, B, T, side, seed, data):
    """A padded batch's bool token field (a loss mask of varied values) is joined as its bitmap's bytes and
    unpacked on the device (``Pad.bits``), for a step of two shards and for the contiguous slices of M ranks
    (a slice cut from a shard's row group starts its bitmap at any bit): the CPU decode's batch, bit for bit,
    staged as a bit a token."""
    d = tmp_path_factory.mktemp("bits")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pad_plan, "FLAT_BYTES", 0)  # every output one by one, as large ones are
        many_row_groups(mp)
        for k in range(2):
            b = padded_batch(B=B, T=T, side=side, seed=seed + k)
            g = torch.Generator().manual_seed(seed + k)
            b["loss_mask"] = b["attention_mask"].bool() & (torch.rand(B, T, generator=g) < 0.7)
            with trajstore.Writer(d, rank=k, world_size=2) as w:
                w.append(0, b)
        m = data.draw(st.sampled_from([x for x in range(1, 2 * B + 1) if 2 * B % x == 0 and x != 2]))
        r = trajstore.Reader(d, rank=data.draw(st.integers(0, m - 1)), world_size=m)
        got, plan = device_read(r, 0)
        assert_batch_equal(r.read(0), got)
        (mask,) = [p for p in plan.pads if p.dtype == torch.bool]
        tokens = int(r.read(0)["attention_mask"].sum())
        assert mask.rows == tokens and (mask.bits >= 0 and mask.home) == (tokens > 0)  # (no tokens: no bitmap)


@pytest.mark.parametrize("side", ["right", "left"])
def test_joined_values_are_staged_where_they_were_decoded(tmp_path, side, monkeypatch):
    """A large output padded with one value, its column joined into the arena: its table is the
    arena's values and the pad row written after them (nothing copied into the plan's buffer);
    the mask of ones is built from the lengths, its column not read."""
    monkeypatch.setattr(pad_plan, "FLAT_BYTES", 0)  # every output one by one, as large ones are
    monkeypatch.setattr(parquet, "ROW_GROUP_BYTES", 256)  # several chunks: joined into the arena
    monkeypatch.setattr("trajstore.format.file.parquet.PARALLEL_READ_BYTES", 0)
    b = padded_batch(B=40, T=50, side=side)
    m = b["attention_mask"].bool()
    b["loss_mask"] = m & (torch.arange(50) % 3 != 0)  # varied values: not staged as one value
    b["scores"] = torch.linspace(-1, 1, 40 * 50).reshape(40, 50).masked_fill(~m, 0.0)
    with trajstore.Writer(tmp_path) as w:
        w.append(0, b)
    r = trajstore.Reader(tmp_path)
    sf = r._open(0)
    assert "attention_mask" not in read_table(sf, 0, None, None).column_names
    assert "attention_mask" in read_table(sf, 0, ["attention_mask"], None).column_names
    got, plan = device_read(r, 0)
    assert_batch_equal(r.read(0), got)
    assert_batch_equal(b, got)
    assert_batch_equal(b, r.read(0))
    assert_batch_equal({"attention_mask": b["attention_mask"]}, r.read(0, columns=["attention_mask"]))
    home = {p.dtype for p in plan.pads if p.home}
    assert {torch.int64, torch.bool, torch.float32} <= home  # input_ids, loss_mask, scores
    tokens = int(b["attention_mask"].sum())
    # staged in the plan's own buffer: the [B, T, 3] values (12 bytes a token, not at a whole row of the arena)
    assert plan.home >= tokens * (8 + 1 + 4) and plan.total < tokens * 13 + 1024
    assert plan.inside >= plan.home  # the plan's own tables carved out of the arena after them: one buffer


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@settings(max_examples=40, deadline=None)
@given(st.one_of(batches(), padded_batches(), two_sided_batches(), prompt_completion_batches()),
       st.sampled_from([None, "padded"]), st.sampled_from([0, 2, 8]))
def test_cuda_padded_iter_equals_cpu_replay(batch, layout, prefetch):
    cuda_replay_equals_cpu(batch, layout, prefetch)


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_replay_equals_recorder_replay(tmp_path, side, dev, caplog):
    steps = {s: padded_batch(B=16, T=40, side=side, seed=s, pads="garbage" if s % 2 else "zero") for s in range(4)}
    with trajstore.Recorder(trajstore.DumpReplayConfig(dump=True, path=str(tmp_path))) as rec:
        for s, b in steps.items():
            rec.batch(s, lambda b=b: b)
    cpu = trajstore.Recorder(trajstore.DumpReplayConfig(replay=True, path=str(tmp_path)))
    gpu = trajstore.Recorder(trajstore.DumpReplayConfig(replay=True, path=str(tmp_path), device=dev))
    r = trajstore.Reader(cpu.path, cpu.split)
    caplog.set_level("INFO", logger="trajstore.recorder")
    loads = 0
    for prefetch in (2, 8) if dev == "cpu" else (2, 4, 8):
        for s, b in r.iter(device=dev, prefetch=prefetch):
            want = cpu.batch(s, lambda: None)
            assert_batch_equal(steps[s], want)
            on_cuda_equal(want, b)
            on_cuda_equal(want, gpu.batch(s, lambda: None))
            loads += 1
    cpu.close()
    gpu.close()
    tokens = {f"step={s} " for s in steps}
    lines = [m.getMessage() for m in caplog.records if m.getMessage().startswith("trajstore replay")]
    assert len(lines) == 2 * loads and all(any(t in x for t in tokens) for x in lines)  # each replayed step, logged
