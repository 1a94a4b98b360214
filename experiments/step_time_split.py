"""Per-step time split (draft / verify / everything else) at tree sizes 1..64.

    python experiments/step_time_split.py                       # SmolLM2-135M, ngram, best_first, GSM8K
    python experiments/step_time_split.py drafter=dflash sizes=[1,8,32]

"Everything else" is tree building, masks, acceptance, cache commit and bookkeeping: the
engine's own overhead, which should stay a small share of a step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bastion.bench.datasets import chat_tokens, load_prompts
from bastion.compose import build, build_target, packed, resolve_device
from bastion.engine import generate

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> None:
    sizes = [1, 2, 4, 8, 16, 32, 64]
    overrides = []
    for arg in argv:
        if arg.startswith("sizes="):
            sizes = [int(x) for x in arg.removeprefix("sizes=").strip("[]").split(",")]
        else:
            overrides.append(arg)
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["drafter=ngram", "drafter.top_k=8", "budget=fixed", "bench.limit=4", *overrides])
    if cfg.drafter.name == "ngram":
        cfg.drafter.drafts = 16  # trees of up to 64 nodes need long continuations
    cfg.device = resolve_device(cfg.device)
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    target = build_target(cfg)
    drafter, policy = packed(cfg, build(cfg.drafter, target=target)), build(cfg.tree)
    prompts = [chat_tokens(target, [{"role": "user", "content": p.turns[0]}]) for p in load_prompts(cfg.bench.name, cfg.bench.limit)]
    generate(target, prompts[:1], max_new_tokens=8)  # warm-up
    print(f"{target.name}, {cfg.drafter.name} + {cfg.tree.name}, {len(prompts)} prompts x {cfg.decode.max_new_tokens} tokens, {torch.get_num_threads()} threads")
    print(f"{'N':>4} {'nodes':>6} {'draft ms':>9} {'verify ms':>10} {'other ms':>9} {'other %':>8}")
    for n in sizes:
        budget = build(OmegaConf.merge(cfg.budget, {"nodes": n}))
        steps = []
        for prompt in prompts:
            steps += generate(target, [prompt], drafter=drafter, policy=policy, budget=budget, max_new_tokens=cfg.decode.max_new_tokens).steps
        draft, verify, other = (1000 * sum(getattr(s, f) for s in steps) / len(steps) for f in ("draft_s", "verify_s", "other_s"))
        nodes = sum(s.tree_sizes[0] for s in steps) / len(steps)
        print(f"{n:>4} {nodes:>6.1f} {draft:>9.2f} {verify:>10.2f} {other:>9.2f} {100 * other / (draft + verify + other):>7.1f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
