#!/usr/bin/env bash
# verl 0.9.1 with trajstore's RolloutSkip (docs/frameworks/verl.md): the first run generates steps 1-5 and
# records each generation output in dumps/verl; the second replays them, its agent-loop workers never started.
# Pass verl's own arguments of your run (model, data, rollout...) after the script's name.
set -euo pipefail
SWITCH=(
  actor_rollout_ref.rollout.agent.agent_loop_manager_class=trajstore.trainers.verl.AgentLoopManager
  skip.rollout.enable=True
  skip.rollout.dump_dir=dumps/verl
  'skip.rollout.steps=[1,2,3,4,5]'
  trainer.total_training_steps=5
)
python -m verl.trainer.main_ppo "$@" "${SWITCH[@]}"                         # dump: generate and record
TRAJSTORE_VERL_FIT=1 python -m verl.trainer.main_ppo "$@" "${SWITCH[@]}"    # replay (nothing left to generate)
trajstore info dumps/verl/*/*                                               # the recorded steps
