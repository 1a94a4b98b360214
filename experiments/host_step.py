"""Host time per decode step: everything outside the target's forward, at paper-scale shapes.

    python experiments/host_step.py                 # B in {1, 16} x N in {16, 256}
    python experiments/host_step.py batches=[16] nodes=[256] budget=bastion

A tiny random target (tiny_qwen3) keeps the forward itself small, and a drafter that proposes
random candidates (16 positions x 16 per position, so best-first can build 256 nodes) costs
nothing, so what is left of a step is the engine's and the budget's own work: building and
sizing trees, packing them and their masks, acceptance, cache commits and bookkeeping. That is
what a GPU step cannot hide (an 8B target's B=1 forward on an H200 takes ~3 ms). Printed per
shape: the median step, its forward (verify) part, and the host rest, in ms.
"""

from __future__ import annotations

import sys
from pathlib import Path
from statistics import median

import torch

from bastion.drafters.base import DraftContext, Drafter
from bastion.engine import generate
from bastion.tree.proposal import BlockProposal

ROOT = Path(__file__).resolve().parents[1]


class RandomDrafter(Drafter):
    """Random candidates with a drafter's kind of log-probabilities (the top k of a softmax of
    random logits, different in every row and position: equal values in every row would make
    sorts and top-k cheaper than a real drafter's): trees of any size, at no draft cost. The
    proposals are drawn up front and cycled, so a step's propose is two slices (drawing them
    per step cost ~0.1 ms, which a real drafter spends on its device, not the host)."""

    def __init__(self, vocab: int, batch: int, positions: int = 16, top_k: int = 16, bank: int = 64):
        gen = torch.Generator().manual_seed(0)
        logits = 3 * torch.randn(bank, batch, positions, 1000, generator=gen)
        self.logprobs = logits.log_softmax(-1).topk(top_k, dim=-1).values  # [bank, B, K, k]
        self.tokens = torch.randint(vocab, (bank, batch, positions, top_k), generator=gen)
        self.steps = 0

    def propose(self, ctx: DraftContext) -> BlockProposal:
        draw, B = self.steps % len(self.tokens), len(ctx.sequences)
        self.steps += 1
        return BlockProposal([seq[-1] for seq in ctx.sequences], self.tokens[draw, :B], self.logprobs[draw, :B])


def parse(argv: list[str]) -> tuple[dict[str, list[int]], list[str]]:
    lists, rest = {"batches": [1, 16], "nodes": [16, 256]}, []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in lists:
            lists[key] = [int(x) for x in value.strip("[]").split(",")]
        else:
            rest.append(arg)
    return lists, rest


def step_split(target, policy, budget, batch: int, max_new_tokens: int = 24) -> tuple[float, float, float]:
    """Median seconds of a decode step, of its forward (verify) part and of the rest (the
    host's part), `batch` 200-token prompts drafted by RandomDrafter; the first two steps
    (warm-up) are left out (experiments/gpu_check.py measures them on a GPU target too). The
    rest is the median of each step's own rest, not a difference of medians: a forward's
    jitter alone is larger than the rest at B=16, N=256."""
    prompts = [[(7 * i + j) % 4000 + 100 for j in range(200)] for i in range(batch)]
    drafter = RandomDrafter(target.args.vocab_size, batch)
    steps = generate(target, prompts, drafter=drafter, policy=policy, budget=budget, max_new_tokens=max_new_tokens).steps[2:]
    return (median(s.draft_s + s.verify_s + s.other_s for s in steps), median(s.verify_s for s in steps),
            median(s.draft_s + s.other_s for s in steps))


def main(argv: list[str]) -> None:
    # the config stack is imported here, not above: gpu_check.py takes step_split to GPU machines that lack it
    from hydra import compose, initialize_config_dir

    from bastion.compose import build, build_target, hardware

    lists, overrides = parse(argv)
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["target=tiny_qwen3", "device=cpu", "tree=best_first", "budget=fixed", *overrides])
    target = build_target(cfg)
    policy = build(cfg.tree)
    print(f"{target.name} on {cfg.device}, {cfg.budget.name.rstrip('0123456789')} budget, {torch.get_num_threads()} threads")
    print(f"{'B':>3} {'N':>4} {'step ms':>8} {'forward ms':>10} {'host ms':>8}")
    for B in lists["batches"]:
        for N in lists["nodes"]:
            node = cfg.budget.copy()
            node["nodes" if "nodes" in node else "max_nodes"] = N
            budget = build(node)
            budget.start(target, hardware(cfg), Path(cfg.cache_dir))
            total, forward, host = step_split(target, policy, budget, B)
            print(f"{B:>3} {N:>4} {1e3 * total:>8.2f} {1e3 * forward:>10.2f} {1e3 * host:>8.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
