"""decode.compile=true: the target's forward captured by torch.compile (inductor on a CPU)
over bucketed shapes decodes exactly AR's tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bastion.budget.fixed import FixedBudget
from bastion.budget.latency import probe_times
from bastion.engine import generate
from bastion.models.dynamo import RECOMPILES
from bastion.models.target import KEY_BUCKET, compile_forward
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
    assert torch._dynamo.config.recompile_limit >= RECOMPILES  # past torch's 8 graphs a function would silently run eagerly
    # another batch with prompts of other lengths gets a cache of the same capacity (cache_slots): its steps at the
    # same batch size compile nothing (a capacity of its own made every bucket recompile)
    other = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4]
    expected = ar_outputs(tiny_qwen3, other, 10)
    again = generate(compiled, other, drafter=OracleDrafter(dict(zip(map(tuple, other), expected)), vocab=49152),
                     policy=best_first, budget=ObservingBudget(5), max_new_tokens=10)
    assert [g.tokens for g in again.generations] == expected
    assert not any(s.compiled for s in again.steps if len(s.rows) == 2)


def record_a_cuda_graph():
    """What inductor counts when it records a CUDA graph (a graphed forward's shape, on its call
    after the one that compiled it), with no GPU to record one."""
    from torch._dynamo.utils import counters

    counters["inductor"]["cudagraph_recorded_non_static_inputs"] += 3


@pytest.mark.parametrize("event", ["compile", "record"])
def test_a_step_during_which_anything_compiles_is_left_out_of_the_budget(tiny_qwen3, event):
    """Not only the target's captured forward: a graph torch.compile builds for anything during a
    step (FlexAttention's kernels on their first shapes, a drafter's), or a CUDA graph it records,
    makes the step's times a compiler's."""
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6]]
    expected = ar_outputs(tiny_qwen3, prompts, 16)
    oracle = OracleDrafter(dict(zip(map(tuple, prompts), expected)), vocab=49152)
    first_use = torch.compile(lambda x: x + 1, backend="eager")
    propose, calls = oracle.propose, []

    def compiling_on_the_third_step(ctx):
        calls.append(ctx)
        if len(calls) == 3:
            first_use(torch.ones(3)) if event == "compile" else record_a_cuda_graph()
        return propose(ctx)

    oracle.propose = compiling_on_the_third_step
    budget = ObservingBudget(2)
    decoding = generate(tiny_qwen3, prompts, drafter=oracle, policy=best_first, budget=budget, max_new_tokens=16)
    assert [g.tokens for g in decoding.generations] == expected
    assert [s.compiled for s in decoding.steps] == [i == 2 for i in range(len(decoding.steps))]
    assert budget.seen == [s for i, s in enumerate(decoding.steps) if i != 2]


def flex_tree_forward():
    """A tiny target with FlexAttention and the arguments of its model's forward over a tree."""
    from tests.conftest import load_target, target_config

    target = load_target(**target_config("tiny_qwen3", dtype="float32", attention="flex"))
    cache = target.new_cache(2, 64)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool).repeat(2, 1, 1)
    write_pos, layout = cache.prepare(4, tree)
    positions = layout.prefix[:, None] + torch.tensor([0, 1, 1, 2])
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    return target, (tokens, positions, layout, cache, write_pos, ())


def test_a_compiled_forward_with_flex_attention_is_one_graph():
    """decode.compile with FlexAttention (the CUDA default): the layout arrives with its block mask,
    so nothing inside the forward splits the graph (building it lazily there did, at every layer)."""
    target, args = flex_tree_forward()
    with torch.no_grad():  # FlexAttention has no backward on a CPU
        explained = torch._dynamo.explain(target.model)(*args)
    assert explained.graph_break_count == 0, [b.reason.splitlines()[0] for b in explained.break_reasons]


def test_a_compiled_forward_with_flex_attention_does_not_guard_on_dynamos_config():
    """Traced inside a compiled forward, compiling flex leaves dynamo's recompile limit alone
    (compile_forward raised it): a guard on it would compile every graph again whenever the
    limit changes."""
    from torch._dynamo.utils import counters

    from bastion.models.attention import _flex

    target, args = flex_tree_forward()
    _flex.cache_clear()  # so that the traced forward compiles flex itself
    forward = torch.compile(target.model, backend="eager")
    with torch.no_grad():
        forward(*args)
        graphs = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(recompile_limit=RECOMPILES + 1):
            forward(*args)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_compiled_prefill_attends_causally_without_a_mask(tiny_qwen3):
    """A prompt's first chunk keeps plain causal attention under decode.compile (flash on a GPU):
    its keys bucketed like a decode step's would need a mask, which on CUDA runs SDPA's math
    backend and its [B, H, n, S] float32 scores (77 GB for 16 prompts of 4096 tokens on an 8B target)."""
    cache = tiny_qwen3.new_cache(2, 64)
    _, layout = cache.prepare(8, key_bucket=KEY_BUCKET)
    assert layout.causal_only and layout.n_keys == 8
    cache.commit([list(range(8))] * 2)
    _, layout = cache.prepare(4, key_bucket=KEY_BUCKET)  # after it, keys are bucketed (within capacity)
    assert not layout.causal_only and layout.n_keys == 64


@pytest.mark.slow
def test_a_graphed_target_decodes_over_the_same_kv_buffers(tiny_qwen3, monkeypatch):
    """decode.compile on CUDA replays CUDA graphs, which read and write the KV cache at the
    addresses they were recorded with: every cache of a graphed target is a view of the same
    buffers marked static, and keeps its address as finished rows leave; and a second decode
    at the same shapes compiles nothing (no guard on the views' identity). A CPU runs the same
    torch.compile mode, buffers and marks, without the graphs themselves."""
    prompts = [[5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10, 11], [20, 21, 22]]
    stop = ar_outputs(tiny_qwen3, prompts, 12)[1][3]  # a token row 1 stops at: rows finish at different steps
    target = replace(tiny_qwen3, eos_ids=frozenset({stop}))
    expected = ar_outputs(target, prompts, 12)
    assert len({len(tokens) for tokens in expected}) > 1, "every row stopped at the same step: no row left the batch"
    graphed = compile_forward(target, graphs=True)
    assert graphed.execution == "graphed" and graphed.padded(3) == 4
    new_cache, views = graphed.new_cache, []  # views: each cache's buffers after rows left, while some remain

    def recording(batch, capacity):
        cache = new_cache(batch, capacity)
        keep_rows = cache.keep_rows

        def keeping(rows):
            keep_rows(rows)
            if rows:
                views.append((cache.k, cache.v))

        cache.keep_rows = keeping
        return cache

    monkeypatch.setattr(graphed, "new_cache", recording)
    oracle = OracleDrafter(dict(zip(map(tuple, prompts), expected)), vocab=49152)
    for drafter in (None, oracle, oracle):
        decoding = generate(graphed, prompts, drafter=drafter, policy=best_first, budget=FixedBudget(5), max_new_tokens=12)
        assert [g.tokens for g in decoding.generations] == expected
    assert not any(step.compiled for step in decoding.steps)  # the third decode: every shape met before
    keys, values = graphed.compiled.buffers
    assert len(views) >= 3  # in every decode
    for k, v in views:
        assert (k.data_ptr(), v.data_ptr()) == (keys.data_ptr(), values.data_ptr()) and k.shape[1] < len(prompts)
        assert k._dynamo_static_input_type == v._dynamo_static_input_type == "unguarded"  # torch._dynamo.mark_static_address
    forwards, forward = [], graphed.forward
    monkeypatch.setattr(graphed, "forward", lambda *args: forwards.append(args) or forward(*args))
    assert len(probe_times(graphed, [3], context=8, repeats=1)[0]) == 1 and len(forwards) == 3  # compiles, records, then timed
    graphed.compiled.kv_buffers((*keys.shape[:3], keys.shape[3] + 1, keys.shape[4]), keys.dtype, keys.device)
    assert graphed.compiled.buffers[0].shape[3] == keys.shape[3] + 1  # a longer cache grows them


@pytest.mark.slow
def test_a_graphed_target_runs_a_bucket_of_rows_as_rows_leave(tiny_qwen3, monkeypatch):
    """A graphed target pads a step's rows to a power of two (at most the rows its buffers hold),
    so that rows leaving a decode one by one run few batch sizes, each compiled once: five rows
    run as 5, 4, 2 and 1, never 3, and the padding rows change no row's tokens."""
    prompts = [[5 + i, 6, 7 + 2 * i, 5, 6 + i][: 3 + i % 3] for i in range(5)]
    free = ar_outputs(tiny_qwen3, prompts, 12)

    def decoding_rows(stop: int) -> set[int]:  # rows still decoding at each step, were `stop` an end of turn
        ends = [tokens.index(stop) + 1 if stop in tokens else 12 for tokens in free]
        return {sum(end > step for end in ends) for step in range(12)}

    stop = next((t for tokens in free for t in tokens if 3 in decoding_rows(t)), None)
    assert stop is not None, "no token leaves three rows decoding at some step"
    target = replace(tiny_qwen3, eos_ids=frozenset({stop}))
    expected = ar_outputs(target, prompts, 12)
    graphed = compile_forward(target, graphs=True)
    batches, forward = [], graphed.compiled.forward
    monkeypatch.setattr(graphed.compiled, "forward", lambda tokens, *args: batches.append(len(tokens)) or forward(tokens, *args))
    assert ar_outputs(graphed, prompts, 12) == expected
    assert 3 not in batches and set(batches) <= {5, 4, 2, 1}, batches
