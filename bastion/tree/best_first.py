"""Best-first policy (BASTION): the tree of N nodes that maximises A_hat, for every N.

Node paths are rank sequences (r_1..r_d) over the proposal's per-position candidates, scored
by rho = prod_k q_k(x_k). Scores only fall along a path and along a sibling list, so the N
highest-scoring nodes form a prefix-closed tree, and listing them by decreasing score (parents
first on ties) gives, in every prefix of n nodes, the optimal tree of size n.

From a drafter's candidate trees (TreeProposal) that is simply their N best nodes (EAGLE-2's
rerank). From per-position candidates it is built depth by depth for all rows at once: the N
best nodes hold at most N of any depth, and those are children of the N best of the depth
above, so a beam of width N per depth (top-N of N x k children, of which only those with
fewer than N better siblings and cousins can make it) holds them all. A node below the N-th
best score seen so far cannot make it, nor can anything under it, so beams narrow as they
deepen and stop where every row's candidates are spent; one sort of the beams' union orders them.

It runs on the host, in numpy, after one transfer of the proposal (the tree is needed on the
host anyway): a few hundred whole-array ops of a few thousand numbers, no per-node work.
Scores are float32, as drafters' log-probabilities are: finer differences count as ties.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from bastion.tree.draft_tree import DraftTree
from bastion.tree.proposal import BlockProposal, TreeProposal

LEAST = np.float32(-np.finfo(np.float32).max)  # below it, only -inf: no candidate


def best_first(proposal: BlockProposal | TreeProposal, max_nodes: int) -> list[DraftTree]:
    if isinstance(proposal, TreeProposal):
        columns = [proposal.logq.double(), proposal.parents.double(), proposal.tokens.double()]
        logq, parents, tokens = torch.stack(columns).cpu().numpy()  # one transfer
        return best_nodes(logq.astype(np.float32), parents.astype(np.int64), tokens.astype(np.int64), max_nodes, proposal.depths)
    B, K, k = proposal.tokens.shape
    if max_nodes < 1 or K == 0:
        return [DraftTree.root_only(root) for root in proposal.roots]
    tokens, logprobs = proposal.on_host()  # [B, K, k]
    logprobs = logprobs.astype(np.float32)
    # candidates, the root first, then each depth's beam: path score, parent candidate, token
    scores, parents, candidates = [np.zeros((B, 1), np.float32)], [np.full((B, 1), -1)], [np.array(proposal.roots)[:, None]]
    beam, beam_start, n_seen = scores[0], 0, 1  # the beam above: its scores, its first candidate
    best = np.empty((B, 0), np.float32)  # the max_nodes best scores so far (this depth's children too): their least is a floor
    rows = np.arange(B)[:, None]
    for depth in range(K):
        slot, rank = _contenders(beam.shape[1], k, max_nodes)  # [C] each
        children = beam[:, slot] + logprobs[:, depth, rank]  # [B, C]
        best = np.concatenate([best, children], 1)
        if best.shape[1] > max_nodes:
            best = np.partition(best, -max_nodes, axis=1)[:, -max_nodes:]
        floor = np.maximum(best.min(1, keepdims=True), LEAST) if best.shape[1] == max_nodes else LEAST
        width = min(max_nodes, int((children >= floor).sum(1).max()))  # children that can still make it
        if width == 0:
            break
        top = ranked(children, width)  # [B, width]: the beam of this depth, best first
        beam = children[rows, top]
        scores.append(beam)
        parents.append(slot[top] + beam_start)
        candidates.append(tokens[rows, depth, rank[top]])
        beam_start, n_seen = n_seen, n_seen + width
    depths = np.repeat(np.arange(len(scores)), [level.shape[1] for level in scores])  # [C]: each column's depth
    return best_nodes(np.concatenate(scores, 1), np.concatenate(parents, 1), np.concatenate(candidates, 1), max_nodes, depths)


def best_nodes(scores: np.ndarray, parents: np.ndarray, tokens: np.ndarray, max_nodes: int, depths: np.ndarray) -> list[DraftTree]:
    """The root and the max_nodes candidates of highest path score, best first, as trees.
    scores (float32), parents, tokens: [B, C] candidates, the root (column 0) and every parent
    before its children; a child never scores above its parent, so the picks are prefix-closed.
    depths: [C] each column's depth, alike in every row (a beam, or a draft step, per depth)."""
    (B, C), rows = scores.shape, np.arange(len(scores))[:, None]
    order = ranked(scores, min(max(max_nodes, 0) + 1, C))  # ties: parents first
    place = np.full((B, C), -1)
    place[rows, order] = np.arange(order.shape[1])  # candidate -> node
    parent = parents[rows, order]
    node_parents = np.where(parent < 0, parent, place[rows, np.maximum(parent, 0)])
    logq = scores[rows, order].astype(np.float64)  # [B, 1 + N]
    below = node_parents[:, 1:]  # the trees are built unchecked: their one check, for the whole batch at once
    if scores.max() > 0 or not (((below >= 0) & (below < np.arange(1, below.shape[1] + 1))) | ~np.isfinite(logq[:, 1:])).all():
        raise ValueError("A candidate scores above its parent (a log-probability above 0?): best-first's picks are not a tree.")
    tokens, sizes = tokens[rows, order], np.isfinite(logq).sum(1).tolist()  # candidates of -inf log-probability are no candidates (they sort last)
    node_depths = depths[order]  # [B, 1 + N]
    return [DraftTree(tokens[b, :n], node_parents[b, :n], logq[b, :n], checked=False, known_depths=node_depths[b, :n])
            for b, n in enumerate(sizes)]


def ranked(scores: np.ndarray, n: int) -> np.ndarray:
    """The columns of the n highest float32 scores [B, C] per row, none above 0 (log-probabilities),
    best first, ties to the lower column: a stable descending sort's first n, from a partition
    and a sort of int64 keys that hold each score's order above its column (an argsort that
    keeps indices costs several times more)."""
    C = scores.shape[1]
    magnitude = scores.view(np.int32) & 0x7FFFFFFF  # at or below 0 (-0.0 and -inf too), a float's order reversed, as an int
    keys = magnitude.astype(np.int64) << 32 | np.arange(C)  # ascending keys: descending scores, then columns
    if n < C:
        keys = np.partition(keys, n - 1, axis=1)[:, :n]
    return np.sort(keys, axis=1) & 0xFFFFFFFF


@cache
def _contenders(beam: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The children (beam slot p, rank r) that can be among a depth's n best, as slots and ranks
    [C]: the beam and each position's candidates are sorted, so (p+1)(r+1) children are at
    least as good as (p, r), and with more than n of them it cannot be (n=256, k=16: 861 of 4096)."""
    return np.nonzero(np.arange(1, beam + 1)[:, None] * np.arange(1, k + 1) <= n)  # beam-major, as the beam's slots
