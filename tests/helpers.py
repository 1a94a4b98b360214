"""Test-only drafters and checks."""

from __future__ import annotations

import copy
import math
import random
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

from bastion.compose import build
from bastion.drafters.base import DraftContext, Drafter
from bastion.engine import generate
from bastion.tree.proposal import BlockProposal
from tests.conftest import ROOT


class OracleDrafter(Drafter):
    """Knows each prompt's AR continuation and hides it among decoys: at each position the
    true token sits at a random rank, or is missing with probability `miss`. Trees then accept
    deep paths through non-first ranks and reject elsewhere, which exercises masks, positions
    and non-contiguous KV commits far more than a real drafter on a random model would."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab: int, block_size=6, top_k=3, miss=0.25, seed=0):
        self.continuations, self.vocab = continuations, vocab
        self.block_size, self.top_k, self.miss = block_size, top_k, miss
        self.rng = random.Random(seed)

    def _truth(self, seq: list[int]) -> list[int]:
        for prompt, cont in self.continuations.items():
            n = len(prompt)
            if tuple(seq[:n]) == prompt and seq[n:] == cont[: len(seq) - n]:
                return cont[len(seq) - n :]
        return []

    def propose(self, ctx: DraftContext) -> BlockProposal:
        B, K, k = len(ctx.sequences), self.block_size, self.top_k
        tokens = torch.zeros(B, K, k, dtype=torch.long)
        logprobs = torch.zeros(B, K, k)
        for b, seq in enumerate(ctx.sequences):
            truth = self._truth(seq)
            for pos in range(K):
                cands = self.rng.sample(range(self.vocab), k)
                if pos < len(truth) and self.rng.random() > self.miss:
                    true = truth[pos]
                    cands = [c for c in cands if c != true][: k - 1]
                    cands.insert(self.rng.randrange(k), true)
                tokens[b, pos] = torch.tensor(cands)
                weights = sorted((self.rng.random() for _ in range(k)), reverse=True)
                logprobs[b, pos] = torch.tensor([math.log(w / sum(weights)) for w in weights])
        return BlockProposal([s[-1] for s in ctx.sequences], tokens, logprobs)


def ar_outputs(target, prompts, max_new_tokens) -> list[list[int]]:
    return [g.tokens for g in generate(target, prompts, max_new_tokens=max_new_tokens).generations]


def assert_same_tokens(target, prompt, expected: list[int], got: list[int], label: str) -> None:
    if expected == got:
        return
    at = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    top2 = target.score(prompt + expected[:at])[-1].topk(2).values
    gap = float(top2[0] - top2[1])
    raise AssertionError(f"{label}: output differs from AR at token {at} (AR logit gap top1-top2 there: {gap:.3g})")


def configured(group: str, conf_dir: Path = ROOT / "conf") -> list[str]:
    """The choices of a config group that build something (drafter=none does not): the
    lossless tests run every one, so a new tree policy or drafter is tested by adding its file
    and its yaml, with no test to edit."""
    return [p.stem for p in sorted((conf_dir / group).glob("*.yaml")) if "_target_" in OmegaConf.load(p)]


def build_choice(group: str, name: str, conf_dir: Path = ROOT / "conf", **kwargs):
    """The object a config group's choice builds, as run.py builds it (`kwargs`: its live inputs)."""
    return build(OmegaConf.load(conf_dir / group / f"{name}.yaml"), **kwargs)


def assert_trains_like_linear(kind: type[nn.Linear]) -> None:
    """A linear layer of another kernel (`kind`, wrapping an nn.Linear) runs the plain one when
    autograd is on: gradients are nn.Linear's exactly."""
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    other = kind(copy.deepcopy(linear))
    x = torch.randn(4, 16, requires_grad=True)
    linear(x).square().sum().backward()
    grad_x = x.grad.clone()
    x.grad = None
    other(x).square().sum().backward()
    assert torch.equal(x.grad, grad_x) and torch.equal(other.weight.grad, linear.weight.grad)
