"""Best-first policy (BASTION): the tree of N nodes that maximises A_hat, for every N.

Node paths are rank sequences (r_1..r_d) over the proposal's per-position candidates, scored
by rho = prod_k q_k(x_k). Scores only fall along a path and along a sibling list, so the N
highest-scoring nodes form a prefix-closed tree, and listing them by decreasing score (parents
first on ties) gives, in every prefix of n nodes, the optimal tree of size n.

From a drafter's candidate trees (TreeProposal) that is simply their N best nodes (EAGLE-2's
rerank). From per-position candidates it is built with whole-tensor ops, for all rows at
once: the N best nodes hold at most N of any depth, and those are children of the N best of
the depth above, so a beam of width N per depth (top-N of N x k children, of which only those
with fewer than N better siblings and cousins can make it) holds them all; one stable sort
over the beams' union orders them.
No per-node work on the host, and one transfer of the result.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from bastion.models.transfer import to_device
from bastion.tree.draft_tree import DraftTree
from bastion.tree.proposal import BlockProposal, TreeProposal


def best_first(proposal: BlockProposal | TreeProposal, max_nodes: int) -> list[DraftTree]:
    if isinstance(proposal, TreeProposal):
        return best_nodes(proposal.logq, proposal.parents, proposal.tokens, max_nodes)
    B, K, k = proposal.tokens.shape
    if max_nodes < 1 or K == 0:
        return [DraftTree.root_only(root) for root in proposal.roots]
    device = proposal.tokens.device
    logprobs = proposal.logprobs.to(torch.promote_types(proposal.logprobs.dtype, torch.float32))
    # candidates, the root first, then each depth's beam: path score, parent candidate, token
    scores, parents = [logprobs.new_zeros(B, 1)], [torch.full((B, 1), -1, device=device)]
    tokens = [to_device(proposal.roots, device)[:, None]]
    beam_scores, beam_start, n_seen = scores[0], 0, 1  # the beam above: its scores, its first candidate
    for depth in range(K):
        slot, rank = _contenders(beam_scores.shape[1], k, max_nodes, device)  # [C] each
        children = beam_scores.index_select(1, slot) + logprobs[:, depth].index_select(1, rank)  # [B, C]
        top = children.topk(min(max_nodes, len(slot)), dim=1)  # sorted: the beam of this depth
        scores.append(top.values)
        parents.append(slot.take(top.indices) + beam_start)
        tokens.append(proposal.tokens[:, depth].gather(1, rank.take(top.indices)))
        beam_scores, beam_start, n_seen = top.values, n_seen, n_seen + top.values.shape[1]
    return best_nodes(torch.cat(scores, 1), torch.cat(parents, 1), torch.cat(tokens, 1), max_nodes)


def best_nodes(scores: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor, max_nodes: int) -> list[DraftTree]:
    """The root and the max_nodes candidates of highest path score, best first, as trees.
    scores, parents, tokens: [B, C] candidates, the root (column 0) and every parent before
    its children; a child never scores above its parent, so the picks are prefix-closed."""
    (B, C), device = scores.shape, scores.device
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    order = ranked(scores, min(max(max_nodes, 0) + 1, C))  # ties: parents first
    place = torch.full_like(tokens, -1).scatter_(1, order, torch.arange(order.shape[1], device=device).expand(B, -1))  # candidate -> node
    parent = parents.gather(1, order)
    node_parents = torch.where(parent < 0, parent, place.gather(1, parent.clamp_min(0)))
    logq = scores.gather(1, order)  # [B, 1 + N]
    chosen = torch.stack([tokens.gather(1, order), node_parents, logq.double().view(torch.long)], 1)  # [B, 3, 1 + N]
    chosen = chosen.cpu().numpy()  # one transfer
    logq = chosen[:, 2].view(np.float64)
    trees = []
    for row, row_logq, n in zip(chosen[:, :2].tolist(), logq.tolist(), (logq > -np.inf).sum(1).tolist()):
        # candidates of -inf log-probability are no candidates (they sort last)
        trees.append(DraftTree(tuple(row[0][:n]), tuple(row[1][:n]), tuple(row_logq[:n])))
    return trees


def ranked(scores: torch.Tensor, n: int) -> torch.Tensor:
    """The columns of the n highest scores [B, C] per row, best first, ties to the lower column:
    a stable descending sort's first n, from one topk over int64 keys that hold each score's
    float32 order above its column's complement (a full sort of every beam's candidates cost
    several times more). Scores are ranked as float32: finer differences count as ties."""
    C = scores.shape[1]
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0, which ties with it
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats' magnitude bits flipped: ints in the floats' order
    keys = ordered.long() << 32 | (C - 1 - torch.arange(C, device=scores.device))
    return keys.topk(n, dim=1).indices


@cache
def _contenders(beam: int, k: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The children (beam slot p, rank r) that can be among a depth's n best, as slots and ranks
    [C]: the beam and each position's candidates are sorted, so (p+1)(r+1) children are at
    least as good as (p, r), and with more than n of them it cannot be (n=256, k=16: 866 of 4096)."""
    cells = [(p, r) for p in range(beam) for r in range(k) if (p + 1) * (r + 1) <= n]
    return tuple(to_device(column, device) for column in zip(*cells))
