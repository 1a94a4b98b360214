"""Sampling settings shared by AR decoding and speculative verification.

At temperature > 0 "lossless" means the output distribution equals that of AR sampling, so
both draw from exactly the same processed distribution: logits / temperature, then top-k,
then top-p. Temperature 0 is greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TREE_MODES = ("sampled", "ranked")


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    # How a tree's children relate to the draft distribution q when temperature > 0:
    #   sampled: children drawn from q without replacement; accept x w.p. min(1, p(x)/q(x)) (SpecInfer, Sequoia)
    #   ranked:  children are the policy's top-ranked tokens; accept x w.p. p(x) (EAGLE)
    # ranked is the default: BASTION (best_first + bastion budget) accepted ~10% more with it at
    # T=1 on GSM8K and MATH-500 (SmolLM2-135M, our DFlash drafter); chain and static trees did
    # slightly better with sampled children (issue 6 note).
    tree_mode: str = "ranked"

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"Sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1 "
                f"(got temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p})."
            )
        if self.tree_mode not in TREE_MODES:
            raise ValueError(f"decode.tree_mode must be one of {', '.join(TREE_MODES)} (got {self.tree_mode}).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits -> the distribution tokens are drawn from (at least fp32)."""
        scores = logits.to(torch.promote_types(logits.dtype, torch.float32)) / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, -torch.inf)
        probs = torch.softmax(scores, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p  # keep the smallest set reaching top_p
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


GREEDY = Sampling()


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> list[int]:
    """One token per row from logits [B, V]: argmax at temperature 0, else a draw."""
    if sampling.greedy:
        return logits.argmax(-1).tolist()
    return torch.multinomial(sampling.probs(logits), 1, generator=generator)[:, 0].tolist()
