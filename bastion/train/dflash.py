"""Train a DFlash drafter on self-distillation data (the public DFlash / SpecForge recipe).

Per sequence, random anchors inside the answer each root a block (anchor token + mask
tokens). A block sees the target features of the tokens before its anchor and itself, never
another block; position k predicts the token at anchor + k with weight exp(-(k-1)/gamma),
since early positions decide most of the accepted length. The target stays frozen: only the
drafter's layers, fc and norms learn.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from bastion.drafters.dflash import DFlashDrafter


@dataclass
class Example:
    tokens: torch.Tensor  # [S] prompt + answer
    features: torch.Tensor  # [S - 1, F] fp16 target features of all but the last token
    answer_start: int


def to_examples(dataset, block_size: int) -> list[Example]:
    """Rows with at least one anchor that can predict something."""
    examples = []
    for row in dataset.with_format("torch"):
        tokens, start = row["input_ids"].long(), int(row["answer_start"])
        if len(tokens) - 2 >= start:
            examples.append(Example(tokens, row["features"], start))
    if not examples:
        raise ValueError("The self-distillation data holds no answer long enough to train on.")
    return examples


def sample_batch(examples: list[Example], n_seqs: int, n_anchors: int, gen: torch.Generator):
    """Pad n_seqs random examples; pick up to n_anchors anchors in each answer.

    Returns tokens [B, S], features [B, S, F] (float32), anchors [B, M], anchor_ok [B, M],
    lengths [B].
    """
    picks = [examples[i] for i in torch.randint(len(examples), (n_seqs,), generator=gen).tolist()]
    S = max(len(e.tokens) for e in picks)
    F_dim = picks[0].features.shape[1]
    tokens = torch.zeros(n_seqs, S, dtype=torch.long)
    features = torch.zeros(n_seqs, S, F_dim)
    anchors = torch.zeros(n_seqs, n_anchors, dtype=torch.long)
    anchor_ok = torch.zeros(n_seqs, n_anchors, dtype=torch.bool)
    for b, e in enumerate(picks):
        n = len(e.tokens)
        tokens[b, :n] = e.tokens
        features[b, : n - 1] = e.features.float()
        candidates = torch.arange(e.answer_start, n - 1)  # each anchor has >= 1 label after it
        chosen = candidates[torch.randperm(len(candidates), generator=gen)[:n_anchors]].sort().values
        anchors[b, : len(chosen)] = chosen
        anchors[b, len(chosen) :] = e.answer_start
        anchor_ok[b, : len(chosen)] = True
    lengths = torch.tensor([len(e.tokens) for e in picks])
    return tokens, features, anchors, anchor_ok, lengths


def block_loss(drafter: DFlashDrafter, head_weight: torch.Tensor, batch, gamma: float):
    """Weighted cross-entropy over block positions 1..K-1; also per-position hits and counts."""
    tokens, features, anchors, anchor_ok, lengths = batch
    B, S = tokens.shape
    K = drafter.block_size
    hidden = drafter.block_hidden(features, tokens, anchors)[:, :, 1:]  # [B, M, K-1, h]
    logits = F.linear(hidden.flatten(0, 2), head_weight).float()  # [B*M*(K-1), V]: a 2-D matmul, not a slow bmm
    label_pos = anchors[:, :, None] + torch.arange(1, K)  # [B, M, K-1]
    label_ok = anchor_ok[:, :, None] & (label_pos < lengths[:, None, None])
    labels = tokens.gather(1, label_pos.clamp(max=S - 1).flatten(1)).view_as(label_pos)
    ce = F.cross_entropy(logits, labels.flatten(), reduction="none").view_as(labels)
    weights = label_ok * torch.exp(-torch.arange(K - 1) / gamma)
    loss = (ce * weights).sum() / weights.sum()
    hits = ((logits.argmax(-1).view_as(labels) == labels) & label_ok).flatten(0, 1).sum(0)  # [K-1]
    return loss, hits, label_ok.flatten(0, 1).sum(0)


def lr_at(step: int, steps: int, lr: float, warmup: float) -> float:
    """Linear warm-up, then cosine decay to 10% of lr."""
    w = max(1, int(warmup * steps))
    if step < w:
        return lr * (step + 1) / w
    progress = (step - w) / max(1, steps - w)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_dflash(
    drafter: DFlashDrafter,
    examples: list[Example],
    state_path: Path,
    steps: int,
    lr: float = 6e-4,
    warmup: float = 0.04,
    seqs_per_step: int = 4,
    anchors: int = 32,
    gamma: float = 4.0,
    grad_clip: float = 1.0,
    save_every: int = 100,
    log_every: int = 20,
    seed: int = 0,
) -> list[dict]:
    """Optimise the drafter in place; resumable from `state_path`. Returns the log records."""
    head = drafter.target.model.lm_head.weight.detach()
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    start, log = 0, []
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        drafter.load_state_dict(state["drafter"])
        optimizer.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        start, log = state["step"], state["log"]
    drafter.train()
    hits = torch.zeros(drafter.block_size - 1)
    counts = torch.zeros(drafter.block_size - 1)
    losses, t0 = [], time.time()
    bar = tqdm(range(start, steps), initial=start, total=steps, desc="train dflash", unit="step")
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        batch = sample_batch(examples, seqs_per_step, anchors, gen)
        loss, step_hits, step_counts = block_loss(drafter, head, batch, gamma)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
        losses.append(loss.item())
        hits += step_hits
        counts += step_counts
        if (step + 1) % log_every == 0 or step + 1 == steps:
            acc = (hits / counts.clamp(min=1)).tolist()
            record = {"step": step + 1, "loss": sum(losses) / len(losses), "lr": lr_at(step, steps, lr, warmup),
                      "acc": [round(a, 4) for a in acc], "s_per_step": (time.time() - t0) / len(losses)}
            log.append(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc1=f"{acc[0]:.3f}", acc4=f"{acc[min(3, len(acc) - 1)]:.3f}")
            hits.zero_(), counts.zero_()
            losses, t0 = [], time.time()
        if (step + 1) % save_every == 0 or step + 1 == steps:
            _save_state(state_path, {"drafter": drafter.state_dict(), "optimizer": optimizer.state_dict(),
                                     "generator": gen.get_state(), "step": step + 1, "log": log})
    drafter.eval()
    return log


def _save_state(path: Path, state: dict) -> None:
    """Write atomically: a kill mid-write leaves the previous state intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def write_log(path: Path, log: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in log))
