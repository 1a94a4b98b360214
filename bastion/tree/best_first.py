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
host anyway): a hundred-odd whole-array ops of a few thousand numbers, no per-node work. Its
scores are costs, -log q (float32, as drafters' log-probabilities are: finer differences count
as ties), because a float32 at or above 0 orders as its bits do: a candidate's cost and its
column, written side by side as two int32 halves, are one int64 sort key, so a beam is sorted
by one `sort` of keys and its costs and columns are read back as views of the sorted keys.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from bastion.tree.draft_tree import DraftTree
from bastion.tree.proposal import BlockProposal, TreeProposal

MOST = np.float32(np.finfo(np.float32).max)  # above it, only +inf: no candidate
NOT_A_TREE = "A candidate scores above its parent (a log-probability above 0?): best-first's picks are not a tree."


def best_first(proposal: BlockProposal | TreeProposal, max_nodes: int) -> list[DraftTree]:
    if isinstance(proposal, TreeProposal):
        columns = [proposal.logq.double(), proposal.parents.double(), proposal.tokens.double()]
        logq, parents, tokens = torch.stack(columns).cpu().numpy()  # one transfer
        return best_nodes(cost(logq), parents.astype(np.int64), tokens.astype(np.int64), max_nodes, proposal.depths)
    B, K, k = proposal.tokens.shape
    if max_nodes < 1 or K == 0:
        return [DraftTree.root_only(root) for root in proposal.roots]
    tokens, logprobs = proposal.on_host()  # [B, K, k]
    costs = cost(logprobs)  # [B, K, k], +inf for no candidate
    if costs.min() < 0:
        raise ValueError(NOT_A_TREE)
    beam, levels, cells = np.zeros((B, 1), np.float32), [], []  # the beam above (the root's), each depth's beam and its cells
    best, floor = np.empty((B, 0), np.float32), MOST  # the max_nodes least costs so far (this depth's children too): the most of them is a floor
    for depth in range(K):
        cell, slot, rank = _contenders(k, max_nodes, beam.shape[1])  # [C] each
        keys = _columns(B, len(cell))  # [B, C] int64: each child's column, its cost written above it
        children = keys.view(np.float32)[:, 1::2]  # [B, C]
        np.add(beam[:, slot], costs[:, depth, rank], out=children)
        best = np.concatenate([best, children], 1)
        if best.shape[1] >= max_nodes:
            best = np.partition(best, max_nodes - 1, axis=1)[:, :max_nodes]
            floor = np.minimum(best[:, -1:], MOST)
        width = min(max_nodes, int((children <= floor).sum(1).max()))  # children that can still make it
        if width == 0:
            break
        keys = sorted_keys(keys, width)  # [B, width]: the beam of this depth, best first
        beam = keys.view(np.float32)[:, 1::2]
        levels.append(beam)
        cells.append(cell[keys.view(np.int32)[:, ::2]])
    if not levels:  # no candidate anywhere
        return [DraftTree.root_only(root) for root in proposal.roots]
    widths = [level.shape[1] for level in levels]
    starts = np.cumsum([0, 1, *widths[:-1]])  # [D + 1]: each depth's first column (the root's is 0)
    cell = np.concatenate(cells, 1)  # [B, C - 1]: the children below the root, depth by depth
    above = np.repeat(starts[:-1], widths)  # [C - 1]: each child's depth above: its first column
    parents = np.concatenate([np.full((B, 1), -1), cell // k + above], 1)
    position = np.repeat(np.arange(len(levels)), widths)  # [C - 1]: each child's position in the block (its depth - 1)
    candidates = np.concatenate([np.array(proposal.roots)[:, None], tokens[np.arange(B)[:, None], position, cell % k]], 1)
    return best_nodes(np.concatenate([np.zeros((B, 1), np.float32), *levels], 1), parents, candidates, max_nodes,
                      np.concatenate([[0], position + 1]), sums=True)


def best_nodes(costs: np.ndarray, parents: np.ndarray, tokens: np.ndarray, max_nodes: int, depths: np.ndarray,
               sums: bool = False) -> list[DraftTree]:
    """The root and the max_nodes candidates of least path cost (-log q), best first, as trees.
    costs (float32), parents, tokens: [B, C] candidates, the root (column 0, the only one whose
    parent is -1) and every parent before its children; a child never costs less than its
    parent, so the picks are prefix-closed. depths: [C] each column's depth, alike in every row
    (a beam, or a draft step, per depth). `sums`: each child's cost is its parent's plus one at
    or above 0 (best-first's own beams), so that holds by construction and is not checked."""
    (B, C), rows = costs.shape, np.arange(len(costs))[:, None]
    keys = sorted_keys(cost_keys(costs), min(max(max_nodes, 0) + 1, C))  # ties: parents first
    order = keys.view(np.int32)[:, ::2]  # [B, 1 + N]: node -> candidate
    place = np.full((B, C), -1)  # an unpicked parent stays -1: the check below finds it
    place[rows, order] = np.arange(order.shape[1])  # candidate -> node
    node_parents = place[rows, parents[rows, order]]
    node_parents[:, 0] = -1  # the root's (its parent -1 read the last column's place)
    logq = np.subtract(0.0, keys.view(np.float32)[:, 1::2], dtype=np.float64)  # [B, 1 + N]
    if not sums:  # a drafter's candidate trees are built unchecked: their one check, for the whole batch at once
        below = node_parents[:, 1:]
        if costs.min() < 0 or not (((below >= 0) & (below < np.arange(1, below.shape[1] + 1))) | ~np.isfinite(logq[:, 1:])).all():
            raise ValueError(NOT_A_TREE)
    tokens, sizes = tokens[rows, order], np.isfinite(logq).sum(1).tolist()  # candidates of -inf log-probability are no candidates (they sort last)
    node_depths, mass = depths[order], np.zeros(logq.shape)  # [B, 1 + N] each
    np.cumsum(np.exp(logq[:, 1:]), axis=1, out=mass[:, 1:])  # A_hat of every prefix of every row
    return [DraftTree(tokens[b, :n], node_parents[b, :n], logq[b, :n], checked=False, known_depths=node_depths[b, :n],
                      known_mass=mass[b, :n]) for b, n in enumerate(sizes)]


def cost(logq: np.ndarray) -> np.ndarray:
    """-logq as float32 costs, +0.0 where logq is 0 (a cost of -0.0 has the sign bit set: as a
    key it would sort first)."""
    return np.subtract(np.float32(0), logq, dtype=np.float32)


def cost_keys(costs: np.ndarray) -> np.ndarray:
    """costs [B, C] (float32, at or above 0) -> int64 keys [B, C], each cost above its column."""
    keys = _columns(*costs.shape)
    keys.view(np.float32)[:, 1::2] = costs
    return keys


def sorted_keys(keys: np.ndarray, n: int) -> np.ndarray:
    """The n least int64 keys [B, C] of each row, ascending: with a cost (a float32 at or
    above 0, whose bits order as the float does) in each key's upper half and its column in the
    lower, the n least costs, ties to the lower column: a stable sort's first n, for the price
    of a partition and a sort of n (an argsort that keeps indices costs several times more)."""
    if n < keys.shape[1]:
        keys = np.partition(keys, n - 1, axis=1)[:, :n]
    return np.sort(keys, axis=1)


def _columns(B: int, C: int) -> np.ndarray:
    """[B, C] int64 keys holding their column in the lower half (little-endian: the first int32
    of each), 0 in the upper, where a cost is written: a copy of a cached array at least as wide."""
    return _widest_columns(B, 1 << (C - 1).bit_length())[:, :C].copy()


@cache
def _widest_columns(B: int, C: int) -> np.ndarray:
    keys = np.zeros((B, C), np.int64)
    keys.view(np.int32)[:, ::2] = np.arange(C, dtype=np.int32)
    return keys


def _contenders(k: int, n: int, beam: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The children (beam slot p, rank r) of a beam of `beam` slots that can be among a depth's
    n best, as cells p * k + r, slots and ranks [C]: the beam and each position's candidates are
    sorted, so (p+1)(r+1) children are at least as good as (p, r), and with more than n of them
    it cannot be (n=256, k=16: 861 of 4096). Listed beam-major, those of a narrower beam are a
    prefix of those of the widest (n slots), so one cached list serves every width."""
    cell, slot, rank, ends = _widest_contenders(k, n)
    end = ends[min(beam, n)]
    return cell[:end], slot[:end], rank[:end]


@cache
def _widest_contenders(k: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    slot, rank = np.nonzero(np.arange(1, n + 1)[:, None] * np.arange(1, k + 1) <= n)  # beam-major, as the beam's slots
    ends = np.searchsorted(slot, np.arange(n + 1))  # [n + 1]: contenders of the slots before each
    return slot * k + rank, slot, rank, ends.tolist()
