"""SkyRL's PPO entrypoint (``skyrl_train.entrypoints.main_base``, its Hydra config and overrides) with
trajstore's switch (docs/frameworks/skyrl.md): each step's generator output dumped or replayed.

    python examples/skyrl_switch.py ... +trajstore.dump=true +trajstore.path=/shared/dumps/skyrl
    python examples/skyrl_switch.py ... trainer.eval_interval=-1 +trajstore.replay=true +trajstore.path=/shared/dumps/skyrl

``...`` are the run's SkyRL overrides (data, model, placement...). The path is where the trainer's Ray task
writes: a folder every node sees (or an ``s3://`` URL). Replay builds no inference engine and never
generates. Needs skyrl-train and its GPUs.
"""

import hydra
import ray
from omegaconf import DictConfig
from skyrl_train.entrypoints.main_base import BasePPOExp, config_dir
from skyrl_train.utils import validate_cfg
from skyrl_train.utils.utils import initialize_ray

from trajstore.trainers.skyrl import Exp


class PPOExp(Exp, BasePPOExp):
    """SkyRL's experiment; its trainer is ``trajstore.trainers.skyrl.RayPPOTrainer``."""


@ray.remote(num_cpus=1)
def entrypoint(cfg: DictConfig) -> None:
    PPOExp(cfg).run()  # the training loop runs in a Ray task, not on the head node (as SkyRL's own)


@hydra.main(config_path=config_dir, config_name="ppo_base_config", version_base=None)
def main(cfg: DictConfig) -> None:
    validate_cfg(cfg)
    initialize_ray(cfg)
    ray.get(entrypoint.remote(cfg))


if __name__ == "__main__":
    main()
