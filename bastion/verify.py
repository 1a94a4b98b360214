"""Acceptance of a draft tree against the target's logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bastion.sampling import Sampling
from bastion.tree.draft_tree import DraftTree


@dataclass
class Verdict:
    """One row's outcome of a verification pass."""

    path: list[int]  # accepted tree indices from the root (index 0) down; their KV is kept
    tokens: list[int]  # new tokens: the accepted draft tokens, then the target's bonus token


def verify_greedy(logits: torch.Tensor, trees: list[DraftTree]) -> list[Verdict]:
    """Temperature 0: follow the child equal to the target's argmax as deep as it goes; the
    argmax at the last accepted node is the bonus token. logits: [B, M, V]."""
    argmax = logits.argmax(dim=-1).tolist()  # [B, M]
    verdicts = []
    for tree, best in zip(trees, argmax):
        node, path, new = 0, [0], []
        while True:
            token = best[node]
            child = next((c for c in tree.children[node] if tree.tokens[c] == token), None)
            new.append(token)
            if child is None:
                break
            node = child
            path.append(child)
        verdicts.append(Verdict(path, new))
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
