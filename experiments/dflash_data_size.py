"""Does data size limit the DFlash drafter? The same recipe trained for the same steps on half
and on all of the self-distillation answers, judged by val_chain_aal on the same held-out ones.

    python experiments/dflash_data_size.py [steps]      # SmolLM2-135M, 600 steps: ~20 min on 2 cores

Uses the data `python train.py drafter=dflash target=smollm2_135m` generates (from its cache;
built first when missing); it trains nothing into checkpoints/. Prints one JSON line per data
share: the held-out chain AAL over all held-out answers, and per 100 steps val_chain_aal, train
and held-out acc@1.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from bastion.compose import build
from bastion.drafters.dflash import DFlashDrafter, evenly_spaced_layers, new_dflash_config
from bastion.train.cli import mask_token, self_distillation
from bastion.train.dflash import chain_aal, most_frequent_tokens, train_dflash
from bastion.train.examples import split_examples, to_examples

ROOT = Path(__file__).resolve().parents[1]


def main(steps: int) -> None:
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("training", overrides=["drafter=dflash", "target=smollm2_135m", "device=cpu"])
    target = build(cfg.target, name=cfg.target.name)
    target.model.requires_grad_(False)
    layers = evenly_spaced_layers(target.args.n_layers, cfg.data.n_feature_layers)
    examples, held_out = split_examples(to_examples(self_distillation(cfg, target, tuple(layers))), cfg.data.val_fraction)
    recipe, optim = cfg.recipe, dict(cfg.recipe.optim)
    vocab, _ = most_frequent_tokens(examples, recipe.draft_vocab, target.args.vocab_size)
    for share in (0.5, 1.0):
        torch.manual_seed(cfg.seed)
        drafter = DFlashDrafter(new_dflash_config(target, recipe.layers, recipe.block_size, layers, mask_token(cfg, target), recipe.draft_vocab), target)
        drafter.set_draft_vocab(vocab)
        train = examples[: int(len(examples) * share)]
        with tempfile.TemporaryDirectory() as tmp:
            log = train_dflash(drafter, train, Path(tmp) / "state.pt", steps=steps, lr=optim["lr"], warmup=optim["warmup"],
                               seqs_per_step=optim["seqs_per_step"], anchors=optim["anchors"], gamma=optim["gamma"],
                               val_examples=held_out, save_every=steps, log_every=100, val_every=100, seed=cfg.seed)
        drafter.eval()
        print(json.dumps({"share": share, "train_answers": len(train), "held_out_answers": len(held_out),
                          "held_out_chain_aal": round(chain_aal(drafter, held_out), 4),
                          "per_100_steps": [{"step": r["step"], "val_chain_aal": r.get("val_chain_aal"), "acc1": r["acc"][0],
                                             "val_acc1": r.get("val_acc", [None])[0]} for r in log]}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 600)
