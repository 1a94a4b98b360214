"""Train FlexDraft: attention tuning and the bonus-guided calibration MLP, target frozen.

Per step, a training sequence runs once through the frozen target (its clean KV cache, no
gradient); then groups of G mask tokens at random anchors inside the answer run through the
target's layers with the tuned attention in the last L, each group seeing the clean tokens
before its anchor and itself (a clean bonus in the first slot sees the clean tokens and itself
only). Mask j of a group predicts the token at anchor + j - 1; masks 2..G are the drafts,
scored with and without the calibration bias (so the drafter also works, and can be ablated,
without it), weighted exp(-(k-1)/gamma) by draft index k. With a clean bonus, decoding takes
its first draft from the target itself; mask 2 still learns it, as the state masks 3..G read.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from bastion.drafters.flexdraft import FlexDraftDrafter
from bastion.models.attention import Groups
from bastion.train.examples import Example, block_labels, fixed_batches, sample_anchors, walk_chains
from bastion.train.loop import train_loop


CHAIN_EXAMPLES = 6  # held-out answers walked for val_chain_aal: a group at every answer token through every target layer


def group_hidden(drafter: FlexDraftDrafter, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Final hidden states [B, M, G, h] of a mask group at each anchor [B, M] of tokens [B, S]:
    the clean tokens run once through the frozen target, without gradient, and each group sees
    the clean tokens before its anchor and itself."""
    target = drafter.target
    B, S = tokens.shape
    M, G = anchors.shape[1], drafter.group_size
    with torch.no_grad():  # the clean tokens' keys and values, once, without gradient
        cache = target.new_cache(B, S)
        write_pos, layout = cache.prepare(S)
        target.model(tokens, write_pos, layout, cache, write_pos)
    attn_mask = Groups(anchors, G, S, clean_first=drafter.bonus == "clean")
    positions = (anchors[:, :, None] + torch.arange(G, device=anchors.device)).view(B, M * G)
    x, is_mask = drafter.group_inputs(tokens.gather(1, anchors))  # [B, M, G, h]: the bonus is the anchor's token
    x, is_mask = x.flatten(1, 2), None if is_mask is None else is_mask.flatten(1, 2)

    def with_clean(i):
        return lambda k, v: (torch.cat([cache.k[i, :, :, :S], k], 2), torch.cat([cache.v[i, :, :, :S], v], 2))

    # With the mask embedding frozen nothing below the tuned layers is trained: no graph there
    below = range(0 if drafter.mask_embedding.requires_grad else drafter.first_tuned)
    if below:
        with torch.no_grad():
            x = drafter.run_layers(x, positions, attn_mask, is_mask, with_clean, below)
    above = range(below.stop, len(target.model.layers))
    return drafter.run_layers(x, positions, attn_mask, is_mask, with_clean, above).view(B, M, G, -1)


def group_loss(drafter: FlexDraftDrafter, batch, gamma: float, to_draft: torch.Tensor | None = None):
    """Weighted CE of the drafts (masks 2..G) with and without calibration, over the draft
    vocabulary when the drafter has one (`to_draft` maps target ids to draft ids, -1 outside
    it, and those labels carry no loss); per-position hits (calibrated) and counts."""
    _, tokens, anchors, anchor_ok, lengths = batch
    G = drafter.group_size
    hidden = group_hidden(drafter, tokens, anchors)  # [B, M, G, h]
    base = F.linear(hidden[:, :, 1:].flatten(0, 2), drafter.head_weight()).float()  # [B*M*(G-1), V']: a 2-D matmul
    calibrated = base + drafter.calibration(drafter.calibration_input(hidden, tokens.gather(1, anchors))).flatten(0, 2).float()
    _, labels, valid, scored = block_labels(tokens, anchors, anchor_ok, lengths, G - 1, to_draft)  # [B, M, G-1]
    labels = labels.flatten()
    weights = (scored * torch.exp(-torch.arange(G - 1, device=scored.device) / gamma)).flatten()
    loss = sum((F.cross_entropy(l, labels, reduction="none") * weights).sum() for l in (base, calibrated)) / weights.sum().clamp_min(1e-9)
    hits = ((calibrated.argmax(-1) == labels).view_as(valid) & scored).flatten(0, 1).sum(0)
    return loss, hits, valid.flatten(0, 1).sum(0)


@torch.no_grad()
def chain_aal(drafter: FlexDraftDrafter, examples: list[Example]) -> dict[str, float]:
    """Sequential chain decoding's acceptance length at temperature 0 on these sequences, without
    decoding (train/examples.py walk_chains): a group at every answer token. With the
    calibration MLP's drafts (val_chain_aal) and without it (val_chain_aal_plain, the ablation)."""
    def drafts(e: Example) -> list[torch.Tensor | None]:
        n, start = len(e.tokens), e.answer_start
        tokens = e.tokens.to(drafter.target.device)
        hidden = group_hidden(drafter, tokens[None], torch.arange(start, n - 1, device=tokens.device)[None])[0]  # [M, G, h]
        plain, calibrated = drafter.draft_logits(hidden, tokens[start : n - 1])  # [M, G-1, V] each; calibrated None when off
        return [None if calibrated is None else calibrated.argmax(-1), plain.argmax(-1)]

    walked = zip(("val_chain_aal", "val_chain_aal_plain"), walk_chains(examples, drafts))
    return {name: round(aal, 4) for name, aal in walked if aal is not None}


def train_flexdraft(drafter: FlexDraftDrafter, examples: list[Example], state_path: Path, steps: int, lr: float = 1e-3,
                    lr_tuned: float = 1e-4, seqs_per_step: int = 1, anchors: int = 32, gamma: float = 4.0,
                    mask_embedding: bool = True, val_examples: list[Example] = (), **loop) -> list[dict]:
    """Optimise the tuned attention (at lr_tuned, it starts as the target's own) and the
    calibration MLP and, where `mask_embedding`, the mask embedding (at lr). A frozen mask
    embedding spares the backward pass through every layer below the tuned ones."""
    drafter.mask_embedding.requires_grad_(mask_embedding)
    to_draft = drafter.to_draft_ids()  # built once, not per step
    groups = [{"params": list(drafter.tuned.parameters()), "lr": lr_tuned},
              {"params": [*([drafter.mask_embedding] if mask_embedding else []), *drafter.calibration.parameters()], "lr": lr}]
    return train_loop(
        drafter, groups,
        lambda gen: sample_anchors(examples, seqs_per_step, anchors, gen),
        lambda batch: group_loss(drafter, batch, gamma, to_draft),
        state_path, steps, desc="train flexdraft",
        val_batches=fixed_batches(lambda gen: sample_anchors(val_examples, seqs_per_step, anchors, gen)) if val_examples else None,
        val_metrics=(lambda: chain_aal(drafter, val_examples[:CHAIN_EXAMPLES])) if val_examples else None,
        **loop,
    )
