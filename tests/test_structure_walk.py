"""The structure walk of ``Writer.append`` goes down: the form, the masks and which fields follow which
mask are decided once (``format/batch/layout.py``, ``structure``) and handed on as a ``Layout``; the
per-field checks (``format/batch/check.py``) and the encoder (``format/codec/encoder.py``) consume it
and never go back to ``layout``. Followed with ``sys.setprofile`` (tests/_walk.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from trajstore import schema, testing
from trajstore.format.batch import check, containers

from _walk import BATCHES, CHECK, ENCODE, Tracer, Walk, follow

LAYOUT = "format.batch.layout"
WALK = {"format.batch.check", LAYOUT}  # the structure walk's own modules; the rest are leaves below them
# the questions of a batch's structure, each asked once: its form and mask groups (structure, with the
# groups inferred from names and shapes), what every tensor field follows (_follows), and the values
# that show the sides of the masks and the rows of a packed batch (read by the encoder only)
ONCE = ("structure", "_infer_groups", "_follows")
READS = ("_read_groups", "_read_cu_seqlens")


def _layout_stays(walk: Walk) -> int:
    stays = [m for m in walk.stays if m in WALK]
    return sum(1 for a, b in zip([None] + stays, stays) if b == LAYOUT and a != LAYOUT)


def _assert_down(walk: Walk, name: str) -> None:
    assert _layout_stays(walk) <= 1, (
        f"{name}: the walk returns to layout: {' > '.join(m.rsplit('.', 1)[-1] for m in walk.stays)}")
    for q in ONCE + READS:
        assert walk.count(LAYOUT, q) <= 1, f"{name}: layout.{q} asked {walk.count(LAYOUT, q)} times"


@pytest.mark.parametrize("name", list(BATCHES))
def test_append_walk_goes_down(name: str, tmp_path: Path) -> None:
    try:
        batch, masks = BATCHES[name]()
    except ImportError:
        pytest.skip(f"{name}: its container library is not installed")
    chk, enc = follow(batch, tmp_path, masks)
    dict_batch = name != "list"
    for what, walk in (("append", chk), ("encoder", enc)):
        _assert_down(walk, f"{name} {what}")
        for q in ("structure", "_follows"):  # asked exactly once on each path of a dict batch; a list batch has none
            assert walk.count(LAYOUT, q) == int(dict_batch), f"{name} {what}: layout.{q}"
    assert not any(chk.count(LAYOUT, q) for q in READS if q == "_read_groups"), "append reads no mask"
    if name in ("padded", "verl-parts", "two-sided", "multi-mask", "dataproto", "tensordict"):
        assert enc.count(LAYOUT, "_read_groups") == 1  # the encoder's plan read the masks, once
    if name == "packed":
        assert chk.count(LAYOUT, "_read_cu_seqlens") == enc.count(LAYOUT, "_read_cu_seqlens") == 1


def test_encoder_consumes_the_plan(tmp_path: Path) -> None:
    """The encoder asks layout nothing once it encodes: every layout call is inside its ``check.plan``,
    before the batch's spec is built (``_dict_batch``) from the plan."""
    for name in ("padded", "two-sided", "multi-mask", "packed"):
        batch, masks = BATCHES[name]()
        _, enc = follow(batch, tmp_path / name, masks)
        last = max(i for i, (m, _) in enumerate(enc.calls) if m == LAYOUT)
        assert last < enc.calls.index(("format.codec.encoder", "_dict_batch")), name


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(testing.batches())
def test_any_batch_walk_goes_down(batch: object) -> None:
    """Every batch form trajstore.testing draws: ``check`` and ``encode_plain`` each go down."""
    plain, tag = containers.unwrap(batch)
    tracer = Tracer({CHECK, ENCODE})
    with tracer:
        check.check(plain)
        schema.encode_plain(plain, tag, step=0, split="train")
    (chk,), (enc,) = tracer.walks[CHECK], tracer.walks[ENCODE]
    _assert_down(chk, "check")
    _assert_down(enc, "encode_plain")
