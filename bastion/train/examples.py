"""Training examples from self-distillation data, and random anchors inside their answers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bastion.tree.proposal import matched_prefix


@dataclass
class Example:
    tokens: torch.Tensor  # [S] prompt + answer
    features: torch.Tensor | None  # [S - 1, F] fp16 target features of all but the last token (None: not read)
    answer_start: int
    top_ids: torch.Tensor | None = None  # [S - answer_start, k] int32 the target's likeliest tokens at each answer token
    top_logprobs: torch.Tensor | None = None  # [S - answer_start, k] fp16 and their log-probs


def to_examples(dataset, features: bool = True) -> list[Example]:
    """Rows with at least one anchor that can predict something, held in memory in their stored
    dtypes: `datasets` reads float16 columns back as float32 (and int32 as int64), which for
    6400 prompts' features is many GB more, so each row is cast back as it is read. Without
    `features` (a drafter that reads the target itself: FlexDraft) that column, most of the
    data, is not read (experiments/NOTES.md)."""
    if not features:
        dataset = dataset.remove_columns("features")
    examples = []
    for row in dataset.with_format("torch"):
        tokens, start = row["input_ids"].long(), int(row["answer_start"])
        if len(tokens) - 2 >= start:
            top_ids, top_logprobs = row.get("top_ids"), row.get("top_logprobs")
            examples.append(Example(tokens, row["features"].half() if features else None, start, None if top_ids is None else top_ids.int(),
                                    None if top_logprobs is None else top_logprobs.half()))
    if not examples:
        raise ValueError("The self-distillation data holds no answer long enough to train on.")
    return examples


def sample_padded(examples: list[Example], n_seqs: int, gen: torch.Generator):
    """n_seqs random examples and their tokens, right-padded: (picks, tokens [B, S], lengths [B])."""
    picks = [examples[i] for i in torch.randint(len(examples), (n_seqs,), generator=gen).tolist()]
    tokens = torch.zeros(n_seqs, max(len(e.tokens) for e in picks), dtype=torch.long)
    for b, e in enumerate(picks):
        tokens[b, : len(e.tokens)] = e.tokens
    return picks, tokens, torch.tensor([len(e.tokens) for e in picks])


def padded_features(picks: list[Example], length: int, columns: torch.Tensor | slice = slice(None)) -> torch.Tensor:
    """The picked examples' recorded target features (`columns` of them), float32 and
    right-padded to `length` positions: [B, length, F]."""
    features = torch.zeros(len(picks), length, picks[0].features[:, columns].shape[1])
    for b, e in enumerate(picks):
        features[b, : len(e.tokens) - 1] = e.features[:, columns].float()
    return features


def sample_anchors(examples: list[Example], n_seqs: int, n_anchors: int, gen: torch.Generator):
    """sample_padded, and up to n_anchors anchors inside each answer (each with at least one
    token after it). Returns the picked examples, tokens [B, S], anchors [B, M], anchor_ok
    [B, M] and lengths [B]."""
    picks, tokens, lengths = sample_padded(examples, n_seqs, gen)
    anchors = torch.zeros(n_seqs, n_anchors, dtype=torch.long)
    anchor_ok = torch.zeros(n_seqs, n_anchors, dtype=torch.bool)
    for b, e in enumerate(picks):
        candidates = torch.arange(e.answer_start, len(e.tokens) - 1)
        chosen = candidates[torch.randperm(len(candidates), generator=gen)[:n_anchors]].sort().values
        anchors[b, : len(chosen)] = chosen
        anchors[b, len(chosen) :] = e.answer_start
        anchor_ok[b, : len(chosen)] = True
    return picks, tokens, anchors, anchor_ok, lengths


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, anchor_ok: torch.Tensor, lengths: torch.Tensor, n: int,
                 to_draft: torch.Tensor | None = None):
    """What the n drafts of a block rooted at each anchor [B, M] of tokens [B, S] should be.
    Returns their positions [B, M, n] (clamped inside the sequence), labels [B, M, n] (target
    ids, or draft ids where `to_draft` maps target ids into a draft vocabulary; a token outside
    it is returned as 0 and left out of `scored`), `valid` [B, M, n] (a real anchor, a position inside the sequence:
    what counts towards accuracy) and `scored` (valid and draftable: what carries loss)."""
    label_pos = anchors[:, :, None] + torch.arange(1, n + 1, device=anchors.device)  # [B, M, n]
    valid = anchor_ok[:, :, None] & (label_pos < lengths[:, None, None])
    label_pos = label_pos.clamp(max=tokens.shape[1] - 1)
    labels = tokens.gather(1, label_pos.flatten(1)).view_as(label_pos)
    if to_draft is not None:
        labels = to_draft[labels]
    scored = valid & (labels >= 0)
    return label_pos, labels.clamp(min=0), valid, scored


def split_examples(examples: list[Example], val_fraction: float) -> tuple[list[Example], list[Example]]:
    """Every round(1 / val_fraction)-th example held out for validation (none when 0)."""
    if not val_fraction:
        return examples, []
    every = max(2, round(1 / val_fraction))
    return [e for i, e in enumerate(examples) if i % every], examples[::every]


def fixed_batches(sample, n: int = 8, seed: int = 1234) -> list:
    """n batches drawn once with a fixed seed: the same validation data at every evaluation."""
    gen = torch.Generator().manual_seed(seed)
    return [sample(gen) for _ in range(n)]


def walk_chains(examples: list[Example], drafts) -> list[float | None]:
    """Chain decoding's acceptance length at temperature 0 on these sequences, without decoding.

    The sequences are the target's own greedy answers, so chain decoding would reproduce them,
    and its steps are known once the drafter's top-1 block at every answer position is:
    `drafts(example)` gives those blocks, [M, K] for the M answer positions with a successor,
    once per drafting variant (None for a variant the drafter lacks), from one training-style
    forward; each step's block is rooted where the last one's acceptance stopped. The training
    loss's random anchors overstate this: a block rooted just after a rejected draft is harder
    than one rooted anywhere (experiments/NOTES.md). One AAL per variant (None where absent)."""
    walked = None
    for e in examples:
        blocks = drafts(e)
        walked = walked or [[0, 0] for _ in blocks]
        for counts, block in zip(walked, blocks):
            if block is not None:
                steps, produced = chain_walk(block.cpu(), e.tokens, e.answer_start)
                counts[0], counts[1] = counts[0] + steps, counts[1] + produced
    return [produced / steps if steps else None for steps, produced in walked or []]


def chain_walk(drafts: torch.Tensor, tokens: torch.Tensor, start: int) -> tuple[int, int]:
    """Chain decoding over one example: drafts [M, K] holds the drafter's top-1 block rooted at
    each answer position start..start+M-1. Returns (steps, tokens produced)."""
    steps = produced = 0
    at = start
    while at < len(tokens) - 1:
        hits = matched_prefix(drafts[at - start], tokens[at + 1 : at + 1 + drafts.shape[1]])
        steps, produced, at = steps + 1, produced + hits + 1, at + hits + 1
    return steps, produced
