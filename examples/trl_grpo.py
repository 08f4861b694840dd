"""TRL's GRPOTrainer with trajstore's switch: a tiny Qwen2 (built from a config, nothing downloaded) learns
to write long completions; run it once dumping, once replaying, and compare the printed losses.

    python examples/trl_grpo.py --dump dumps/grpo      # generate, score, train; record each generation
    python examples/trl_grpo.py --replay dumps/grpo    # train from the dump: no generation, same losses

Needs trl (``pip install --no-deps -r tests/frameworks.txt``); about 10 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile

import datasets
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig

from trajstore.trainers.trl import GRPOTrainer

WORDS = [f"w{i}" for i in range(40)]


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def model(vocab: int) -> Qwen2ForCausalLM:
    torch.manual_seed(0)  # the same initial weights in both runs
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                        pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=True))


def reward(completions, **_):
    return [float(len(c.split())) for c in completions]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--dump", metavar="DIR")
    mode.add_argument("--replay", metavar="DIR")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    tok = tokenizer()
    prompts = [" ".join(WORDS[i:i + 3]) for i in range(0, 24, 3)]
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
                          max_steps=a.steps, learning_rate=1e-2, beta=0.0, report_to="none", use_cpu=True,
                          save_strategy="no", seed=0, logging_steps=1, disable_tqdm=True)
        trainer = GRPOTrainer(model=model(len(tok)), reward_funcs=reward, args=args, processing_class=tok,
                              train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                              trajstore={"dump": bool(a.dump), "replay": bool(a.replay), "path": a.dump or a.replay})
        trainer.train()
    for e in trainer.state.log_history:
        if "loss" in e:
            print(f"step {e['step']} loss {e['loss']!r}")
    h = hashlib.sha256()
    for p in trainer.model.parameters():
        h.update(p.detach().numpy().tobytes())
    print("weights sha256", h.hexdigest())


if __name__ == "__main__":
    main()
