"""What every drafter gives the engine, and what the engine gives it back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


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
    probs: torch.Tensor | None = None  # [B, K, V] full draft marginals, when the drafter has them

    @property
    def block_size(self) -> int:
        return self.tokens.shape[1]


@dataclass
class DraftContext:
    """What a drafter sees each step."""

    sequences: list[list[int]]  # per row: prompt + generated; the last token (the root) is not yet in the target cache
    features: torch.Tensor | None  # [B, T, F] target features of the tokens committed since the last call, right-padded
    n_features: list[int]  # [B] valid T per row


class Drafter(Protocol):
    feature_layers: tuple[int, ...]  # target layers whose outputs the drafter conditions on (may be empty)

    def reset(self, batch_size: int, capacity: int) -> None:
        """Forget all rows: a new batch of prompts starts; no row will exceed `capacity` tokens."""

    def propose(self, ctx: DraftContext) -> BlockProposal:
        """Draft the next block for every row."""

    def keep_rows(self, rows: list[int]) -> None:
        """Finished rows leave the batch; keep `rows`, in that order."""


def top_candidates(logits: torch.Tensor, roots: list[int], k: int) -> BlockProposal:
    """A BlockProposal from draft logits [B, K, V]: the top-k tokens of each position."""
    logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    top = logprobs.topk(k, dim=-1)
    return BlockProposal(roots=roots, tokens=top.indices, logprobs=top.values, probs=logprobs.exp())
