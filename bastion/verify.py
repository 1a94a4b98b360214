"""Acceptance of a draft tree against the target's logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bastion.sampling import Sampling
from bastion.tree.draft_tree import DraftTree, doubling_rounds


@dataclass
class Verdict:
    """One row's outcome of a verification pass."""

    path: list[int]  # accepted tree indices from the root (index 0) down; their KV is kept
    tokens: list[int]  # new tokens: the accepted draft tokens, then the target's bonus token


def verify_greedy(choice: torch.Tensor, trees: list[DraftTree], tokens: torch.Tensor, depths: torch.Tensor,
                  parents: torch.Tensor, depth: int | None = None) -> list[Verdict]:
    """Accept the deepest node whose every ancestor's token is the target's choice after its
    parent (the argmax of logits, or of keyed scores at T > 0); the choice after it is the
    bonus token. choice, tokens, depths, parents: [B, M] (pack's; padding slots are roots).

    Decided on the device for every node at once (whether a node's whole path matched, by
    pointer doubling up the parents: log2 of the trees' `depth` (or M) rounds of [B, M] ops), then one transfer of each
    row's deepest accepted node and bonus token: a step waits for the device once, whatever
    the trees' size."""
    B, M = parents.shape
    up = torch.where(parents < 0, torch.arange(M, device=parents.device).expand(B, M), parents)  # a root points to itself
    accepted = (tokens == choice.gather(1, up)) | (parents < 0)  # [B, M]: so far, the node itself matched
    for _ in range(doubling_rounds(M - 1 if depth is None else depth)):
        accepted = accepted & accepted.gather(1, up)
        up = up.gather(1, up)
    deepest = (depths * accepted).argmax(-1)  # [B]; the first such node, should siblings repeat a token
    out = torch.stack([deepest, choice.gather(1, deepest[:, None])[:, 0]], 1).tolist()  # [B, 2]
    verdicts = []
    for tree, (node, bonus) in zip(trees, out):
        path = tree.path(node)
        verdicts.append(Verdict(path, [tree.tokens[i] for i in path[1:]] + [bonus]))
    return verdicts


def verify_sampled(
    logits: torch.Tensor,
    trees: list[DraftTree],
    sampling: Sampling,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None,
) -> list[Verdict]:
    """Temperature > 0 with sampled children: multi-draft recursive rejection sampling down
    the tree (SpecInfer, Sequoia). Ranked children need none of this: they are verified
    greedily against keyed Gumbel-max scores (sampling.py).

    At each node the children, drawn from q = draft_probs [B, K, V] without replacement, are
    tried in order against the target's distribution p there: child x is accepted w.p.
    min(1, p(x)/q(x)); on rejection p <- norm(max(p - q, 0)) and q loses x. When every child
    is rejected the bonus token is drawn from what is left of p, so the output is distributed
    exactly as AR sampling from p. `draft_probs` is None only for root-only trees (AR steps).
    """
    target_probs = sampling.probs(logits)  # [B, M, V]
    verdicts = []
    for b, tree in enumerate(trees):
        node, path, new = 0, [0], []
        while True:
            p = target_probs[b, node]
            child = None
            if tree.children[node]:
                q = draft_probs[b, tree.depths[node]].clone()
                for c in tree.children[node]:
                    x = tree.tokens[c]
                    u = torch.rand((), generator=generator, device=p.device).item()
                    if u * q[x].item() < p[x].item():
                        child = c
                        break
                    residual = (p - q).clamp_min(0.0)
                    total = residual.sum()
                    p = residual / total if total > 0 else p  # total = 0 only when p == q up to rounding
                    q[x] = 0.0
                    q = q / q.sum()
            if child is None:
                new.append(torch.multinomial(p, 1, generator=generator).item())
                break
            new.append(tree.tokens[child])
            path.append(child)
            node = child
        verdicts.append(Verdict(path, new))
    return verdicts


def sample_children(tree: DraftTree, draft_probs: torch.Tensor, generator: torch.Generator) -> DraftTree:
    """The tree's shape with each node's children drawn from q without replacement.

    draft_probs: [K, V], row d being q for depth d + 1. A node keeps at most as many children
    as q has tokens of nonzero probability; dropped children take their subtrees with them.
    """
    tokens, parents, logq = [tree.tokens[0]], [-1], [0.0]
    renumbered = {0: 0}
    for node, kids in enumerate(tree.children):
        if node not in renumbered or not kids:
            continue
        q = draft_probs[tree.depths[node]]
        draws = torch.multinomial(q, min(len(kids), int((q > 0).sum())), replacement=False, generator=generator)
        for kid, (x, qx) in zip(kids, zip(draws.tolist(), q[draws].log().tolist())):
            renumbered[kid] = len(tokens)
            tokens.append(x)
            parents.append(renumbered[node])
            logq.append(logq[renumbered[node]] + qx)
    return DraftTree(tuple(tokens), tuple(parents), tuple(logq))
