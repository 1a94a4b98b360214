"""What limits the DFlash drafter? The default recipe trained for the same number of steps with
one knob changed at a time (data size, draft depth, block size), judged by the held-out chain
AAL: the acceptance length chain decoding gets at temperature 0 on answers never trained on.

    python experiments/dflash_limits.py [steps] [variant ...]   # SmolLM2-135M, 600 steps
    python experiments/dflash_limits.py 600 base half_data      # ~15 min on 2 cores

Variants: base (the recipe in conf/recipe/dflash.yaml), half_data (half the training answers),
layers_3 (3 draft layers), block_8 and block_16 (the block, root included; the recipe's is 4).
Uses the data `python train.py drafter=dflash target=smollm2_135m` generates (from its cache;
built first when missing); it trains nothing into checkpoints/. Prints one JSON line per
variant: seconds per step, the held-out chain AAL over all held-out answers, and per 100 steps
val_chain_aal, train and held-out acc@1. Steps cost differently (a third layer or a longer block
costs more), so compare at equal time too.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from bastion.compose import build
from bastion.train.cli import new_dflash_drafter, training_examples
from bastion.train.dflash import chain_aal, train_dflash

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {  # name -> what differs from the recipe
    "base": {},
    "half_data": {"data_share": 0.5},
    "layers_3": {"layers": 3},
    "block_8": {"block_size": 8},
    "block_16": {"block_size": 16},
}


def main(steps: int, names: list[str]) -> None:
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("training", overrides=["drafter=dflash", "target=smollm2_135m", "device=cpu"])
    target = build(cfg.target, name=cfg.target.name)
    target.model.requires_grad_(False)
    layers, examples, held_out = training_examples(cfg, target)
    recipe = cfg.recipe
    loop = {**recipe.optim, "steps": steps, "save_every": steps, "log_every": 100}
    for name in names:
        knobs = {"layers": recipe.layers, "block_size": recipe.block_size, "data_share": 1.0, **VARIANTS[name]}
        torch.manual_seed(cfg.seed)
        drafter = new_dflash_drafter(cfg, target, layers, examples, knobs["layers"], knobs["block_size"])
        train = examples[: int(len(examples) * knobs["data_share"])]
        with tempfile.TemporaryDirectory() as tmp:
            log = train_dflash(drafter, train, Path(tmp) / "state.pt", **loop, val_examples=held_out, val_every=100, seed=cfg.seed)
        drafter.eval()
        print(json.dumps({"variant": name, **knobs, "train_answers": len(train), "held_out_answers": len(held_out),
                          "s_per_step": round(sum(r["s_per_step"] for r in log) / len(log), 3),
                          "held_out_chain_aal": round(chain_aal(drafter, held_out), 4),
                          "per_100_steps": [{"step": r["step"], "val_chain_aal": r.get("val_chain_aal"), "acc1": r["acc"][0],
                                             "val_acc1": r.get("val_acc", [None])[0]} for r in log]}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 600, sys.argv[2:] or list(VARIANTS))
