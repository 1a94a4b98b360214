"""What every drafter gives the engine, and what the engine gives it back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from bastion.sampling import Sampling


@dataclass
class BlockProposal:
    """Per-position candidates for the K tokens after each row's root.

    Position j holds candidates for the token j+1 places after the root, drawn independently
    given the verified context (a block-diffusion drafter's marginals), best first. Tree
    policies combine them into trees; -inf log-probability marks "no candidate".
    """

    roots: list[int]  # [B] last verified token of each row
    tokens: torch.Tensor  # [B, K, k] candidate token ids, best first
    logprobs: torch.Tensor  # [B, K, k] their draft log-probabilities
    logits: torch.Tensor | None = None  # [B, K, V] full draft logits, when the drafter has them

    @property
    def block_size(self) -> int:
        return self.tokens.shape[1]

    def distributions(self, sampling: Sampling, vocab_size: int) -> torch.Tensor:
        """The draft distributions q [B, K, V] that sampled trees are drawn from: the full
        logits through the same temperature / top-k / top-p as the target, or else the
        candidates' own probabilities, renormalised."""
        if self.logits is not None:
            return sampling.probs(self.logits)
        probs = torch.zeros(*self.tokens.shape[:2], vocab_size, device=self.tokens.device)
        probs.scatter_add_(-1, self.tokens, self.logprobs.exp().to(probs.dtype))
        return probs / probs.sum(-1, keepdim=True).clamp_min(1e-30)


@dataclass
class DraftContext:
    """What a drafter sees each step."""

    sequences: list[list[int]]  # per row: prompt + generated; the last token (the root) is not yet in the target cache
    features: torch.Tensor | None  # [B, T, F] target features of the tokens committed since the last call, right-padded
    n_features: list[int]  # [B] valid T per row
    cache: object = None  # the target's KVCache (drafters that run the target itself draft against it)


class Drafter(Protocol):
    feature_layers: tuple[int, ...]  # target layers whose outputs the drafter conditions on (may be empty)

    def reset(self, batch_size: int, capacity: int) -> None:
        """Forget all rows: a new batch of prompts starts; no row will exceed `capacity` tokens."""

    def propose(self, ctx: DraftContext) -> BlockProposal:
        """Draft the next block for every row."""

    def drafts(self, ctx: DraftContext) -> bool:
        """Draft this step? (False: the drafter itself judges that drafting does not pay now.)"""

    def absorb(self, ctx: DraftContext) -> None:
        """A step without drafting (the budget chose AR): take in the newly verified tokens of
        `ctx` so the next propose() sees the whole context."""

    def keep_rows(self, rows: list[int]) -> None:
        """Finished rows leave the batch; keep `rows`, in that order."""

    # Optional, for drafters that can draft inside the verification forward (FlexDraft):
    #   extra_tokens(max_nodes) -> int: cache slots needed beyond the tree
    #   parallel(trees, contexts) -> bool: draft inside this step's verification?
    #   verify_forward(cache, trees, tokens, depths, tree_mask) -> hidden [B, M, h]
    #   accept(paths): the accepted paths of that verification


def top_candidates(logits: torch.Tensor, roots: list[int], k: int) -> BlockProposal:
    """A BlockProposal from draft logits [B, K, V]: the top-k tokens of each position."""
    logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    top = logprobs.topk(k, dim=-1)
    return BlockProposal(roots=roots, tokens=top.indices, logprobs=top.values, logits=logits)
