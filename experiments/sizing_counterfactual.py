"""Where BASTION's tree size goes wrong: its forecast against counterfactual truth, per size.

    python experiments/sizing_counterfactual.py bench=gsm8k bench.limit=6 decode.max_new_tokens=96

Decodes each prompt (batch 1, T=0) with the configured drafter, best-first trees and the
BASTION budget, keeping every drafted step's full tree and the controller's forecast curve.
Greedy decoding is lossless, so the output is AR's, and it says for every step and every size
n how many tokens verifying the tree's first n nodes would have given. Printed per n: tokens
per step as forecast (1 + A_hat(n), calibrated by rank) and as they would have been, verify
time as forecast and as measured here (target forwards of n + 1 tokens), the speedups both
imply, and how often the controller chose n (up to the next size listed). Then, by the size
chosen, tokens per step forecast and true at that size and at 4 nodes: whether the steps that
chose a size were forecast too well there (the optimizer's curse). Then the ceilings of sizing
per step, at the measured times: every step at the listed size its forecast favours, and at the
one its true tokens favour, against the best fixed size. Then per rank of the whole trees the
policy built (binned by powers of two): their summed path probability, how many lie on the
target's path, the ratio, and the controller's own ratio at the bin's first rank at the end
(learned from the nodes it verified).
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch
from hydra import compose, initialize_config_dir

from bastion.bench.datasets import chat_tokens, load_prompts
from bastion.budget.latency import probe_times
from bastion.compose import build, build_target, hardware, packed, resolve_device
from bastion.engine import generate
from bastion.tree.draft_tree import DraftTree

ROOT = Path(__file__).resolve().parents[1]
SIZES = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)


def accepted_path(tree: DraftTree, truth: list[int]) -> list[int]:
    """The tree's nodes that match `truth` (the target's tokens after the root), root excluded."""
    path, node = [], 0
    for token in truth:
        node = next((c for c in tree.children[node] if tree.tokens[c] == token), None)
        if node is None:
            break
        path.append(node)
    return path


def main(argv: list[str]) -> None:
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["tree=best_first", "budget=bastion", "bench.limit=6", "decode.max_new_tokens=96", *argv])
    cfg.device = resolve_device(cfg.device)
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    target = build_target(cfg)
    drafter, policy, budget = packed(cfg, build(cfg.drafter, target=target)), build(cfg.tree), build(cfg.budget)
    budget.start(target, hardware(cfg), Path(cfg.cache_dir))
    steps = []  # (context, full tree, forecast tokens [n+1], forecast verify s [n+1], draft s, other s, chosen n)
    size = budget.size

    def recording(trees, contexts):
        _, verify, cost, speedup = budget.curve(trees, contexts)
        chosen = size(trees, contexts)
        tokens = speedup * cost  # [n+1] forecast tokens per step: the curve's speedup is tokens over cost
        steps.append((contexts[0], trees[0], tokens, verify, budget.recent.draft_s, budget.recent.other_s, chosen[0].n_nodes))
        return chosen

    budget.size = recording
    benches = [cfg.bench.name] if cfg.bench.name != "all" else list(cfg.bench.names)
    prompts = [chat_tokens(target, [{"role": "user", "content": p.turns[0]}])
               for bench in benches
               for p in load_prompts(bench, cfg.bench.limit, path=cfg.bench.get("path"), field=cfg.bench.get("field"))]
    generate(target, prompts[:1], max_new_tokens=8)  # warm-up
    produced = {n: [] for n in SIZES}
    forecast = {n: [] for n in SIZES}
    verify_forecast = {n: [] for n in SIZES}
    costs = []
    by_choice = defaultdict(list)  # size chosen -> per step [forecast, true] tokens at it, then at 4 nodes
    bins = np.zeros((2, budget.max_nodes.bit_length()))  # per rank bin (1, 2-3, 4-7, ...): summed path probability, nodes on the target's path
    for prompt in prompts:
        start = len(steps)
        out = generate(target, [prompt], drafter=drafter, policy=policy, budget=budget, max_new_tokens=cfg.decode.max_new_tokens)
        sequence = prompt + out.generations[0].tokens
        for ctx, tree, tokens, verify, draft_s, other_s, picked in steps[start:]:
            path = accepted_path(tree, sequence[ctx + 1 :])
            by_choice[picked].append([float(tokens[picked]), 1 + sum(node <= picked for node in path),
                                      float(tokens[min(4, tree.n_nodes)]), 1 + sum(node <= 4 for node in path)])
            ranks = np.log2(np.arange(1, tree.n_nodes + 1)).astype(int)  # exact at powers of two
            np.add.at(bins[0], ranks, np.exp(tree.logq[1:]))
            np.add.at(bins[1], ranks[np.array(path, dtype=int) - 1], 1)
            for n in SIZES:
                k = min(n, tree.n_nodes)
                produced[n].append(1 + sum(node <= k for node in path))
                forecast[n].append(float(tokens[k]))
                verify_forecast[n].append(float(verify[k]))
            costs.append((draft_s, other_s))
    contexts = int(np.median([s[0] for s in steps]))
    times = probe_times(target, [n + 1 for n in SIZES], contexts, repeats=7)  # [sizes][repeats]
    measured = {n: float(np.median(ts)) for n, ts in zip(SIZES, times)}
    draft_s, other_s = (float(np.median(c)) for c in zip(*costs))
    ar_s = measured[0] + other_s
    step_true = {n: draft_s + measured[n] + other_s if n else ar_s for n in SIZES}  # seconds of a step of n nodes, measured
    chosen = Counter(s[-1] for s in steps)
    print(f"{target.name}, {cfg.drafter.name} + best_first + BASTION, {cfg.bench.name}, {len(prompts)} prompts x "
          f"{cfg.decode.max_new_tokens} tokens, {len(steps)} drafted steps; draft {1e3 * draft_s:.1f} ms, "
          f"other {1e3 * other_s:.1f} ms, median context {contexts}")
    print(f"{'n':>3} {'tokens fc':>9} {'tokens cf':>9} {'verify fc':>9} {'verify ms':>9} {'S fc':>6} {'S true':>6} {'chosen':>6}")
    for n in SIZES:
        tokens_fc, tokens_cf = np.mean(forecast[n]), np.mean(produced[n])
        verify_fc = 1e3 * np.median(verify_forecast[n])
        step_fc = draft_s + verify_fc / 1e3 + other_s if n else ar_s
        picked = sum(c for k, c in chosen.items() if n <= k and (n == SIZES[-1] or k < SIZES[SIZES.index(n) + 1]))
        print(f"{n:>3} {tokens_fc:>9.3f} {tokens_cf:>9.3f} {verify_fc:>9.2f} {1e3 * measured[n]:>9.2f} "
              f"{tokens_fc * ar_s / step_fc:>6.3f} {tokens_cf * ar_s / step_true[n]:>6.3f} {picked:>6}")
    print(f"{'chosen':>6} {'steps':>5} {'fc there':>8} {'cf there':>8} {'fc at 4':>7} {'cf at 4':>7}   (tokens per step: forecast, counterfactual)")
    for n in sorted(by_choice):
        print(f"{n:>6} {len(by_choice[n]):>5} " + " ".join(f"{x:>{w}.3f}" for x, w in zip(np.mean(by_choice[n], 0), (8, 8, 7, 7))))
    print_ceilings(produced, forecast, step_true, ar_s)
    print(f"{'ranks':<9} {'A_hat':>8} {'accepted':>8} {'ratio':>6} {'learned':>7}")
    learned = budget.rank_ratios()
    for b, (believed, hits) in enumerate(bins.T):
        if believed:
            print(f"{2 ** b:>4}-{2 ** (b + 1) - 1:<4} {believed:>8.1f} {hits:>8.0f} {hits / believed:>6.3f} {learned[2 ** b - 1]:>7.3f}")


def print_ceilings(produced: dict, forecast: dict, step_s: dict, ar_s: float) -> None:
    """What sizing each step could gain over the best fixed size, priced at the measured step
    times `step_s` (size -> seconds) so that only the tokens differ: each step at the size its
    forecast tokens favour (a controller whose latency model is exact and whose decisions cost
    nothing), and at the size its true tokens favour (no controller can: it knows the target)."""
    sizes, steps = list(produced), len(next(iter(produced.values())))

    def speedup(choice: list[int]) -> float:  # over AR, steps sized as `choice` says
        return sum(produced[n][t] for t, n in enumerate(choice)) * ar_s / sum(step_s[n] for n in choice)

    fixed = {n: speedup([n] * steps) for n in sizes}
    best = max(fixed, key=fixed.get)
    for name, tokens in (("forecast", forecast), ("truth", produced)):
        choice = [max(sizes, key=lambda n: tokens[n][t] / step_s[n]) for t in range(steps)]
        print(f"sized per step by its {name}: {speedup(choice):.3f}x AR, {speedup(choice) / fixed[best]:.3f} of the best "
              f"fixed size ({best} nodes, {fixed[best]:.3f}x), mean {np.mean(choice):.1f} nodes")


if __name__ == "__main__":
    main(sys.argv[1:])
