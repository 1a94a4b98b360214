"""What a drafter proposes, in the forms tree policies read: per-position candidates (a block
drafter's marginals) or candidate trees (an autoregressive drafter's)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
    logits: torch.Tensor | None = None  # [B, K, V'] draft logits, when the drafter has them
    vocab: torch.Tensor | None = None  # [V'] the token ids of the logits' last dimension (None: the whole vocabulary)

    def on_host(self) -> tuple[np.ndarray, np.ndarray]:
        """tokens (int64) and logprobs (float32) [B, K, k] on the host, in one transfer from the
        device: the tokens travel as the bits of int32s beside the logprobs, in float32 (a
        drafter's log-probabilities are float32; best-first ranks them in float32 anyway)."""
        bits = self.tokens.to(torch.int32).view(torch.float32)
        tokens, logprobs = torch.stack([bits, self.logprobs.to(torch.float32)]).cpu().numpy()
        return tokens.view(np.int32).astype(np.int64), logprobs

    def distributions(self, sampling: Sampling, vocab_size: int) -> torch.Tensor:
        """The draft distributions q [B, K, V] that sampled trees are drawn from: the logits
        through the same temperature / top-k / top-p as the target (0 outside a draft
        vocabulary), or else the candidates' own probabilities, renormalised."""
        if self.logits is not None:
            probs = sampling.probs(self.logits)
            if self.vocab is None:
                return probs
            return probs.new_zeros(*probs.shape[:-1], vocab_size).index_copy_(-1, self.vocab, probs)
        probs = torch.zeros(*self.tokens.shape[:2], vocab_size, device=self.tokens.device)
        probs.scatter_add_(-1, self.tokens, self.logprobs.exp().to(probs.dtype))
        return probs / probs.sum(-1, keepdim=True).clamp_min(1e-30)


@dataclass
class TreeProposal:
    """Candidate trees an autoregressive drafter grew itself (EAGLE-2's expansion): each node's
    children are the drafter's top choices given that node's own path, not one distribution
    per position. Per row, C candidates, the root first and every parent before its children;
    tree policies pick nodes from them (best-first: the N of highest path probability, EAGLE-2's
    rerank; chain and static: by sibling rank)."""

    roots: list[int]  # [B] last verified token of each row
    tokens: torch.Tensor  # [B, C] candidate token ids; column 0: the root
    parents: torch.Tensor  # [B, C] index of each candidate's parent (-1: the root)
    logq: torch.Tensor  # [B, C] draft log-probability of the path root -> candidate (root: 0; -inf: no candidate)
    ranks: torch.Tensor  # [B, C] rank among its siblings, 0 for the drafter's top choice
    depths: np.ndarray  # [C] each candidate's depth (the root's 0), alike in every row: a drafter grows a level per draft step

    @property
    def depth(self) -> int:
        """The deepest candidates' depth (the draft steps that grew them): the deepest node a tree drawn from it can have."""
        return int(self.depths.max())


def top_candidates(logits: torch.Tensor, roots: list[int], k: int, vocab: torch.Tensor | None = None) -> BlockProposal:
    """A BlockProposal from draft logits [B, K, V'] over the tokens `vocab` [V'] (None: the
    whole vocabulary): the top-k tokens of each position (all V' where k > V'). A draft
    vocabulary's logits are ranked as they are: spread over the whole vocabulary with -inf
    elsewhere they give the same candidates, for a softmax and top-k over V tokens, not V'."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    top = torch.log_softmax(logits, dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
    tokens = top.indices if vocab is None else vocab[top.indices]
    return BlockProposal(roots=roots, tokens=tokens, logprobs=top.values, logits=logits, vocab=vocab)


def matched_prefix(drafts: torch.Tensor, truth: torch.Tensor) -> int:
    """How many of a chain's drafts [K] a greedy verifier accepts, given the target's tokens
    after the chain's root [T]: the length of their common prefix."""
    n = min(len(drafts), len(truth))
    return int((drafts[:n] == truth[:n]).int().cumprod(0).sum())
