"""Prompt-lookup drafter: training-free candidates from earlier occurrences of the context.

The last n tokens (n from max_ngram down to min_ngram; the longest n that matches wins) are
searched for in prompt + output; the tokens that followed each match are continuations. Each
position's marginal is the share of matches that continue with a token there, so a single
match gives a chain and several disagreeing matches give a tree.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import torch

from bastion.drafters.base import DraftContext, Drafter
from bastion.tree.proposal import BlockProposal


class NgramDrafter(Drafter):
    """Stateless: everything it needs is in the context, so the base class's bookkeeping suits it."""

    def __init__(self, target=None, drafts: int = 8, max_ngram: int = 3, min_ngram: int = 1, top_k: int = 4, max_matches: int = 16):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes need 1 <= min_ngram <= max_ngram (got {min_ngram}, {max_ngram}).")
        self.drafts, self.max_ngram, self.min_ngram = drafts, max_ngram, min_ngram
        self.top_k, self.max_matches = top_k, max_matches
        self.device = target.device if target is not None else torch.device("cpu")  # where proposals go (sampled trees draw there)

    def propose(self, ctx: DraftContext) -> BlockProposal:
        B, K, k = len(ctx.sequences), self.drafts, self.top_k
        tokens = torch.zeros(B, K, k, dtype=torch.long)
        logprobs = torch.full((B, K, k), -math.inf)
        for b, seq in enumerate(ctx.sequences):
            continuations = self.lookup(np.asarray(seq))
            for pos in range(K):
                counts = Counter(c[pos] for c in continuations if len(c) > pos)
                for rank, (token, n) in enumerate(counts.most_common(k)):
                    tokens[b, pos, rank] = token
                    logprobs[b, pos, rank] = math.log(n / len(continuations))
        send = {"device": self.device, "non_blocking": True}  # built on the host, entry by entry; sent once
        return BlockProposal([seq[-1] for seq in ctx.sequences], tokens.to(**send), logprobs.to(**send))

    def lookup(self, seq: np.ndarray) -> list[list[int]]:
        """Continuations of the most recent matches of the longest matching suffix."""
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(seq) <= n:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # starts with >= 1 token after
            starts = np.flatnonzero((windows == seq[-n:]).all(axis=1))[::-1][: self.max_matches]
            if len(starts):
                return [seq[s + n : s + n + self.drafts].tolist() for s in starts]
        return []
