"""DraftTree: the candidate tokens one verification pass checks for one row."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens hanging below a root, the last verified token (its KV is not cached yet).

    Index 0 is the root; nodes 1..N follow in the order their policy valued them, parents
    first, so every prefix `truncate(n)` is itself a prefix-closed tree. That is what lets a
    budget controller size a tree after it was built.
    """

    tokens: tuple[int, ...]  # [1+N]; tokens[0] is the root token
    parents: tuple[int, ...]  # [1+N]; parents[0] = -1 and parents[i] < i
    logq: tuple[float, ...]  # [1+N]; draft log-probability of the path root -> i (root: 0)

    @staticmethod
    def root_only(token: int) -> DraftTree:
        return DraftTree((token,), (-1,), (0.0,))

    def __post_init__(self):
        if not (len(self.tokens) == len(self.parents) == len(self.logq)) or self.parents[0] != -1:
            raise ValueError("DraftTree needs equal-length tokens/parents/logq with the root at index 0")
        if any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError("DraftTree parents must precede their children")

    @property
    def n_nodes(self) -> int:
        """Draft nodes, root excluded."""
        return len(self.tokens) - 1

    @cached_property
    def depths(self) -> tuple[int, ...]:
        depths = [0]
        for p in self.parents[1:]:
            depths.append(depths[p] + 1)
        return tuple(depths)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[i]: the nodes whose parent is i, in tree order."""
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return tuple(tuple(k) for k in kids)

    def expected_accepted(self) -> float:
        """A_hat: the sum of the nodes' path probabilities, BASTION's surrogate for the number of
        draft tokens a verification accepts."""
        return sum(math.exp(s) for s in self.logq[1:])

    def truncate(self, n_nodes: int) -> DraftTree:
        if n_nodes >= self.n_nodes:
            return self
        k = n_nodes + 1
        return DraftTree(self.tokens[:k], self.parents[:k], self.logq[:k])

    def path(self, node: int) -> list[int]:
        """Indices from the root to `node`, both included."""
        path = [node]
        while node:
            node = self.parents[node]
            path.append(node)
        return path[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """[1+N, 1+N] bool: mask[i, j] is True iff j is i or an ancestor of i."""
        n = len(self.tokens)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask


def pack(trees: list[DraftTree], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack trees of different sizes for one target forward.

    Returns tokens [B, M], depths [B, M] and the tree mask [B, M, M], M = largest 1+N. Padding
    slots see only themselves (so no attention row is empty) and nothing sees them.
    """
    width = max(len(t.tokens) for t in trees)
    tokens = torch.zeros(len(trees), width, dtype=torch.long)
    depths = torch.zeros(len(trees), width, dtype=torch.long)
    mask = torch.eye(width, dtype=torch.bool).repeat(len(trees), 1, 1)
    for b, tree in enumerate(trees):
        n = len(tree.tokens)
        tokens[b, :n] = torch.tensor(tree.tokens)
        depths[b, :n] = torch.tensor(tree.depths)
        mask[b, :n, :n] = tree.ancestor_mask()
    return tokens.to(device), depths.to(device), mask.to(device)
