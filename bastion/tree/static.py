"""Static policy: a fixed topology (EAGLE / Medusa style), filled from the drafter's marginals
(or followed through an autoregressive drafter's candidate trees, by sibling rank).

A topology is a list of rank paths: [0] is the top-1 token at the first position, [0, 1] the
second-ranked token at the second position below it, and so on. The list order is the order
nodes are valued in (so budgets truncate it), every path's parent must come earlier.
"""

from __future__ import annotations

import math

import torch

from bastion.tree.draft_tree import DraftTree
from bastion.tree.proposal import BlockProposal, TreeProposal

# EAGLE-1's default tree (SafeAILab/EAGLE, model/choices.py `mc_sim_7b_63`): 25 nodes, depth 5.
EAGLE1_25 = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
             [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
             [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]

# Medusa's sparse tree (FasterDecoding/Medusa, medusa_choices.py `mc_sim_7b_63`): 63 nodes, depth 4.
MEDUSA_63 = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5],
             [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8],
             [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0],
             [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0],
             [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1],
             [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0]]

SHAPES = {
    "eagle1_25": EAGLE1_25,
    "static_60": MEDUSA_63[:60],  # the 60-node budget EAGLE-2/3 verify by default, as a fixed shape
    "medusa_63": MEDUSA_63,
    "chain_7": [[0] * d for d in range(1, 8)],
}


def topology(shape: str | list) -> list[tuple[int, ...]]:
    paths = SHAPES[shape] if isinstance(shape, str) and shape in SHAPES else shape
    if isinstance(paths, str):
        raise ValueError(f"Unknown tree shape '{shape}'; named shapes: {', '.join(SHAPES)} (or a list of rank paths).")
    paths = [tuple(p) for p in paths]
    seen = set()
    for p in paths:
        if not p or (len(p) > 1 and p[:-1] not in seen) or min(p) < 0:
            raise ValueError(f"Tree shape path {list(p)} needs its parent {list(p[:-1])} listed before it.")
        seen.add(p)
    return paths


def static(proposal: BlockProposal | TreeProposal, max_nodes: int, shape: str | list = "eagle1_25") -> list[DraftTree]:
    paths = topology(shape)
    if isinstance(proposal, TreeProposal):
        return follow_ranks(proposal, paths, max_nodes)
    tokens, logprobs = (values.tolist() for values in proposal.on_host())  # [B, K, k]
    K, k = proposal.tokens.shape[1:]
    trees = []
    for root, row_tokens, row_logprobs in zip(proposal.roots, tokens, logprobs):
        index = {(): 0}
        tree_tokens, parents, logq, depths = [root], [-1], [0.0], [0]
        for path in paths:
            depth, rank = len(path), path[-1]
            if len(tree_tokens) > max_nodes or path[:-1] not in index or depth > K or rank >= k:
                continue
            lp = row_logprobs[depth - 1][rank]
            if lp == -math.inf:
                continue
            parent = index[path[:-1]]
            index[path] = len(tree_tokens)
            tree_tokens.append(row_tokens[depth - 1][rank])
            parents.append(parent)
            logq.append(logq[parent] + lp)
            depths.append(depth)
        trees.append(DraftTree(tree_tokens, parents, logq, known_depths=depths))
    return trees


def follow_ranks(proposal: TreeProposal, paths: list[tuple[int, ...]], max_nodes: int) -> list[DraftTree]:
    """The nodes of a drafter's candidate trees that `paths` name by sibling rank (a path whose
    candidate the drafter did not grow is skipped, with everything below it), in path order."""
    tokens, parents, logq, ranks = torch.stack([proposal.tokens.double(), proposal.parents.double(),
                                                proposal.logq.double(), proposal.ranks.double()]).tolist()  # one transfer
    trees = []
    for row_tokens, row_parents, row_logq, row_ranks in zip(tokens, parents, logq, ranks):
        child = {(int(p), int(r)): c for c, (p, r, lq) in enumerate(zip(row_parents, row_ranks, row_logq)) if c and lq > -math.inf}
        index = {(): 0}  # rank path -> node
        where = {(): 0}  # rank path -> candidate
        tree_tokens, tree_parents, tree_logq, tree_depths = [int(row_tokens[0])], [-1], [0.0], [0]
        for path in paths:
            if len(tree_tokens) > max_nodes or path[:-1] not in where or (where[path[:-1]], path[-1]) not in child:
                continue
            c = child[where[path[:-1]], path[-1]]
            where[path], index[path] = c, len(tree_tokens)
            tree_tokens.append(int(row_tokens[c]))
            tree_parents.append(index[path[:-1]])
            tree_logq.append(row_logq[c])
            tree_depths.append(len(path))
        trees.append(DraftTree(tree_tokens, tree_parents, tree_logq, known_depths=tree_depths))
    return trees
