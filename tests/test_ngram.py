"""Prompt lookup: matches, marginals, and the trees they give."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bastion.drafters.base import DraftContext
from bastion.drafters.ngram import NgramDrafter
from bastion.tree.best_first import best_first


def test_longest_suffix_match_wins_and_recent_first():
    drafter = NgramDrafter(drafts=3, max_ngram=2)
    seq = np.array([1, 2, 9, 9, 5, 2, 7, 8, 1, 2])
    # suffix [1, 2] occurs at 0 (followed by 9 9 5): the 1-gram [2] would also match at 5
    assert drafter.lookup(seq) == [[9, 9, 5]]
    seq = np.array([4, 2, 7, 3, 2, 8, 2])
    assert drafter.lookup(seq) == [[8, 2], [7, 3, 2]]  # 1-gram [2]: most recent match first


def test_disagreeing_matches_make_a_tree():
    drafter = NgramDrafter(drafts=2, max_ngram=1, top_k=2)
    ctx = DraftContext([[5, 1, 5, 2, 5, 1, 5]], None, [0])
    proposal = drafter.propose(ctx)
    # matches of [5]: at 4 -> (1, 5), at 2 -> (2, 5), at 0 -> (1, 5)
    assert proposal.tokens[0, 0].tolist() == [1, 2]
    assert proposal.logprobs[0, 0].tolist() == pytest.approx([math.log(2 / 3), math.log(1 / 3)])
    assert proposal.tokens[0, 1, 0] == 5 and proposal.logprobs[0, 1, 1] == -math.inf
    (tree,) = best_first(proposal, 8)
    assert [tree.tokens[c] for c in tree.children[0]] == [1, 2] and tree.n_nodes == 4


def test_no_match_proposes_nothing():
    proposal = NgramDrafter().propose(DraftContext([[1, 2, 3]], None, [0]))
    assert (proposal.logprobs == -math.inf).all()
    assert best_first(proposal, 8)[0].n_nodes == 0
