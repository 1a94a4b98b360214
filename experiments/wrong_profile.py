"""Does online calibration rescue a wrong hardware profile?

    python experiments/wrong_profile.py                      # SmolLM2-135M, DFlash, h100 profile on this CPU

Decodes with BASTION started from the h100 profile's prior alone (no probe), and at every step
asks a reference controller calibrated for this machine (gpu=cpu, start-up probe, refitted
online from the same measured steps) which tree size *it* would choose for the same trees. Prints both per step and the first step from which
the wrong-profile choice stays within 20% of the reference.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bastion.bench.datasets import chat_tokens, load_prompts
from bastion.budget.controller import BastionBudget
from bastion.budget.hardware import profile_from_config
from bastion.compose import build, build_target, packed, resolve_device
from bastion.engine import generate

ROOT = Path(__file__).resolve().parents[1]


class Shadowed:
    """Decodes with `live`; every step also records the size `reference` would pick."""

    def __init__(self, live: BastionBudget, reference: BastionBudget):
        self.live, self.reference, self.max_nodes = live, reference, live.max_nodes
        self.choices: list[tuple[int, int]] = []

    @property
    def predicted_s(self):
        return self.live.predicted_s

    def drafts(self):
        return self.live.drafts()

    def size(self, trees, contexts):
        # the reference learns from the same measured steps (times, acceptance), so the two
        # differ only in where their latency model started: the probe's fit, or the h100 prior
        ref = sum(t.n_nodes for t in self.reference.size(trees, contexts))
        exploring = self.live.exploring
        sized = self.live.size(trees, contexts)
        self.choices.append((sum(t.n_nodes for t in sized), ref, exploring))
        return sized

    def observe(self, step, contexts, width):
        self.live.observe(step, contexts, width)
        self.reference.observe(step, contexts, width)  # gpu=cpu as a run would use it: also refitted online


def main(overrides: list[str]) -> None:
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["drafter=dflash", "tree=best_first", "budget=bastion", *overrides])
    cfg.device = resolve_device(cfg.device)
    target = build_target(cfg)
    drafter, policy = packed(cfg, build(cfg.drafter, target=target)), build(cfg.tree)
    h100, cpu = (profile_from_config(OmegaConf.to_container(OmegaConf.load(ROOT / f"conf/gpu/{g}.yaml")), cfg.device, [])
                 for g in ("h100", "cpu"))
    live = BastionBudget(probe=False)
    live.start(target, h100, Path(cfg.cache_dir))
    reference = BastionBudget(probe=True, tolerance=math.inf)  # never explores: its choice is its argmax
    reference.start(target, cpu, Path(cfg.cache_dir))
    budget = Shadowed(live, reference)
    for prompt in load_prompts("gsm8k", 2):
        tokens = chat_tokens(target, [{"role": "user", "content": prompt.turns[0]}])
        generate(target, [tokens], drafter=drafter, policy=policy, budget=budget, max_new_tokens=96)
    print(f"{'step':>4} {'h100 prior':>11} {'cpu probe':>10}")
    for i, (n, ref, exploring) in enumerate(budget.choices[:40]):
        print(f"{i + 1:>4} {n:>11} {ref:>10}{'  (exploring)' if exploring else ''}")
    print(f"{'steps':>8} {'median |n - ref| / ref':>23} {'within 20%':>11}")
    for lo, hi in ((1, 10), (11, 20), (21, 40), (41, len(budget.choices))):
        window = budget.choices[lo - 1 : hi]
        gaps = [abs(n - ref) / max(ref, 1) for n, ref, _ in window]
        print(f"{lo:>3}-{hi:<4} {np.median(gaps):>23.0%} {np.mean([g <= 0.2 for g in gaps]):>11.0%}")


if __name__ == "__main__":
    main(sys.argv[1:])
