"""What the pages of ``trajstore view`` say, without a browser: tokens of a byte-level tokenizer decoded
in runs so multi-byte characters come out whole (and a token that is part of one as its bytes),
float32 values at float32 precision, columns with no value hidden, and the diff page's summary of
every field that differs (tests/test_view_browser.py checks the same in Chromium)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("starlette")
pytest.importorskip("plotly")

from trajstore.inspection.traces import load_tokenizer  # noqa: E402
from trajstore.view.pages import View  # noqa: E402
from trajstore.view.tokens import token_texts  # noqa: E402

from _dumps import make_tokenizer, padded_dump, write  # noqa: E402

ACCENTS = "hello — ça va? naïve café, 日本語 🙂"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def shown(out: list[dict]) -> str:
    """The text a reader of the page sees: each run's whole text once, every other token's text."""
    text, j = [], 0
    while j < len(out):
        if "whole" in out[j]:
            text.append(out[j]["whole"])
            j += out[j]["span"]
        else:
            text.append(out[j]["text"])
            j += 1
    return "".join(text)


def test_multi_byte_characters_come_out_whole_and_their_pieces_as_bytes(tok):
    t = load_tokenizer(tok)
    ids = t.encode(ACCENTS).ids
    out = token_texts(t, ids)
    assert shown(out) == ACCENTS
    assert not any("\ufffd" in o.get("whole", o["text"]) for o in out if "part" not in o)
    runs = [(j, o) for j, o in enumerate(out) if "whole" in o]
    assert {"—", "ï", "日", "🙂"} <= {c for _, o in runs for c in o["whole"]}, runs  # split by this tokenizer
    for j, o in runs:  # each token of a run shows its own bytes; together they are the run's UTF-8
        parts = [out[k]["part"] for k in range(j, j + o["span"])]
        assert b"".join(bytes.fromhex(p) for p in parts) == o["whole"].encode()
    # decoded one token at a time (what the page did) the same text is mojibake
    assert "\ufffd" in "".join(t.decode([i]) for i in ids)


def test_byte_fallback_pieces_show_their_bytes():
    """SentencePiece-style byte fallback: a character outside the vocabulary is ``<0xNN>`` pieces."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate("abc ")}}
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    t.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    ids = t.encode("aïb 日").ids
    out = token_texts(t, ids)
    assert shown(out) == "aïb 日"
    assert [(o.get("whole"), o.get("part")) for o in out] == [
        (None, None), ("ï", "c3"), (None, "af"), (None, None), (None, None), ("日", "e6"), (None, "97"), (None, "a5")]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_any_text_reads_back_whole(tok, text):
    t = load_tokenizer(tok)
    ids = t.encode(text).ids
    out = token_texts(t, ids)
    assert len(out) == len(ids)
    assert shown(out) == t.decode(ids) == text


def test_float32_values_are_shown_at_float32_precision(tmp_path):
    b = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.bool),
         "old_logprobs": torch.tensor([[-0.1, -0.2, -0.3]]), "logprobs": torch.tensor([[-0.1, -0.2, -0.3]]).bfloat16(),
         "rewards": torch.tensor([0.2]), "kl": torch.tensor([0.1], dtype=torch.float64), "note": ["x"]}
    write(tmp_path / "d", {0: b})
    v = View(tmp_path / "d")
    row = v.step(None, 0)["rows"][0]
    assert (row["reward"], row["kl"]) == (0.2, 0.1)  # JSON 0.2, not 0.20000000298023224
    assert np.float32(row["reward"]) == np.float32(0.2)  # still the stored float32, bit for bit
    tr = v.traj(None, 0, 0)
    assert [k["logprob"] for k in tr["tokens"]] == ["-0.1", "-0.2", "-0.3"]
    assert [k["other"] for k in tr["tokens"]] == [str(np.float32(x)) for x in b["logprobs"][0].float().tolist()]
    assert tr["values"]["rewards"] == 0.2
    assert "old_logprobs=-0.1 logprobs=" in tr["tokens"][0]["title"]


def test_columns_with_no_value_are_hidden_and_text_columns_named(tmp_path):
    b = {"input_ids": torch.tensor([[5, 6], [7, 8]]), "attention_mask": torch.ones(2, 2, dtype=torch.bool),
         "rewards": torch.tensor([1.0, 0.0]), "prompt": ["a", "b"]}
    write(tmp_path / "d", {0: b})
    page = View(tmp_path / "d").step(None, 0)
    assert page["columns"] == ["index", "reward", "length", "prompt"]  # no versions field: no version column
    assert page["empty"] == ["version"] and page["text"] == ["prompt"]


def test_diff_summary_names_every_field_that_differs(tmp_path, tok):
    padded_dump(tmp_path / "a", tok, steps=(0, 1, 2, 3))
    padded_dump(tmp_path / "b", tok, steps=(0, 1, 2), perturb=(1, 2, 3, 0.5))
    b = padded_dump(tmp_path / "c", tok, steps=(0,))[0]
    b["rewards"] = b["rewards"] + 1
    write(tmp_path / "b", {2: b}, overwrite=True)  # step 2 of b: step 0's values, other rewards
    d = View(tmp_path / "a", tokenizer=tok, other=tmp_path / "b").diff()
    s = d["summary"]
    got = (s["compared"], s["identical_steps"], s["differ_steps"], s["only_a"], s["only_b"])
    assert got == (3, "0", "1-2", "3", "none")
    assert sorted(s["differ_fields"]) == ["logprobs", "old_logprobs", "rewards", "uid", "versions"], s
    assert sorted(s["identical_fields"]) == ["attention_mask", "input_ids", "loss_mask"]
    by = {f["field"]: f for f in d["fields"]}
    assert by["logprobs"]["first"]["step"] == 1 and by["logprobs"]["first"]["trajectory"] == 2
    assert by["rewards"]["first"]["step"] == 2 and by["rewards"]["status"] == "differs"
    assert d["first"]["field"] == "logprobs"
