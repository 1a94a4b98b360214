"""Train a DFlash drafter on self-distillation data (the public DFlash / SpecForge recipe).

Per sequence, random anchors inside the answer each root a block (anchor token + mask
tokens). A block sees the target features of the tokens before its anchor and itself, never
another block; position k predicts the token at anchor + k with weight exp(-(k-1)/gamma),
since early positions decide most of the accepted length. The target stays frozen: only the
drafter's layers, fc and norms learn.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from bastion.drafters.dflash import DFlashDrafter
from bastion.train.examples import Example, block_labels, fixed_batches, padded_features, sample_anchors, walk_chains
from bastion.train.loop import train_loop

CHAIN_EXAMPLES = 24  # held-out answers walked for val_chain_aal at each validation (seconds on a CPU)


def sample_batch(examples: list[Example], n_seqs: int, n_anchors: int, gen: torch.Generator, soft_labels: bool = False):
    """sample_anchors plus the target features, padded: features [B, S, F] (float32); and with
    `soft_labels`, the target's distributions at every token: top ids and log-probs
    [B, S, k] (else None)."""
    picks, tokens, anchors, anchor_ok, lengths = sample_anchors(examples, n_seqs, n_anchors, gen)
    S = tokens.shape[1]
    soft = None
    if soft_labels:
        k = picks[0].top_ids.shape[1]
        soft = torch.zeros(n_seqs, S, k, dtype=torch.long), torch.zeros(n_seqs, S, k)
        for b, e in enumerate(picks):
            soft[0][b, e.answer_start : len(e.tokens)] = e.top_ids.long()
            soft[1][b, e.answer_start : len(e.tokens)] = e.top_logprobs.float()
    return tokens, padded_features(picks, S), anchors, anchor_ok, lengths, soft


def feature_std(examples: list[Example]) -> torch.Tensor:
    """Each target feature's standard deviation over the examples' tokens [F]: the scale of
    training noise, per feature, since a few hidden dimensions are orders of magnitude larger."""
    total = sq = count = 0
    for e in examples:
        f = e.features.double()
        total, sq, count = total + f.sum(0), sq + f.square().sum(0), count + len(f)
    return (sq / count - (total / count).square()).clamp(min=0).sqrt().float()


def with_feature_noise(batch, scale: torch.Tensor, gen: torch.Generator):
    """The batch with Gaussian noise of `scale` [F] added to its target features (EAGLE's
    regulariser: the drafter cannot lean on exact features it has memorised)."""
    tokens, features, *rest = batch
    return (tokens, features + torch.randn(features.shape, generator=gen) * scale, *rest)


def block_loss(drafter: DFlashDrafter, batch, gamma: float, to_draft: torch.Tensor | None = None, soft_labels: float = 0.0):
    """Weighted cross-entropy over block positions 1..K-1 (over the draft vocabulary when the
    drafter has one: `to_draft` maps target ids to draft ids, -1 outside it, and those labels
    carry no loss); also per-position hits and counts. With `soft_labels` > 0 the cross-entropy
    is that share against the target's own distribution there, the rest against its token."""
    tokens, features, anchors, anchor_ok, lengths, soft = batch
    K = drafter.block_size
    hidden = drafter.block_hidden(features, tokens, anchors)[:, :, 1:]  # [B, M, K-1, h]
    logits = F.linear(hidden.flatten(0, 2), drafter.head_weight()).float()  # [B*M*(K-1), V']: a 2-D matmul, not a slow bmm
    label_pos, labels, valid, scored = block_labels(tokens, anchors, anchor_ok, lengths, K - 1, to_draft)  # [B, M, K-1]
    ce = F.cross_entropy(logits, labels.flatten(), reduction="none").view_as(labels)
    if soft_labels:
        index = label_pos.flatten(1)[:, :, None].expand(-1, -1, soft[0].shape[-1])  # [B, M*(K-1), k]
        soft_ce = soft_cross_entropy(logits, soft[0].gather(1, index).flatten(0, 1), soft[1].gather(1, index).flatten(0, 1), to_draft)
        ce = (1 - soft_labels) * ce + soft_labels * soft_ce.view_as(labels)
    weights = scored * torch.exp(-torch.arange(K - 1, device=ce.device) / gamma)
    loss = (ce * weights).sum() / weights.sum().clamp_min(1e-9)  # 0 / 0 where no label is in the draft vocabulary
    hits = ((logits.argmax(-1).view_as(labels) == labels) & scored).flatten(0, 1).sum(0)  # [K-1]
    return loss, hits, valid.flatten(0, 1).sum(0)


def soft_cross_entropy(logits: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor,
                       to_draft: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of logits [N, V'] against the target's distributions given as top ids and
    log-probs [N, k], renormalised over the ids the draft vocabulary holds. [N]"""
    if to_draft is not None:
        top_ids = to_draft[top_ids]
        top_logprobs = top_logprobs.masked_fill(top_ids < 0, -torch.inf)
        top_ids = top_ids.clamp(min=0)
    target_probs = top_logprobs.softmax(-1).nan_to_num(0.0)  # a row wholly outside the vocabulary: no loss
    return -(target_probs * logits.log_softmax(-1).gather(1, top_ids)).sum(-1)


@torch.no_grad()
def chain_aal(drafter: DFlashDrafter, examples: list[Example]) -> float:
    """Chain decoding's acceptance length at temperature 0 on these sequences, without decoding
    (train/examples.py walk_chains): one training forward scores a block at every answer token."""
    device = drafter.fc.weight.device

    def drafts(e: Example) -> list[torch.Tensor]:
        anchors = torch.arange(e.answer_start, len(e.tokens) - 1, device=device)[None]  # [1, M]
        features = F.pad(e.features.to(device).float(), (0, 0, 0, 1))[None]  # [1, n, F]: the last token's are never seen
        hidden = drafter.block_hidden(features, e.tokens.to(device)[None], anchors)[0, :, 1:]  # [M, K-1, h]
        return [drafter.logits(hidden).argmax(-1)]

    return walk_chains(examples, drafts)[0] or 0.0


def most_frequent_tokens(examples: list[Example], n: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """A draft vocabulary: the n most frequent answer tokens, ties (unseen tokens among them)
    broken by lower id, which in a BPE vocabulary means a more frequent merge. Also returns
    the share of answer tokens covered."""
    counts = torch.bincount(torch.cat([e.tokens[e.answer_start:] for e in examples]), minlength=vocab_size)
    rank = counts * vocab_size + (vocab_size - 1 - torch.arange(vocab_size))
    top = rank.argsort(descending=True)[:n]
    return top.sort().values, float(counts[top].sum() / counts.sum())


def train_dflash(drafter: DFlashDrafter, examples: list[Example], state_path: Path, steps: int, lr: float = 6e-4,
                 seqs_per_step: int = 4, anchors: int = 32, gamma: float = 4.0, feature_noise: float = 0.0,
                 soft_labels: float = 0.0, val_examples: list[Example] = (), **loop) -> list[dict]:
    """Optimise the drafter's own weights (the target's embeddings and head stay frozen).
    `feature_noise`: the noise added to training features, in units of each feature's std.
    `soft_labels`: the loss's share against the target's distributions (see block_loss)."""
    if soft_labels and examples[0].top_ids is None:
        raise ValueError("recipe.optim.soft_labels needs self-distillation data with the target's distributions: set data.top_k.")
    noise = feature_noise * feature_std(examples) if feature_noise else None

    def batches(gen: torch.Generator):
        batch = sample_batch(examples, seqs_per_step, anchors, gen, soft_labels > 0)
        return batch if noise is None else with_feature_noise(batch, noise, gen)

    to_draft = drafter.to_draft_ids()  # built once, not per step
    return train_loop(
        drafter, [{"params": [p for p in drafter.parameters() if p.requires_grad], "lr": lr}],
        batches,
        lambda batch: block_loss(drafter, batch, gamma, to_draft, soft_labels),
        state_path, steps, desc="train dflash",
        val_batches=fixed_batches(lambda gen: sample_batch(val_examples, seqs_per_step, anchors, gen, soft_labels > 0)) if val_examples else None,
        val_metrics=(lambda: {"val_chain_aal": round(chain_aal(drafter, val_examples[:CHAIN_EXAMPLES]), 4)}) if val_examples else None,
        **loop,
    )
