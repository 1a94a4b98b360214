"""DraftTree masks and positions, and the policies' trees."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from bastion.tree.best_first import best_first, cost, cost_keys, sorted_keys
from bastion.tree.chain import chain
from bastion.tree.draft_tree import DraftTree, pack
from bastion.verify import verify_greedy
from bastion.tree.proposal import BlockProposal, TreeProposal

#        0(root)
#       /      \
#      1        2
#     / \        \
#    3   4        5
#    |
#    6
TREE = DraftTree((10, 11, 12, 13, 14, 15, 16), (-1, 0, 0, 1, 1, 2, 3), (0.0, -0.1, -0.2, -0.3, -0.4, -0.5, -0.6))


def test_ancestor_mask_and_depths_match_hand_built_reference():
    T, F = True, False
    expected = torch.tensor([
        [T, F, F, F, F, F, F],
        [T, T, F, F, F, F, F],
        [T, F, T, F, F, F, F],
        [T, T, F, T, F, F, F],
        [T, T, F, F, T, F, F],
        [T, F, T, F, F, T, F],
        [T, T, F, T, F, F, T],
    ])
    assert torch.equal(pack([TREE], "cpu").mask[0], expected)
    assert TREE.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert TREE.path(6) == [0, 1, 3, 6]
    assert TREE.children[1] == (3, 4)


def test_pack_pads_rows_that_see_only_themselves():
    small = DraftTree((20, 21), (-1, 0), (0.0, -1.0))
    packed = pack([TREE, small], "cpu")
    tokens, depths, mask, parents, ancestors = packed
    assert packed.depth == 3 and tokens.tolist() == [[10, 11, 12, 13, 14, 15, 16], [20, 21, 0, 0, 0, 0, 0]]
    assert depths.tolist() == [[0, 1, 1, 2, 2, 2, 3], [0, 1, 0, 0, 0, 0, 0]]
    assert torch.equal(mask[0], pack([TREE], "cpu").mask[0])
    assert torch.equal(mask[1, :2, :2], torch.tensor([[True, False], [True, True]]))
    assert torch.equal(mask[1, 2:], torch.eye(7, dtype=torch.bool)[2:])
    assert parents.tolist() == [[-1, 0, 0, 1, 1, 2, 3], [-1, 0, -1, -1, -1, -1, -1]]
    assert ancestors[:, 0].tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 2, 3], [0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0, 0]]
    assert ancestors[:, 1].tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 0, 2, 3, 4, 5, 6], [0, 0, 2, 3, 4, 5, 6], [0, 0, 2, 3, 4, 5, 6]]
    assert all(t.is_contiguous() for t in (tokens, depths, parents))  # one layout for a compiled forward, whatever the depth


@pytest.mark.parametrize("seed", range(3))
def test_packed_masks_and_depths_of_big_trees_match_the_trees_own(seed):
    """Trees of different sizes, deep ones among them."""
    rng = np.random.default_rng(seed)
    trees = []
    for n in (300, 130, 64):
        parents = [-1, *(int(rng.integers(0, i)) for i in range(1, n))]
        trees.append(DraftTree(tuple(range(n)), tuple(parents), (0.0,) * n))
    tokens, depths, mask, parents, ancestors = packed = pack(trees, "cpu")
    assert packed.depth == max(t.depths.max() for t in trees) == len(ancestors) - 1
    for b, tree in enumerate(trees):
        n = len(tree.tokens)
        expected = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            expected[i, tree.path(i)] = True
        assert torch.equal(mask[b, :n, :n], expected) and depths[b, :n].tolist() == tree.depths.tolist()
        assert not mask[b, n:, :n].any() and not mask[b, :n, n:].any() and depths[b, n:].eq(0).all()


def test_greedy_verdicts_are_the_deepest_path_of_matched_tokens():
    """On random trees no deeper than 16 (often long chains) with few distinct tokens (so that
    siblings repeat one, and several paths match), every row's verdict is the deepest node
    whose whole path matched the choices, the first such in tree order, walked in Python."""
    rng = np.random.default_rng(0)
    trees = []
    for n in (300, 90, 1):
        parents, depths = [-1], [0]
        for i in range(1, n):
            open_ = [j for j in range(i) if depths[j] < 16]
            p = open_[-1] if rng.random() < 0.5 else int(rng.choice(open_))  # often the latest: deep chains
            parents.append(p)
            depths.append(depths[p] + 1)
        trees.append(DraftTree(tuple(int(t) for t in rng.integers(0, 2, n)), tuple(parents), (0.0,) * n))
    packed = pack(trees, "cpu")
    assert packed.depth == 16
    for _ in range(20):
        choice = torch.from_numpy(rng.integers(0, 2, packed.tokens.shape))
        for b, (tree, verdict) in enumerate(zip(trees, verify_greedy(choice, trees, packed))):
            matched = [all(tree.tokens[j] == choice[b, tree.parents[j]] for j in tree.path(i)[1:]) for i in range(len(tree.tokens))]
            deepest = max((i for i in range(len(tree.tokens)) if matched[i]), key=lambda i: (tree.depths[i], -i))
            assert verdict.path == tree.path(deepest)
            assert verdict.tokens == [int(tree.tokens[i]) for i in verdict.path[1:]] + [int(choice[b, deepest])]

def test_sorted_keys_are_a_stable_descending_sort_of_log_probabilities():
    """Exactly a stable sort's first n of log-probabilities: ties (0.0 and -0.0 among them) to the lower column, -inf last."""
    scores = -np.abs(np.random.default_rng(0).normal(size=(4, 300)).round(1).astype(np.float32))  # many ties
    scores[:, ::7], scores[:, 1::11], scores[:, 2::13] = 0.0, -0.0, -math.inf
    for n in (1, 100, 300):
        keys = sorted_keys(cost_keys(cost(scores)), n)
        assert np.array_equal(keys.view(np.int32)[:, ::2], np.argsort(-scores, axis=1, kind="stable")[:, :n])
        assert np.array_equal(keys.view(np.float32)[:, 1::2], np.sort(-scores, axis=1, kind="stable")[:, :n])


def test_tree_rejects_children_before_parents():
    with pytest.raises(ValueError):
        DraftTree((1, 2, 3), (-1, 2, 0), (0.0, 0.0, 0.0))


def test_tree_rejects_depths_its_parents_contradict():
    """Given depths are what pack sends for positions and what bounds its rounds: a policy's
    wrong ones are refused where the tree is checked, not decoded."""
    assert DraftTree((1, 2, 3), (-1, 0, 1), (0.0, -1.0, -2.0), known_depths=[0, 1, 2]).depths.tolist() == [0, 1, 2]
    for depths in ([0, 1, 1], [0, 1], [1, 2, 3]):
        with pytest.raises(ValueError, match="depths"):
            DraftTree((1, 2, 3), (-1, 0, 1), (0.0, -1.0, -2.0), known_depths=depths)


def test_best_first_refuses_a_child_that_scores_above_its_parent():
    """Its trees are built unchecked; a drafter whose log-probabilities rise along a path would
    make a picked node's parent unpicked (a second root that every verifier accepts)."""
    tokens, parents, logq = torch.tensor([[5, 6, 7]]), torch.tensor([[-1, 0, 1]]), torch.tensor([[0.0, -1.0, -0.5]])
    rising = TreeProposal([5], tokens, parents, logq, torch.zeros(1, 3, dtype=torch.long), np.array([0, 1, 2]))
    for n in (1, 2):  # the child alone, or listed before its parent
        with pytest.raises(ValueError, match="scores above its parent"):
            best_first(rising, n)
    siblings = torch.tensor([[-1, 0, 0]])  # above the root, in an order a sort of magnitudes would pass
    above_zero = TreeProposal([5], tokens, siblings, torch.tensor([[0.0, 0.5, 0.2]]), torch.zeros(1, 3, dtype=torch.long), np.array([0, 1, 1]))
    with pytest.raises(ValueError, match="log-probability above 0"):
        best_first(above_zero, 2)
    block = BlockProposal([5], torch.tensor([[[6, 7], [8, 9]]]), torch.tensor([[[-0.1, -2.0], [0.3, -1.0]]]))
    with pytest.raises(ValueError, match="log-probability above 0"):
        best_first(block, 4)


def test_a_block_proposal_reaches_the_host_with_exact_tokens():
    """Token ids travel beside the log-probabilities in one float32 tensor, as int32 bits: ids
    past 2^24, which a float32 value cannot hold, arrive unchanged."""
    tokens = torch.tensor([[[2**24 + 1, 151_935], [0, 2**31 - 1]]])
    logprobs = torch.tensor([[[-0.25, -1.5], [-math.inf, -3.0]]])
    host_tokens, host_logprobs = BlockProposal([5], tokens, logprobs).on_host()
    assert host_tokens.dtype == np.int64 and np.array_equal(host_tokens, tokens.numpy())
    assert np.array_equal(host_logprobs, logprobs.numpy())


def proposal(probs: list[list[float]]) -> BlockProposal:
    """K positions, k candidates each; candidate r at position j is token 100*j + r."""
    K, k = len(probs), len(probs[0])
    tokens = torch.tensor([[[100 * j + r for r in range(k)] for j in range(K)]])
    logprobs = torch.tensor([[[math.log(p) if p > 0 else -math.inf for p in row] for row in probs]], dtype=torch.float64)
    return BlockProposal([7], tokens, logprobs)


def test_chain_takes_top1_up_to_budget():
    p = proposal([[0.9, 0.1], [0.5, 0.4], [0.8, 0.2]])
    (tree,) = chain(p, 2)
    assert tree.tokens.tolist() == [7, 0, 100] and tree.parents.tolist() == [-1, 0, 1]
    assert tree.expected_accepted() == pytest.approx(0.9 + 0.45)


def all_prefix_closed_trees(K: int, k: int, n: int):
    """Every set of n rank paths (r_1..r_d), d <= K, r < k, closed under taking prefixes."""
    paths = [p for d in range(1, K + 1) for p in itertools.product(range(k), repeat=d)]
    for subset in itertools.combinations(paths, n):
        chosen = set(subset)
        if all(p[:-1] in chosen or len(p) == 1 for p in chosen):
            yield chosen


def a_hat(paths, probs) -> float:
    return sum(math.prod(probs[j][r] for j, r in enumerate(p)) for p in paths)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("K,k", [(3, 2), (2, 3), (4, 2)])
def test_best_first_is_optimal_for_every_size(seed, K, k):
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(3 * torch.randn(K, k + 2, generator=gen), -1).sort(descending=True).values[:, :k].tolist()
    full = best_first(proposal(probs), K * k**K)[0]
    for n in range(1, 7):
        best = max(a_hat(t, probs) for t in all_prefix_closed_trees(K, k, n))
        tree = best_first(proposal(probs), n)[0]
        assert tree.n_nodes == n
        assert tree.expected_accepted() == pytest.approx(best, rel=1e-6)  # scores are float32
        # the size-n tree is the first n nodes of any larger one: controllers may truncate, and price it by its A_hat
        assert full.truncate(n).tokens.tolist() == tree.tokens.tolist() and full.truncate(n).parents.tolist() == tree.parents.tolist()
        assert full.truncate(n).expected_accepted() == pytest.approx(best, rel=1e-6)


def heap_best_first(logprobs: list[list[float]], n: int) -> list[tuple[int, ...]]:
    """The reference: pop the likeliest open rank path, open its children (a child never beats
    its parent), n times."""
    import heapq

    K, k = len(logprobs), len(logprobs[0])
    open_, taken = [(-logprobs[0][r], (r,)) for r in range(k)], []
    heapq.heapify(open_)
    while open_ and len(taken) < n:
        score, path = heapq.heappop(open_)
        taken.append(path)
        for r in range(k if len(path) < K else 0):
            heapq.heappush(open_, (score - logprobs[len(path)][r], (*path, r)))
    return taken


@pytest.mark.parametrize("n", [1, 17, 100, 256])
def test_best_first_of_a_batch_equals_a_heap_search(n):
    gen = torch.Generator().manual_seed(n)
    B, K, k = 3, 12, 10
    logprobs = torch.log_softmax(2 * torch.randn(B, K, 4 * k, generator=gen), -1).sort(-1, descending=True).values[..., :k]
    tokens = torch.rand(B, K, 1000, generator=gen).argsort(-1)[..., :k]  # distinct per position: a token names its rank
    trees = best_first(BlockProposal([1, 2, 3], tokens, logprobs), n)
    for b, tree in enumerate(trees):
        paths = heap_best_first(logprobs[b].tolist(), n)
        assert tree.n_nodes == n and tree.tokens[0] == b + 1
        # node i's path of ranks, from its parent's: the same nodes in the same order, tokens and scores
        ranks = [()]
        for i in range(1, n + 1):
            depth = len(ranks[tree.parents[i]])
            ranks.append((*ranks[tree.parents[i]], int((tokens[b, depth] == tree.tokens[i]).nonzero()[0])))
        assert ranks[1:] == paths
        assert tree.depths.tolist() == [len(r) for r in ranks]  # given by best-first, and kept by a prefix
        assert tree.truncate(n // 2).depths.tolist() == [len(r) for r in ranks[: n // 2 + 1]]
        assert tree.logq[1:] == pytest.approx([sum(logprobs[b, d, r].item() for d, r in enumerate(p)) for p in paths], abs=1e-5)


def test_best_first_lists_certain_children_after_their_parents():
    p = proposal([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])  # ties of every kind
    for n in range(1, 9):
        (tree,) = best_first(p, n)  # DraftTree checks every parent comes first
        assert tree.n_nodes == min(n, 6)
        assert tree.tokens[:3].tolist() == [7, 0, 100][: n + 1] and set(tree.tokens[3:5].tolist()) <= {200, 201}  # either of the tied two
        assert len(set(tree.tokens[3:5].tolist())) == len(tree.tokens[3:5])
        assert tree.tokens[5:].tolist() == [300, 300][: max(n - 4, 0)]
        assert tree.expected_accepted() == pytest.approx([1, 2, 2.5, 3, 3.5, 4][min(n, 6) - 1])


def test_best_first_skips_missing_candidates():
    p = proposal([[1.0, 0.0], [0.5, 0.0]])
    (tree,) = best_first(p, 10)
    assert tree.tokens.tolist() == [7, 0, 100]
    assert best_first(p, 0)[0].tokens.tolist() == [7]  # no budget: the root alone
