"""Readable traces decode the original strings with a real tokenizer; multi-turn split by the loss mask;
rejected trajectories counted, never crashing."""

import json
import tempfile

import numpy as np
import pytest
import torch
from _dumps import CONVERSATIONS, REWARDS, list_dump, make_tokenizer, padded_dump, write
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore import ConfigError
from trajstore.format.codec.rows import rows
from trajstore.inspection.describe import describe
from trajstore.inspection.traces import load_tokenizer, run_lengths
from trajstore.testing import batches


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("side", ["right", "left"])
def test_multi_turn_segments_give_back_the_strings(tmp_path, tok_path, side):
    padded_dump(tmp_path / "d", tok_path, steps=(4,), pad_side=side)
    ts = trajstore.traces(trajstore.Reader(tmp_path / "d"), 4, tok_path)
    assert [t["index"] for t in ts] == [0, 1, 2]
    for t, conv, rw in zip(ts, CONVERSATIONS, REWARDS):
        assert t["rejected"] is False and t["step"] == 4
        assert t["prompt"] == conv[0][1]
        assert t["completion"] == "".join(text for _, text in conv[1:])
        assert t["reward"] == pytest.approx(rw + 4)
        assert t["multi_turn"] is (len(conv) > 2)
        assert t["lengths"]["total"] == t["lengths"]["prompt"] + t["lengths"]["completion"]
        assert t["fields"]["uid"] == f"s4-t{t['index']}"
    multi = ts[0]
    assert [(m["role"], m["text"]) for m in multi["messages"]] == list(CONVERSATIONS[0])
    # the policy version changes at the second model turn: run-length summary
    n = [m["tokens"] for m in multi["messages"]]
    assert multi["versions"] == [[7, n[0] + n[1] + n[2]], [8, n[3]]]
    assert multi["lengths"]["model"] == multi["messages"][1]["tokens"] + multi["messages"][3]["tokens"]
    assert "messages" not in ts[1]  # single turn with text: prompt + completion say it all
    json.dumps(ts)  # JSON-able


def test_without_tokenizer_gives_token_ids(tmp_path, tok_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    padded_dump(tmp_path / "d", tok_path, steps=(0,))
    t = trajstore.traces(trajstore.Reader(tmp_path / "d"), 0)[1]
    assert "prompt" not in t
    ids = [m["ids"] for m in t["messages"]]
    assert ids == [tok.encode(text).ids for _, text in CONVERSATIONS[1]]


def test_logprobs_aligned_to_tokens(tmp_path, tok_path):
    written = padded_dump(tmp_path / "d", tok_path, steps=(0,))
    t = trajstore.traces(trajstore.Reader(tmp_path / "d"), 0, tok_path, logprobs=True)[0]
    got = np.concatenate([m["logprobs"] for m in t["messages"]])
    n = t["lengths"]["total"]
    assert np.array_equal(got.astype(np.float32), written[0]["logprobs"][0, :n].numpy())


def test_list_batch_rejected_counted_and_capped(tmp_path, tok_path):
    list_dump(tmp_path / "d", tok_path, steps=(0, 1))
    r = trajstore.Reader(tmp_path / "d")
    ts = trajstore.traces(r, 1, str(tok_path.parent))  # a directory holding tokenizer.json
    assert [t["rejected"] for t in ts] == [False, True, False]
    assert ts[1] == {"step": 1, "index": 1, "rejected": True}
    assert [t["prompt"] for t in ts if not t["rejected"]] == [c[0][1] for c in CONVERSATIONS[1:]]
    assert [t["completion"] for t in ts if not t["rejected"]] == [c[1][1] for c in CONVERSATIONS[1:]]
    assert [t["reward"] for t in ts if not t["rejected"]] == [1.0, 2.0]
    assert all(t["versions"] == 1 for t in ts if not t["rejected"])
    capped = trajstore.traces(r, 1, tok_path, max_per_step=1)
    assert sum(not t["rejected"] for t in capped) == 1
    assert sum(t["rejected"] for t in capped) == 1  # every rejected one is still counted
    lp = trajstore.traces(r, 0, tok_path, logprobs=True)[0]["messages"]
    assert "logprobs" not in lp[0] and lp[1]["logprobs"] == pytest.approx([-i / 10 for i in range(lp[1]["tokens"])])


def test_all_rejected_step(tmp_path):
    ts = trajstore.traces(write(tmp_path, {0: [None, None]}), 0, max_per_step=0)
    assert ts == [{"step": 0, "index": i, "rejected": True} for i in range(2)]


def test_packed_batch(tmp_path, tok_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    texts = ["What is 2 + 3?", " The answer is 5.", "Write a haiku", " Red leaves"]
    ids = [tok.encode(t).ids for t in texts]
    seqs = [ids[0] + ids[1], ids[2] + ids[3]]
    lm = [[0] * len(ids[0]) + [1] * len(ids[1]), [0] * len(ids[2]) + [1] * len(ids[3])]
    cu = torch.tensor([0, len(seqs[0]), len(seqs[0]) + len(seqs[1])], dtype=torch.int32)
    batch = {"input_ids": torch.tensor(seqs[0] + seqs[1]), "loss_mask": torch.tensor(lm[0] + lm[1]),
             "cu_seqlens": cu, "rewards": torch.tensor([1.0, 0.0])}
    ts = trajstore.traces(write(tmp_path, {0: batch}), 0, tok_path)
    assert [(t["prompt"], t["completion"]) for t in ts] == [(texts[0], texts[1]), (texts[2], texts[3])]


def test_field_overrides_and_errors(tmp_path, tok_path):
    padded_dump(tmp_path / "d", tok_path, steps=(0,))
    r = trajstore.Reader(tmp_path / "d")
    t = trajstore.traces(r, 0, tok_path, fields={"mask": None})[0]  # no mask: one sequence segment
    assert [m["role"] for m in t.get("messages", [])] in ([], ["sequence"])
    assert t["completion"] == "".join(text for _, text in CONVERSATIONS[0])
    with pytest.raises(ConfigError, match="unknown role"):
        trajstore.traces(r, 0, fields={"bogus": "x"})
    with pytest.raises(ConfigError, match="no such file"):
        trajstore.traces(r, 0, tmp_path / "nope.json")
    with pytest.raises(KeyError, match="step 9"):
        trajstore.traces(r, 9)


@settings(max_examples=30)
@given(st.lists(st.integers(0, 3), max_size=20))
def test_run_lengths_roundtrip(vals):
    rl = run_lengths(vals)
    assert [v for v, n in rl for _ in range(n)] == vals
    assert all(a[0] != b[0] for a, b in zip(rl, rl[1:]))


def test_rows_cut_padding(tmp_path, tok_path):
    written = padded_dump(tmp_path / "d", tok_path, steps=(0,), pad_side="left")
    r = trajstore.Reader(tmp_path / "d")
    rs = rows(r[0], r.info(0)["batch"])
    am = written[0]["attention_mask"]
    for i, row in enumerate(rs):
        assert np.array_equal(row["input_ids"], written[0]["input_ids"][i][am[i]].numpy())
        assert row["rewards"] == written[0]["rewards"][i].item()


def test_load_tokenizer_passthrough(tok_path):
    t = load_tokenizer(tok_path)
    assert load_tokenizer(t) is t and load_tokenizer(None) is None


def test_text_fields(tmp_path):
    r = write(tmp_path, {0: {"prompt": ["hi there", "yo"], "response": ["hello!", "sup"], "reward": [1.0, 0.0]}})
    ts = trajstore.traces(r, 0)
    assert [(t["prompt"], t["completion"], t["reward"]) for t in ts] == [("hi there", "hello!", 1.0),
                                                                         ("yo", "sup", 0.0)]


@settings(max_examples=40, deadline=None)
@given(batches())
def test_any_batch_traces_and_self_diff(batch):
    """Every batch form: traces never crash, count rejected rows, and a dump equals itself."""
    with tempfile.TemporaryDirectory() as d:
        r = write(d, {0: batch})
        ts = trajstore.traces(r, 0, logprobs=True)
        json.dumps(ts)
        n_none = sum(x is None for x in batch) if isinstance(batch, list) else 0
        assert sum(t["rejected"] for t in ts) == n_none
        assert [t["index"] for t in ts] == list(range(len(rows(r[0], r.info(0)["batch"]))))
        rep = trajstore.diff(d, d)
        assert rep.identical, rep.first_divergence
        assert len(r.to_pandas(0)) == len(ts)


def test_verl_style_batch(tmp_path, tok_path):
    """prompts left-padded [B, P], responses right-padded [B, R], response_mask 0 on tool tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    enc = [[(role, tok.encode(text).ids) for role, text in conv] for conv in CONVERSATIONS]
    P = max(len(c[0][1]) for c in enc) + 1
    R = max(sum(len(ids) for _, ids in c[1:]) for c in enc) + 3
    B = len(enc)
    prompts, responses = torch.zeros(B, P, dtype=torch.int64), torch.zeros(B, R, dtype=torch.int64)
    am = torch.zeros(B, P + R, dtype=torch.int64)
    rmask = torch.zeros(B, R, dtype=torch.int64)
    scores = torch.zeros(B, R)
    old_lp = torch.zeros(B, R)
    for i, conv in enumerate(enc):
        p = conv[0][1]
        prompts[i, P - len(p):] = torch.tensor(p)
        am[i, P - len(p):P] = 1
        resp = [x for _, ids in conv[1:] for x in ids]
        m = [int(role == "model") for role, ids in conv[1:] for _ in ids]
        responses[i, :len(resp)] = torch.tensor(resp)
        rmask[i, :len(resp)] = torch.tensor(m)
        am[i, P:P + len(resp)] = 1
        scores[i, len(resp) - 1] = REWARDS[i]
        old_lp[i, :len(resp)] = -torch.arange(1, len(resp) + 1) / 100
    batch = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
             "attention_mask": am, "response_mask": rmask, "old_log_probs": old_lp,
             "token_level_scores": scores}
    ts = trajstore.traces(write(tmp_path, {0: batch}), 0, tok_path, logprobs=True)
    assert describe(tmp_path)["splits"]["train"]["tokens"] == int(am.sum())  # mask with holes
    for t, conv, rw in zip(ts, CONVERSATIONS, REWARDS):
        assert t["prompt"] == conv[0][1]
        assert t["completion"] == "".join(text for _, text in conv[1:])
        assert t["reward"] == pytest.approx(rw)
        assert [(m["role"], m["text"]) for m in t["messages"]] == list(conv)
        lps = [x for m in t["messages"][1:] for x in m["logprobs"]]
        assert lps == pytest.approx([-(k + 1) / 100 for k in range(t["lengths"]["completion"])])
