"""AReaL's GRPO/PPO trainer with trajstore's switch (docs/frameworks/areal.md): AReaL's config gets a
``debug`` section, and the trainer dumps or replays its rollout batches by it.

    python examples/areal_switch.py --config grpo.yaml debug.dump_rollout_data=true debug.path=dumps/areal
    python examples/areal_switch.py --config grpo.yaml debug.replay_rollout_data=true debug.path=dumps/areal

``grpo.yaml`` is your AReaL experiment's config with ``debug: {dump_rollout_data: false,
replay_rollout_data: false, path: null}`` added (Hydra overrides only keys the YAML has). Replay builds
no inference engine; turn the evaluator off when replaying. Needs AReaL and its trainer's packages.
"""

import sys

from areal.api.cli_args import load_expr_config
from areal.dataset import get_custom_dataset
from areal.reward.gsm8k import gsm8k_reward_fn
from areal.trainer import PPOTrainer
from areal.utils.hf_utils import load_hf_tokenizer
from areal.workflow.rlvr import RLVRWorkflow

from trajstore.trainers.areal import PPOConfig, Switch


class Trainer(Switch, PPOTrainer):
    """AReaL's PPOTrainer; ``config.debug`` dumps or replays its rollout batches."""


def main(argv: list[str]) -> None:
    config, _ = load_expr_config(argv, PPOConfig)
    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train = get_custom_dataset(split="train", dataset_config=config.train_dataset, tokenizer=tokenizer)
    workflow = RLVRWorkflow(reward_fn=gsm8k_reward_fn, gconfig=config.gconfig, tokenizer=tokenizer)
    with Trainer(config, train_dataset=train) as trainer:
        trainer.train(workflow=workflow)


if __name__ == "__main__":
    main(sys.argv[1:])
