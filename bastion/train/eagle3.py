"""Train an EAGLE-3 drafter on self-distillation data (training-time test, as EAGLE-3 and
SpecForge do).

Every answer position roots a chain at once (Eagle3Drafter.unrolled): step j of the chain
whose context ends at position q reads the drafter's own step j - 1 output, as tree drafting
does, and predicts the token at q + 2 + j, with weight decay^j. Labels outside the draft
vocabulary carry no loss (the drafter cannot draft them). The target stays frozen: its
embeddings are shared, its features were recorded with the data.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from bastion.drafters.base import draft_ids
from bastion.drafters.eagle3 import Eagle3Drafter
from bastion.train.examples import Example, fixed_batches, padded_features, sample_padded
from bastion.train.loop import train_loop


def sample_sequences(examples: list[Example], n_seqs: int, columns: torch.Tensor, gen: torch.Generator):
    """n_seqs random examples, padded: tokens [B, S], the features the drafter reads [B, S - 1, F]
    (`columns` of the recorded ones; the last token's are never recorded), answer starts and
    lengths [B]."""
    picks, tokens, lengths = sample_padded(examples, n_seqs, gen)
    features = padded_features(picks, tokens.shape[1] - 1, columns)
    return tokens, features, torch.tensor([e.answer_start for e in picks]), lengths


def ttt_loss(drafter: Eagle3Drafter, batch, steps: int, decay: float, to_draft: torch.Tensor):
    """Weighted cross-entropy of every step at every answer position over the draft vocabulary;
    per-step hits and counts."""
    tokens, features, starts, lengths = batch
    B, P = features.shape[:2]
    first = max(0, int(starts.min()) - 2)  # the first chain whose first draft is an answer token
    outputs = drafter.unrolled(features, tokens, steps, first)
    P = P - first
    device = tokens.device
    label_pos = first + torch.arange(P, device=device)[None, :, None] + 2 + torch.arange(steps, device=device)  # [1, P, steps]
    valid = (label_pos >= starts[:, None, None]) & (label_pos < lengths[:, None, None])  # [B, P, steps]: answer tokens only
    labels = to_draft[tokens.gather(1, label_pos.clamp(max=tokens.shape[1] - 1).expand(B, -1, -1).flatten(1)).view(B, P, steps)]
    scored = valid & (labels >= 0)
    hidden = torch.stack(outputs, 2)[scored]  # [n, h]: only what carries loss goes through the head
    logprobs = drafter.draft_logprobs(hidden)
    ce = F.nll_loss(logprobs, labels[scored], reduction="none")
    weights = (decay ** torch.arange(steps, dtype=logprobs.dtype, device=device)).expand(B, P, steps)[scored]
    loss = (ce * weights).sum() / weights.sum().clamp_min(1e-9)
    step_of = torch.arange(steps, device=device).expand(B, P, steps)[scored]
    hits = torch.zeros(steps, dtype=torch.long, device=device).index_add_(0, step_of, (logprobs.argmax(-1) == labels[scored]).long())
    return loss, hits, valid.flatten(0, 1).sum(0)


def train_eagle3(drafter: Eagle3Drafter, examples: list[Example], state_path: Path, steps: int, columns: torch.Tensor,
                 lr: float = 5e-4, seqs_per_step: int = 4, ttt_steps: int = 7, decay: float = 0.8,
                 val_examples: list[Example] = (), **loop) -> list[dict]:
    """Optimise the drafter's own weights; `columns` picks its three layers' features out of the
    recorded ones."""
    to_draft = draft_ids(torch.arange(len(drafter.d2t)) + drafter.d2t.cpu(), drafter.target.args.vocab_size).to(drafter.d2t.device)  # built once
    return train_loop(
        drafter, [{"params": [p for p in drafter.parameters() if p.requires_grad], "lr": lr}],
        lambda gen: sample_sequences(examples, seqs_per_step, columns, gen),
        lambda batch: ttt_loss(drafter, batch, ttt_steps, decay, to_draft),
        state_path, steps, desc="train eagle3",
        val_batches=fixed_batches(lambda gen: sample_sequences(val_examples, seqs_per_step, columns, gen)) if val_examples else None,
        **loop,
    )
