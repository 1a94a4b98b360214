"""What limits the DFlash drafter? The default recipe trained for the same number of steps with
one knob changed at a time (data size, draft depth, block size, loss and batch shape,
regularisers), judged by chain AAL: the acceptance length chain decoding gets at temperature 0
on answers never trained on.

    python experiments/dflash_limits.py [steps] [variant ...] [hydra override ...]
    python experiments/dflash_limits.py 600 base half_data      # SmolLM2-135M, ~15 min on 2 cores
    python experiments/dflash_limits.py 800 base gamma_4 hard_labels data.n_prompts=480

Variants: base (the recipe in conf/recipe/dflash.yaml), half_data (half the training answers),
layers_3 (3 draft layers), block_8 and block_16 (the block, root included; the recipe's is 4),
gamma_4 (loss weights decaying half as fast over block positions, DFlash's own), hard_labels (no
loss against the target's top-k distributions), seqs_8x16 (8 sequences of 16 anchors per step
instead of 4 of 32), anchors_64 (4 of 64), feature_noise (0.1 std on the features).
Uses the data `python train.py drafter=dflash target=smollm2_135m` generates with the same
overrides (from its cache; built first when missing); it trains nothing into checkpoints/.
Prints one JSON line per variant: seconds per step, the chain AAL over all held-out answers and
over AR's answers to the first 20 prompts of four benchmarks (`bench_chain_aal`, 128 tokens: on
GSM8K within 0.01 of what chain decoding measures), and per 100 steps val_chain_aal, train and
held-out acc@1. Steps cost differently (a third layer, a longer block or more anchors cost
more), so compare at equal time too.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from bastion.bench.datasets import chat_tokens, load_prompts
from bastion.compose import build, replace_dict_overrides
from bastion.engine import generate
from bastion.recorder import FeatureRecorder
from bastion.train.cli import new_dflash_drafter, settle, training_examples
from bastion.train.dflash import chain_aal, train_dflash
from bastion.train.examples import Example

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {  # name -> what differs from the recipe
    "base": {},
    "half_data": {"data_share": 0.5},
    "layers_3": {"layers": 3},
    "block_8": {"block_size": 8},
    "block_16": {"block_size": 16},
    "gamma_4": {"optim": {"gamma": 4.0}},
    "hard_labels": {"optim": {"soft_labels": 0.0}},
    "seqs_8x16": {"optim": {"seqs_per_step": 8, "anchors": 16}},
    "anchors_64": {"optim": {"anchors": 64}},
    "feature_noise": {"optim": {"feature_noise": 0.1}},
}
BENCHES = ("gsm8k", "math500", "mbpp", "mt_bench")


def bench_answers(target, layers: tuple[int, ...], n: int = 20, max_new_tokens: int = 128) -> dict[str, list[Example]]:
    """AR's answers (with the target's features) to the first n prompts of each benchmark: what
    chain decoding reproduces there, so walking them gives its AAL without decoding."""
    answers = {}
    for bench in BENCHES:
        prompts = [chat_tokens(target, [{"role": "user", "content": p.turns[0]}]) for p in load_prompts(bench, limit=n)]
        recorder = FeatureRecorder(layers)
        decoding = generate(target, prompts, max_new_tokens=max_new_tokens, recorder=recorder)
        answers[bench] = [Example(torch.tensor(p + g.tokens), f, len(p)) for p, g, f in zip(prompts, decoding.generations, recorder.features)]
    return answers


def main(steps: int, names: list[str], overrides: list[str]) -> None:
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("training", overrides=["drafter=dflash", "target=smollm2_135m", "device=cpu", *overrides])
    replace_dict_overrides(cfg, overrides)  # data.mix={...} means that mix alone, as in train.py
    settle(cfg)
    soft = [n for n in names if VARIANTS[n].get("optim", {}).get("soft_labels", cfg.recipe.optim.soft_labels)]
    if soft and not cfg.data.top_k:
        raise SystemExit(f"variant {soft[0]} trains on soft labels, which need data.top_k > 0 (or recipe.optim.soft_labels=0)")
    target = build(cfg.target, name=cfg.target.name)
    target.model.requires_grad_(False)
    layers, examples, held_out = training_examples(cfg, target)
    benches = bench_answers(target, layers)
    recipe = cfg.recipe
    for name in names:
        variant = dict(VARIANTS[name])
        loop = {**recipe.optim, **variant.pop("optim", {}), "steps": steps, "save_every": steps, "log_every": 100, "val_every": 100}
        knobs = {"layers": recipe.layers, "block_size": recipe.block_size, "data_share": 1.0, **variant}
        torch.manual_seed(cfg.seed)
        drafter = new_dflash_drafter(cfg, target, layers, examples, knobs["layers"], knobs["block_size"])
        train = examples[: int(len(examples) * knobs["data_share"])]
        with tempfile.TemporaryDirectory() as tmp:
            log = train_dflash(drafter, train, Path(tmp) / "state.pt", **loop, val_examples=held_out, seed=cfg.seed)
        drafter.eval()
        optim = {k: loop[k] for k in ("gamma", "seqs_per_step", "anchors", "soft_labels", "feature_noise")}
        print(json.dumps({"variant": name, **knobs, "optim": optim, "train_answers": len(train), "held_out_answers": len(held_out),
                          "s_per_step": round(sum(r["s_per_step"] for r in log) / len(log), 3),
                          "held_out_chain_aal": round(chain_aal(drafter, held_out), 4),
                          "bench_chain_aal": {b: round(chain_aal(drafter, answers), 3) for b, answers in benches.items()},
                          "per_100_steps": [{"step": r["step"], "val_chain_aal": r.get("val_chain_aal"), "acc1": r["acc"][0],
                                             "val_acc1": r.get("val_acc", [None])[0]} for r in log]}), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    steps = int(args.pop(0)) if args and args[0].isdigit() else 600
    overrides = [a for a in args if "=" in a]
    main(steps, [a for a in args if "=" not in a] or list(VARIANTS), overrides)
