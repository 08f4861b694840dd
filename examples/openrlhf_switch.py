"""OpenRLHF's own PPO launcher (``openrlhf.cli.train_ppo_ray``, every flag of it) with trajstore's
``PPOTrainer`` (docs/frameworks/openrlhf.md): each step's experiences dumped or replayed.

    ray job submit --runtime-env-json='{"working_dir": ".", "env_vars": {"TRAJSTORE_DUMP": "1",
        "TRAJSTORE_PATH": "/shared/dumps/ppo"}}' -- python3 examples/openrlhf_switch.py --actor.model_name_or_path ...
    ray job submit --runtime-env-json='{"working_dir": ".", "env_vars": {"TRAJSTORE_REPLAY": "1",
        "TRAJSTORE_PATH": "/shared/dumps/ppo"}}' -- python3 examples/openrlhf_switch.py ... --vllm.num_engines 0 --eval.steps -1

The path is where the trainer's Ray actor writes: a folder every node sees (or an ``s3://`` URL). Replay
starts no vLLM engine (``--vllm.num_engines 0``) and never generates. Needs OpenRLHF and its GPUs.
"""

import runpy

import openrlhf.trainer.ppo_trainer as ppo_trainer

from trajstore.trainers.openrlhf import PPOTrainer

ppo_trainer.PPOTrainer = PPOTrainer  # the class train_ppo_ray's train() imports when it runs

if __name__ == "__main__":
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
