"""Best-first policy (BASTION): the tree of N nodes that maximises A_hat, for every N.

Node paths are rank sequences (r_1..r_d) over the proposal's per-position candidates, scored
by rho = prod_k q_k(x_k). Scores only fall along a path and along a sibling list, so the N
highest-scoring nodes form a prefix-closed tree, and a heap that holds, for every node taken,
its rank-0 child and its next-ranked sibling yields them in order. The result lists nodes in
that order, so truncating it to n nodes gives the optimal tree of size n.
"""

from __future__ import annotations

import heapq
import math
from itertools import count

from bastion.tree.draft_tree import DraftTree
from bastion.tree.proposal import BlockProposal


def best_first(proposal: BlockProposal, max_nodes: int) -> list[DraftTree]:
    tokens = proposal.tokens.tolist()  # [B, K, k]
    logprobs = proposal.logprobs.tolist()
    return [_grow(root, t, lp, max_nodes) for root, t, lp in zip(proposal.roots, tokens, logprobs)]


def _grow(root: int, tokens: list[list[int]], logprobs: list[list[float]], max_nodes: int) -> DraftTree:
    K, k = len(tokens), len(tokens[0])
    tree_tokens, parents, logq = [root], [-1], [0.0]
    tie = count()  # equal scores pop in insertion order: deterministic trees
    # candidate: (-score, tie, position, rank, parent node)
    heap = [(-logprobs[0][0], next(tie), 0, 0, 0)]
    while heap and len(tree_tokens) <= max_nodes:
        neg_score, _, pos, rank, parent = heapq.heappop(heap)
        if neg_score == math.inf:
            break  # only "no candidate" entries remain
        node = len(tree_tokens)
        tree_tokens.append(tokens[pos][rank])
        parents.append(parent)
        logq.append(-neg_score)
        if pos + 1 < K:
            heapq.heappush(heap, (-(logq[node] + logprobs[pos + 1][0]), next(tie), pos + 1, 0, node))
        if rank + 1 < k:
            heapq.heappush(heap, (-(logq[parent] + logprobs[pos][rank + 1]), next(tie), pos, rank + 1, parent))
    return DraftTree(tuple(tree_tokens), tuple(parents), tuple(logq))
