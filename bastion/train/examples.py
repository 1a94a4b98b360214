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


def sample_anchors(examples: list[Example], n_seqs: int, n_anchors: int, gen: torch.Generator):
    """Pad n_seqs random examples and pick up to n_anchors anchors inside each answer (each
    with at least one token after it). Returns the picked examples, tokens [B, S], anchors
    [B, M], anchor_ok [B, M] and lengths [B]."""
    picks = [examples[i] for i in torch.randint(len(examples), (n_seqs,), generator=gen).tolist()]
    S = max(len(e.tokens) for e in picks)
    tokens = torch.zeros(n_seqs, S, dtype=torch.long)
    anchors = torch.zeros(n_seqs, n_anchors, dtype=torch.long)
    anchor_ok = torch.zeros(n_seqs, n_anchors, dtype=torch.bool)
    for b, e in enumerate(picks):
        n = len(e.tokens)
        tokens[b, :n] = e.tokens
        candidates = torch.arange(e.answer_start, n - 1)
        chosen = candidates[torch.randperm(len(candidates), generator=gen)[:n_anchors]].sort().values
        anchors[b, : len(chosen)] = chosen
        anchors[b, len(chosen) :] = e.answer_start
        anchor_ok[b, : len(chosen)] = True
    return picks, tokens, anchors, anchor_ok, torch.tensor([len(e.tokens) for e in picks])


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


def chain_walk(drafts: torch.Tensor, tokens: torch.Tensor, start: int) -> tuple[int, int]:
    """Chain decoding at temperature 0 over one example, whose answer is the target's own greedy
    output, so decoding would reproduce it: drafts [M, K] holds the drafter's top-1 block rooted
    at each answer position start..start+M-1, and each step's block is rooted where the last
    one's acceptance stopped. Returns (steps, tokens produced)."""
    steps = produced = 0
    at = start
    while at < len(tokens) - 1:
        hits = matched_prefix(drafts[at - start], tokens[at + 1 : at + 1 + drafts.shape[1]])
        steps, produced, at = steps + 1, produced + hits + 1, at + hits + 1
    return steps, produced
