"""Chain policy: the top-1 token of each position, one path (DFlash's and EAGLE-1's shape)."""

from __future__ import annotations

import math

from bastion.tree.draft_tree import DraftTree
from bastion.tree.proposal import BlockProposal, TreeProposal
from bastion.tree.static import follow_ranks


def chain(proposal: BlockProposal | TreeProposal, max_nodes: int) -> list[DraftTree]:
    if isinstance(proposal, TreeProposal):
        return follow_ranks(proposal, [(0,) * depth for depth in range(1, min(max_nodes, proposal.depth) + 1)], max_nodes)
    tokens, logprobs = (values.tolist() for values in proposal.on_host())  # [B, K, k]
    trees = []
    for root, row_tokens, row_logprobs in zip(proposal.roots, tokens, logprobs):
        tree_tokens, parents, logq = [root], [-1], [0.0]
        for candidates, lps in zip(row_tokens[:max_nodes], row_logprobs):
            token, lp = candidates[0], lps[0]
            if lp == -math.inf:
                break
            tree_tokens.append(token)
            parents.append(len(parents) - 1)
            logq.append(logq[-1] + lp)
        trees.append(DraftTree(tree_tokens, parents, logq, known_depths=range(len(tree_tokens))))
    return trees
