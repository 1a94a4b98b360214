"""Where a method's output first leaves AR's, and whether that is a near-tie of the target.

`lossless` is exact token equality with AR. In bfloat16 a verify forward of many tokens and an
AR forward of one run different kernels, whose rounding differs; where AR's two best logits are
within that rounding of each other either token is the target's greedy choice, and a long
generation meets such a near-tie with no bug at all. So each record whose output differs from
AR's keeps its first divergence (turn, position in the turn's output, AR's token and its own,
the logit gap between them under AR's context, and the gap a tie allows), and the summary's
`lossless_ties` holds where every divergence is a tie: a bug diverges at a clear winner, AR's.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from bastion.bench.datasets import Prompt, chat_tokens

ROUNDINGS = 4  # a tie: a gap within this many roundings of the logit's magnitude in the target's dtype


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first index where two outputs differ (one ending early counts), None when equal."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def tie_gap(dtype: torch.dtype, logit: float) -> float:
    """The largest logit gap that rounding in `dtype` explains at a logit of this size."""
    return ROUNDINGS * torch.finfo(dtype).eps * max(abs(logit), 1.0)


def divergence(target, prompt: Prompt, ar: dict, record: dict) -> dict | None:
    """`record`'s first divergence from the AR record `ar` of the same prompt, or None when
    their tokens are equal. Both hold `tokens` (every turn's output, concatenated),
    `turn_tokens` (each turn's count) and `text` (each turn's answer)."""
    at = first_difference(record["tokens"], ar["tokens"])
    if at is None:
        return None
    turn, start = 0, 0
    while turn + 1 < len(ar["turn_tokens"]) and at >= start + ar["turn_tokens"][turn]:
        start += ar["turn_tokens"][turn]
        turn += 1
    conversation = []
    for t in range(turn):
        conversation += [{"role": "user", "content": prompt.turns[t]}, {"role": "assistant", "content": ar["text"][t]}]
    conversation.append({"role": "user", "content": prompt.turns[turn]})
    context = chat_tokens(target, conversation) + ar["tokens"][start:at]
    theirs = ar["tokens"][at] if at < len(ar["tokens"]) else None
    ours = record["tokens"][at] if at < len(record["tokens"]) else None
    return {"turn": turn, "position": at - start, **gap_after(target, context, theirs, ours)}


def gap_after(target, context: list[int], theirs: int | None, ours: int | None) -> dict:
    """AR's token and ours (None: that output ended) after the tokens `context`, the target's
    logit gap between them there, and the gap a tie allows."""
    eager = replace(target, compiled=None)  # a graphed target's cache would grow the KV buffers its graphs replay over
    logits = eager.score(context, slice(-1, None))[0].float()
    gap = float(logits[theirs] - logits[ours]) if None not in (theirs, ours) else float("inf")
    return {"ar_token": theirs, "token": ours, "gap": gap, "tie_gap": tie_gap(target.dtype, float(logits.max()))}


def is_tie(found: dict | None) -> bool:
    """An output equal to AR's, or one that first left it at a near-tie: a gap within rounding,
    or a negative one, where the target's forward of AR's context itself ranks our token above
    AR's (two forwards of the same context disagree: rounding chose, not the method)."""
    return found is None or found["gap"] <= found["tie_gap"]
