"""Decode a benchmark with AR and the composed method in one run; print and save the table.

    python run.py                                   # defaults: SmolLM2-135M, GSM8K, DFlash + best_first + BASTION budget
    python run.py drafter=ngram tree=chain budget=fixed budget.nodes=4 bench.limit=20
    python run.py --cfg job                         # print the composed config
"""

from __future__ import annotations

import importlib.util
import logging
import sys

import hydra
from omegaconf import DictConfig


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package (hydra_plugins) is missing too
        return False


def check_launcher(argv: list[str]) -> None:
    """Hydra's own error for a launcher plugin that is not installed names a config file, not
    the package: say which extra to install instead."""
    if "hydra/launcher=slurm" in argv and not installed("hydra_plugins.hydra_submitit_launcher"):
        print("error: hydra/launcher=slurm needs Hydra's submitit plugin: run `pip install '.[cluster]'` "
              "in the bastion checkout.", file=sys.stderr)
        raise SystemExit(2)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from bastion.errors import user_errors
    from bastion.bench.cli import run

    logging.captureWarnings(True)  # warnings too reach run.log, through Hydra's job logging
    with user_errors():
        run(cfg)


if __name__ == "__main__":
    check_launcher(sys.argv[1:])
    main()
