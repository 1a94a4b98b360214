"""decode.compile=true: the target's forward captured by torch.compile (inductor on a CPU)
over bucketed shapes decodes exactly AR's tokens."""

from __future__ import annotations

import pytest

from bastion.budget.fixed import FixedBudget
from bastion.budget.latency import probe_times
from bastion.engine import generate
from bastion.models.target import compile_forward
from bastion.tree.best_first import best_first
from tests.helpers import OracleDrafter, ar_outputs


class ObservingBudget(FixedBudget):
    def __init__(self, nodes: int):
        super().__init__(nodes)
        self.seen = []

    def observe(self, step, contexts, width):
        self.seen.append(step)
        super().observe(step, contexts, width)


@pytest.mark.slow
def test_compiled_decoding_gives_ar_tokens(tiny_qwen3):
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10, 11, 12]]  # one prefill shape
    expected = ar_outputs(tiny_qwen3, prompts, 10)
    compiled = compile_forward(tiny_qwen3)
    assert ar_outputs(compiled, prompts, 10) == expected
    budget = ObservingBudget(5)
    decoding = generate(compiled, prompts, drafter=OracleDrafter(dict(zip(map(tuple, prompts), expected)), vocab=49152), policy=best_first, budget=budget, max_new_tokens=10)
    assert [g.tokens for g in decoding.generations] == expected
    # the steps whose forward compiled (the first of each shape) are left out of what the budget learns from
    assert decoding.steps[0].compiled and not all(s.compiled for s in decoding.steps)
    assert budget.seen == [s for s in decoding.steps if not s.compiled]
    assert any(n > 1 for s in decoding.steps for n in s.produced), "no draft was accepted: the trees were not exercised"
    assert len(probe_times(compiled, [3], context=8, repeats=1)[0]) == 1  # the probe sizes its cache for the bucket of 3
