"""Acceptance of a draft tree against the target's logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
