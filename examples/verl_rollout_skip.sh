#!/usr/bin/env bash
# verl 0.9.1 with trajstore's RolloutSkip (docs/frameworks/verl.md): the first run generates steps 1-5 and
# records each generation output in dumps/verl; the second replays them with no LLM server, agent-loop
# worker or weight sync started.
# Pass verl's own arguments of your run (model, data, rollout...) after the script's name.
set -euo pipefail
SWITCH=(
  +actor_rollout_ref.rollout.agent.agent_loop_manager_class=trajstore.trainers.verl.AgentLoopManager
  +actor_rollout_ref.rollout.checkpoint_manager_class=trajstore.trainers.verl.CheckpointEngineManager
  skip.rollout.enable=True
  skip.rollout.dump_dir=dumps/verl
  'skip.rollout.steps=[1,2,3,4,5]'
  trainer.total_training_steps=5
)
# dump: generate and record each step (TRAJSTORE_VERL_FIT=1: fit()'s batch after advantages too, split "fit")
TRAJSTORE_VERL_FIT=1 python -m verl.trainer.main_ppo "$@" "${SWITCH[@]}"
# replay: every step is in the dump and validation is off, so init_workers() starts no LLM server, no
# agent-loop worker starts and fit()'s weight updates do nothing
python -m verl.trainer.main_ppo "$@" "${SWITCH[@]}" trainer.val_before_train=False trainer.test_freq=-1
trajstore info dumps/verl/*/*                                               # the recorded steps
