"""Train a drafter for a target: self-distillation data, then the drafter's recipe.

    python train.py drafter=dflash target=smollm2_135m
    python train.py drafter=dflash target=smollm2_135m recipe.optim.steps=200   # shorter
    python train.py drafter=dflash target=smollm2_135m logger=wandb             # the training log to W&B too
Rerunning the same command resumes: finished data shards and the last checkpoint are kept.
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig


@hydra.main(config_path="conf", config_name="training", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from bastion.errors import user_errors
    from bastion.train.cli import train

    logging.captureWarnings(True)  # warnings too reach train.log, through Hydra's job logging
    with user_errors():
        train(cfg)


if __name__ == "__main__":
    main()
