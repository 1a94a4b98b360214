"""Decode a benchmark with AR and the composed method in one run; print and save the table.

    python run.py                                   # defaults: SmolLM2-135M, GSM8K, DFlash + best_first + BASTION budget
    python run.py drafter=ngram tree=chain budget.nodes=4 bench.limit=20
    python run.py --cfg job                         # print the composed config
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from bastion.errors import user_errors
    from bastion.bench.cli import run

    with user_errors():
        run(cfg)


if __name__ == "__main__":
    main()
