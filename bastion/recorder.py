"""What decoding records beside its tokens: the training data of drafters.

The engine hands a Recorder what the target computed after prefill and after every step. The
base class records nothing (every benchmark run); FeatureRecorder keeps, per prompt, the
target's outputs at chosen layers for every committed token (what feature-conditioned drafters
learn from) and, for AR decoding, the target's k likeliest tokens and their log-probs at every
new token (their soft labels).
"""

from __future__ import annotations

from collections import defaultdict

import torch


class Recorder:
    layers: tuple[int, ...] = ()  # target layers whose outputs the forwards must capture for it
    top_k: int = 0  # the likeliest next tokens to keep per new token (AR decoding only)

    def record(self, prompts: list[int], committed: list[int], features: torch.Tensor | None, logits: torch.Tensor | None) -> None:
        """One forward's results for the rows decoding `prompts` (indices): the `layers`
        features [B, W, F] of each row's `committed` tokens (right-padded; None without layers)
        and, for a recorder with top_k, the logits [B, V] of each row's next token (else None)."""

    def finish(self, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        """Decoding ended with these outputs: keep what belongs to them."""


class FeatureRecorder(Recorder):
    """Per prompt: `features[i]` [prompt + new - 1, F] (CPU, fp16), the target's outputs at
    `layers` for every token whose KV was committed; with `top_k`, `top_ids[i]` (int32) and
    `top_logprobs[i]` (fp16) [new, k] at every new token."""

    def __init__(self, layers: tuple[int, ...] = (), top_k: int = 0):
        self.layers, self.top_k = tuple(layers), top_k
        self._features, self._top = defaultdict(list), defaultdict(list)  # per prompt: recorded parts in order
        self.features: list[torch.Tensor] = []
        self.top_ids: list[torch.Tensor] = []
        self.top_logprobs: list[torch.Tensor] = []

    def record(self, prompts, committed, features, logits) -> None:
        if self.layers:
            for row, (i, n) in enumerate(zip(prompts, committed)):
                self._features[i].append(features[row, :n].to("cpu", torch.float16))
        if self.top_k:
            logprobs, ids = torch.log_softmax(logits.float(), -1).topk(self.top_k, -1)
            ids, logprobs = ids.to("cpu", torch.int32), logprobs.to("cpu", torch.float16)
            for row, i in enumerate(prompts):
                self._top[i].append((ids[row : row + 1], logprobs[row : row + 1]))

    def finish(self, prompts, outputs) -> None:
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            if self.layers:
                self.features.append(torch.cat(self._features.pop(i))[: len(prompt) + len(output) - 1])
            if self.top_k:
                ids, logprobs = (torch.cat(part)[: len(output)] for part in zip(*self._top.pop(i)))
                self.top_ids.append(ids)
                self.top_logprobs.append(logprobs)
