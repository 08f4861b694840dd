"""The TRL switch (``trajstore.trainers.trl``) on TRL 1.16.0's real trainers (tests/frameworks.txt):
a tiny Qwen2 model built from a config and a tokenizer trained here (nothing downloaded), trained 3
steps by ``GRPOTrainer.train()`` with the batches dumped, then 3 steps again from the same initial
weights replayed with generation made to raise: the losses and the final weights are the dump run's,
bit for bit. RLOO the same way."""

import pytest
import torch

import trajstore
from trajstore.testing import assert_batch_equal

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from trajstore.trainers import trl as switch  # noqa: E402

WORDS = [f"w{i}" for i in range(40)]


def tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def model(tok):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg)


def reward(completions, **_):
    return [float(len(c.split())) for c in completions]


def train(kind, tmp_path, mode, losses, batches):
    tok = tokenizer()
    prompts = [" ".join(WORDS[i:i + 3]) for i in range(0, 24, 3)]
    Config, Trainer = {"grpo": (trl.GRPOConfig, switch.GRPOTrainer), "rloo": (trl.RLOOConfig, switch.RLOOTrainer)}[kind]
    args = Config(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
                  max_completion_length=4, max_steps=3, beta=0.0, learning_rate=1e-2, logging_steps=1, report_to="none",
                  use_cpu=True, save_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True)

    class Probe(Trainer):  # the batches the switch gives TRL, and the losses TRL's own compute_loss returns
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            batches.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()})
            return out

        def compute_loss(self, *a, **k):
            loss = super().compute_loss(*a, **k)
            losses.append(loss.detach().clone())
            return loss

    t = Probe(model=model(tok), reward_funcs=reward, args=args, processing_class=tok,
              train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
              trajstore={mode: True, "path": str(tmp_path / "dump")})
    t.train()
    return t


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_replay_trains_without_generating_and_losses_are_equal(tmp_path, monkeypatch, kind):
    dumped, replayed, generated, loaded = [], [], [], []
    a = train(kind, tmp_path, "dump", dumped, generated)
    r = trajstore.Reader(tmp_path / "dump")
    assert r.steps == [0, 1, 2] and len(dumped) == 3
    for step, batch in zip(r.steps, generated, strict=True):  # what TRL's method returned, as it returned it
        assert_batch_equal(r[step], batch)
        assert set(r.meta(step)) == {switch.RNG_KEY}

    base = type(a).__mro__[2]  # TRL's own class
    assert base.__module__.startswith("trl.")

    def no_generation(*_, **__):
        raise AssertionError("replay called generation")
    monkeypatch.setattr(base, "_generate_and_score_completions", no_generation)
    monkeypatch.setattr(base, "_generate", no_generation)
    monkeypatch.setattr(Qwen2ForCausalLM, "generate", no_generation)
    b = train(kind, tmp_path, "replay", replayed, loaded)
    assert len(replayed) == 3
    for x, y in zip(generated, loaded, strict=True):
        assert_batch_equal(y, x)
    for x, y in zip(dumped, replayed, strict=True):
        assert torch.equal(x, y), (dumped, replayed)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
