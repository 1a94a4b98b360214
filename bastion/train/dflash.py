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
from bastion.train.examples import Example, fixed_batches, sample_anchors
from bastion.train.loop import train_loop
from bastion.verify import matched_prefix

CHAIN_EXAMPLES = 24  # held-out answers walked for val_chain_aal at each validation (~2 s on a CPU)


def sample_batch(examples: list[Example], n_seqs: int, n_anchors: int, gen: torch.Generator):
    """sample_anchors plus the target features, padded: features [B, S, F] (float32)."""
    picks, tokens, anchors, anchor_ok, lengths = sample_anchors(examples, n_seqs, n_anchors, gen)
    features = torch.zeros(n_seqs, tokens.shape[1], picks[0].features.shape[1])
    for b, e in enumerate(picks):
        features[b, : len(e.tokens) - 1] = e.features.float()
    return tokens, features, anchors, anchor_ok, lengths


def block_loss(drafter: DFlashDrafter, batch, gamma: float, to_draft: torch.Tensor | None = None):
    """Weighted cross-entropy over block positions 1..K-1 (over the draft vocabulary when the
    drafter has one: `to_draft` maps target ids to draft ids, -1 outside it, and those labels
    carry no loss); also per-position hits and counts."""
    tokens, features, anchors, anchor_ok, lengths = batch
    B, S = tokens.shape
    K = drafter.block_size
    hidden = drafter.block_hidden(features, tokens, anchors)[:, :, 1:]  # [B, M, K-1, h]
    logits = F.linear(hidden.flatten(0, 2), drafter.head_weight()).float()  # [B*M*(K-1), V']: a 2-D matmul, not a slow bmm
    label_pos = anchors[:, :, None] + torch.arange(1, K)  # [B, M, K-1]
    valid = anchor_ok[:, :, None] & (label_pos < lengths[:, None, None])
    labels = tokens.gather(1, label_pos.clamp(max=S - 1).flatten(1)).view_as(label_pos)
    if to_draft is not None:
        labels = to_draft[labels]
    scored = valid & (labels >= 0)
    labels = labels.clamp(min=0)
    ce = F.cross_entropy(logits, labels.flatten(), reduction="none").view_as(labels)
    weights = scored * torch.exp(-torch.arange(K - 1) / gamma)
    loss = (ce * weights).sum() / weights.sum()
    hits = ((logits.argmax(-1).view_as(labels) == labels) & scored).flatten(0, 1).sum(0)  # [K-1]
    return loss, hits, valid.flatten(0, 1).sum(0)


@torch.no_grad()
def chain_aal(drafter: DFlashDrafter, examples: list[Example]) -> float:
    """Chain decoding's acceptance length at temperature 0 on these sequences, without decoding.

    The sequences are the target's own greedy answers, so chain decoding would reproduce them,
    and its steps are known once the drafter's top-1 block at every answer position is: each
    step's block is rooted where the last one's acceptance stopped. One training forward scores
    all those blocks. The training loss's random anchors overstate this: a block rooted just
    after a rejected draft is harder than one rooted anywhere (SmolLM2, GSM8K: 1.93 walked, as
    chain decoding measures, against 2.23 averaged over every anchor).
    """
    steps = produced = 0
    for e in examples:
        n, start = len(e.tokens), e.answer_start
        anchors = torch.arange(start, n - 1)[None]  # [1, M]: a block at every answer token with a successor
        features = F.pad(e.features.float(), (0, 0, 0, 1))[None]  # [1, n, F]: the last token's are never seen
        hidden = drafter.block_hidden(features, e.tokens[None], anchors)[0, :, 1:]  # [M, K-1, h]
        drafts = drafter.logits(hidden).argmax(-1)  # [M, K-1]
        at = start
        while at < n - 1:
            truth = e.tokens[at + 1 : at + drafter.block_size]
            hits = matched_prefix(drafts[at - start], truth)
            steps, produced, at = steps + 1, produced + hits + 1, at + hits + 1
    return produced / max(steps, 1)


def most_frequent_tokens(examples: list[Example], n: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """A draft vocabulary: the n most frequent answer tokens, ties (unseen tokens among them)
    broken by lower id, which in a BPE vocabulary means a more frequent merge. Also returns
    the share of answer tokens covered."""
    counts = torch.bincount(torch.cat([e.tokens[e.answer_start:] for e in examples]), minlength=vocab_size)
    rank = counts * vocab_size + (vocab_size - 1 - torch.arange(vocab_size))
    top = rank.argsort(descending=True)[:n]
    return top.sort().values, float(counts[top].sum() / counts.sum())


def train_dflash(drafter: DFlashDrafter, examples: list[Example], state_path: Path, steps: int, lr: float = 6e-4,
                 seqs_per_step: int = 4, anchors: int = 32, gamma: float = 4.0, val_examples: list[Example] = (),
                 **loop) -> list[dict]:
    """Optimise the drafter's own weights (the target's embeddings and head stay frozen)."""
    to_draft = None
    if drafter.draft_vocab is not None:  # built once, not per step
        to_draft = torch.full((drafter.target.args.vocab_size,), -1, dtype=torch.long)
        to_draft[drafter.draft_vocab] = torch.arange(len(drafter.draft_vocab))
    return train_loop(
        drafter, [{"params": [p for p in drafter.parameters() if p.requires_grad], "lr": lr}],
        lambda gen: sample_batch(examples, seqs_per_step, anchors, gen),
        lambda batch: block_loss(drafter, batch, gamma, to_draft),
        state_path, steps, desc="train dflash",
        val_batches=fixed_batches(lambda gen: sample_batch(val_examples, seqs_per_step, anchors, gen)) if val_examples else None,
        val_metrics=(lambda: {"val_chain_aal": round(chain_aal(drafter, val_examples[:CHAIN_EXAMPLES]), 4)}) if val_examples else None,
        **loop,
    )
