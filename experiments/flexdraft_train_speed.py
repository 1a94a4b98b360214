"""FlexDraft training throughput: mask groups trained per second, on synthetic sequences.

    python experiments/flexdraft_train_speed.py                      # the recipe's settings
    python experiments/flexdraft_train_speed.py recipe.optim.anchors=64 steps=6

Times whole optimiser steps (forward, backward, AdamW) of the recipe's loss on random token
sequences shaped like the self-distillation data (a 160-token prompt, a 190-token answer),
so two settings compare on this machine without any data built. Prints groups per second.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bastion.compose import build_target, resolve_bfloat16, resolve_device
from bastion.drafters.flexdraft import FlexDraftDrafter
from bastion.train.examples import Example
from bastion.train.flexdraft import train_flexdraft

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> None:
    steps = int(next((a.removeprefix("steps=") for a in argv if a.startswith("steps=")), 4))
    overrides = [a for a in argv if not a.startswith("steps=")]
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("training", overrides=["drafter=flexdraft", "packed_weights=false", *overrides])
    cfg.device = resolve_device(cfg.device)
    target = build_target(cfg)
    target.model.requires_grad_(False)
    recipe = cfg.recipe
    gen = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(0, target.args.vocab_size, (350,), generator=gen), torch.zeros(0), 160) for _ in range(64)]
    optim = OmegaConf.to_container(recipe.optim)
    optim.update(steps=steps + 1, save_every=10**9, log_every=1, val_every=10**9,
                 autocast=resolve_bfloat16(optim["autocast"], cfg.device))
    drafter = FlexDraftDrafter(target, recipe.tuned_layers, recipe.group_size, recipe.calibration_hidden,
                               draft_vocab_size=recipe.draft_vocab).to(target.device)
    with tempfile.TemporaryDirectory() as tmp:  # the loop saves its state at the end
        log = train_flexdraft(drafter, examples, Path(tmp) / "state.pt", **optim, val_examples=[])
    seconds = sorted(r["s_per_step"] for r in log[1:])[len(log[1:]) // 2]  # the first step warms up
    groups = optim["seqs_per_step"] * optim["anchors"]
    print(f"{target.name}, {recipe.tuned_layers} tuned layers, group {recipe.group_size}, {groups} groups per step, "
          f"{torch.get_num_threads()} threads: {seconds:.2f} s per step, {groups / seconds:.1f} groups/s")


if __name__ == "__main__":
    main(sys.argv[1:])
