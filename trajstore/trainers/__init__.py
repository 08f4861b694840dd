"""One dump/replay switch per RL trainer, each in the trainer's own terms.

* ``trainers.verl``: a drop-in for verl's ``RolloutSkip`` (``skip.rollout.*`` in verl's config) and the
  ``AgentLoopManager`` that turns it on (``actor_rollout_ref.rollout.agent.agent_loop_manager_class``).
* ``trainers.trl``: ``GRPOTrainer`` and ``RLOOTrainer`` whose generate-and-score step is recorded or
  replayed (``TRAJSTORE_DUMP=1`` / ``TRAJSTORE_REPLAY=1``).
* ``trainers.areal``: the ``debug.dump_rollout_data`` / ``debug.replay_rollout_data`` / ``debug.path`` keys
  of AReaL's config, and the rollout engine wrap behind them.
* ``trainers.openrlhf``: OpenRLHF's ``PPOTrainer`` (a Ray actor class) whose experience maker step is
  recorded or replayed (``TRAJSTORE_DUMP=1`` / ``TRAJSTORE_REPLAY=1``).
* ``trainers.skyrl``: SkyRL's ``RayPPOTrainer`` whose ``generate`` step is recorded or replayed, and the
  ``BasePPOExp`` mixin whose replay builds no inference engine (a ``trajstore`` config section or
  ``TRAJSTORE_*``).

Each module imports its framework at the top: import it only where the framework is installed. They
sit above the Recorder (``trajstore.recorder``); docs/frameworks/<name>.md is each one's page.

May import: ``trajstore.record`` and every layer below, and its framework.
"""

__all__: list[str] = []
