"""Temperature 0: every policy x budget x drafter reproduces AR decoding token for token."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from bastion.bench.datasets import chat_tokens, load_prompts
from bastion.budget.fixed import FixedBudget
from bastion.compose import build
from bastion.drafters.ngram import NgramDrafter
from bastion.engine import _chunk_ends, generate
from bastion.models.packed_linear import prepack_linears
from bastion.models.target import load_target
from bastion.recorder import FeatureRecorder
from bastion.sampling import Sampling
from bastion.tree.best_first import best_first
from bastion.tree.chain import chain
from tests.conftest import ROOT, target_config
from tests.helpers import (
    OracleDrafter,
    ar_outputs,
    assert_same_tokens,
    build_choice,
    configured,
)

POLICIES = {name: build_choice("tree", name) for name in configured("tree")}  # every conf/tree/*.yaml
BUDGETS = (1, 2, 8, 64)
VOCAB = 2048  # the sampled tests' tiny models


def random_prompts(n=8, seed=0, vocab=49152):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def with_eos_mid_output(target, prompts, max_new):
    """Make a token that AR emits mid-answer the EOS, so some rows stop on EOS, others on length."""
    outputs = ar_outputs(target, prompts, max_new)
    eos = outputs[0][max_new // 2]
    target = dataclasses.replace(target, eos_ids=frozenset({eos}))
    outputs = ar_outputs(target, prompts, max_new)
    finishes = {("eos" if out[-1] == eos else "length") for out in outputs}
    assert finishes == {"eos", "length"}, "the test needs rows that stop on EOS and rows that stop on length"
    return target, outputs


def check(target, prompts, expected, drafter, policy, budget, max_new, label):
    decoding = generate(target, prompts, drafter=drafter, policy=POLICIES[policy], budget=FixedBudget(budget), max_new_tokens=max_new)
    for prompt, exp, gen in zip(prompts, expected, decoding.generations):
        assert_same_tokens(target, prompt, exp, gen.tokens, f"{label} {policy} budget={budget}")
    return decoding


@pytest.mark.parametrize("name", ["tiny_qwen3", "tiny_llama"])
def test_tiny_models_lossless(name, request):
    max_new = 24
    prompts = random_prompts()
    target, expected = with_eos_mid_output(request.getfixturevalue(name), prompts, max_new)
    oracle = OracleDrafter(dict(zip(map(tuple, prompts), expected)), vocab=49152, top_k=4)
    accepted_deep = False
    for policy in POLICIES:
        for budget in BUDGETS:
            d = check(target, prompts, expected, oracle, policy, budget, max_new, f"{name} oracle")
            accepted_deep |= max(max(s.produced) for s in d.steps) >= 4
            check(target, prompts, expected, NgramDrafter(drafts=6), policy, budget, max_new, f"{name} ngram")
    assert accepted_deep, "the oracle drafter should get multi-token acceptances"


def test_tiny_model_lossless_one_prompt_at_a_time(tiny_qwen3):
    prompts = random_prompts(4, seed=1)
    expected = ar_outputs(tiny_qwen3, prompts, 16)
    oracle = OracleDrafter(dict(zip(map(tuple, prompts), expected)), vocab=49152, seed=3)
    for prompt, exp in zip(prompts, expected):
        check(tiny_qwen3, [prompt], [exp], oracle, "best_first", 8, 16, "batch=1")


def test_batched_ar_equals_each_prompt_alone(tiny_qwen3):
    """Prompts of very different lengths, in no order (several prefill chunks; rows leaving the
    batch at different steps) decode exactly as they do alone, recorded features included."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (90, 4, 33, 5, 120, 31, 6)]
    assert len(_chunk_ends(sorted(map(len, prompts)), 1.25)) >= 3
    target, expected = with_eos_mid_output(tiny_qwen3, prompts, 20)
    recorder = FeatureRecorder((0, 1))
    batched = generate(target, prompts, max_new_tokens=20, recorder=recorder).generations
    for prompt, exp, gen, features in zip(prompts, expected, batched, recorder.features):
        alone = FeatureRecorder((0, 1))
        assert gen.tokens == exp == generate(target, [prompt], max_new_tokens=20, recorder=alone).generations[0].tokens
        torch.testing.assert_close(features, alone.features[0], rtol=0, atol=0)


def test_recorded_top_tokens_are_the_targets_own_distribution(tiny_qwen3):
    """Top-k recording in a batch (rows leaving at different steps) gives each new token the
    target's k likeliest tokens and log-probs, as scoring the finished sequence alone does."""
    prompts = random_prompts(4, seed=2)
    target, expected = with_eos_mid_output(tiny_qwen3, prompts, 12)
    recorder = FeatureRecorder(top_k=3)
    generations = generate(target, prompts, max_new_tokens=12, recorder=recorder).generations
    for prompt, exp, gen, top_ids, top_logprobs in zip(prompts, expected, generations, recorder.top_ids, recorder.top_logprobs):
        assert gen.tokens == exp and top_ids.shape == top_logprobs.shape == (len(exp), 3)
        logprobs, ids = torch.log_softmax(target.score(prompt + exp)[len(prompt) - 1 : -1], -1).topk(3, -1)
        assert top_ids.tolist() == ids.tolist() and top_ids[:, 0].tolist() == exp
        torch.testing.assert_close(top_logprobs.float(), logprobs.float(), atol=2e-3, rtol=2e-3)  # stored in fp16
    with pytest.raises(ValueError, match="Top-k recording records AR decoding"):
        generate(target, prompts[:1], drafter=OracleDrafter({}, vocab=49152), policy=chain, budget=FixedBudget(2),
                 recorder=FeatureRecorder(top_k=3))


def test_prefill_chunks_keep_padding_within_the_slack():
    assert _chunk_ends([10, 10, 11, 40, 41, 100], 1.25) == [3, 5, 6]
    assert _chunk_ends([7], 1.25) == [1]
    assert _chunk_ends([5, 50], 100.0) == [2]


SMOL_QUESTIONS = ["What is 2+3?", "Say hello.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def smol_case(smollm2_packed):
    """8 chat prompts and SmolLM2's AR answers (32 tokens; packed weights, as run.py decodes on
    CPU): some stop on EOS, some on length."""
    max_new = 32
    texts = SMOL_QUESTIONS + [p.turns[0] for p in load_prompts("gsm8k", limit=3)] + [p.turns[0] for p in load_prompts("mt_bench", limit=2)]
    prompts = [chat_tokens(smollm2_packed, [{"role": "user", "content": t}]) for t in texts]
    expected = ar_outputs(smollm2_packed, prompts, max_new)
    finishes = {("eos" if out[-1] in smollm2_packed.eos_ids else "length") for out in expected}
    assert finishes == {"eos", "length"}
    return prompts, expected, max_new


@pytest.mark.slow
def test_smollm2_lossless(smollm2_packed, smol_case):
    prompts, expected, max_new = smol_case
    oracle = OracleDrafter(dict(zip(map(tuple, prompts), expected)), vocab=49152, block_size=8, top_k=4)
    for policy in POLICIES:
        for budget in (2, 64):  # the smallest tree with a branch point and a large one; the tiny models run all BUDGETS
            check(smollm2_packed, prompts, expected, oracle, policy, budget, max_new, "smollm2 oracle")
    check(smollm2_packed, prompts, expected, NgramDrafter(), "best_first", 8, max_new, "smollm2 ngram")


@pytest.mark.slow
@pytest.mark.parametrize("kind", configured("drafter"))
def test_smollm2_lossless_with_every_configured_drafter(smollm2_packed, smol_case, kind):
    """Every conf/drafter/*.yaml as run.py builds it for SmolLM2 (the trained ones are the
    drafters committed under checkpoints/, what the demo uses)."""
    from tests.test_errors import composed

    prompts, expected, max_new = smol_case
    drafter = prepack_linears(build(composed("target=smollm2_135m", f"drafter={kind}").drafter, target=smollm2_packed))
    for policy, budget in [("chain", 8), ("best_first", 1), ("best_first", 64)]:
        check(smollm2_packed, prompts, expected, drafter, policy, budget, max_new, f"smollm2 {kind}")


def test_a_new_policy_is_tested_by_adding_its_yaml(tmp_path, tiny_qwen3):
    """A throwaway policy (a new file's function and a yaml naming it) joins the lossless
    tests' policies with no test edited, and decodes losslessly."""
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "chain.yaml").write_text((ROOT / "conf" / "tree" / "chain.yaml").read_text())
    (tmp_path / "tree" / "top2_chain.yaml").write_text(
        "name: top2_chain\n_target_: tests.test_lossless.second_ranked_chain\n_partial_: true\n")
    assert configured("tree", tmp_path) == ["chain", "top2_chain"]
    policy = build_choice("tree", "top2_chain", tmp_path)
    prompts = random_prompts(3, seed=2)
    expected = ar_outputs(tiny_qwen3, prompts, 12)
    oracle = OracleDrafter(dict(zip(map(tuple, prompts), expected)), vocab=49152, top_k=2)
    d = generate(tiny_qwen3, prompts, drafter=oracle, policy=policy, budget=FixedBudget(4), max_new_tokens=12)
    assert [g.tokens for g in d.generations] == expected


def second_ranked_chain(proposal, max_nodes):
    """The throwaway policy: a chain of each position's second candidate."""
    flipped = dataclasses.replace(proposal, tokens=proposal.tokens.flip(-1), logprobs=proposal.logprobs.flip(-1))
    return chain(flipped, max_nodes)


def on_exact_hardware(budget):
    """Feed the controller its own verify-time forecasts as measurements, with free drafting
    and overheads: its choices then follow the drafts alone, not how busy the test machine is
    (measured timings made a loaded CI machine size every tree alike)."""
    observe = budget.observe

    def exact(step, contexts, width):
        verify_s = float(budget.latency.predict(np.full((1, len(contexts)), width), np.asarray(contexts)[None, :])[0])
        observe(dataclasses.replace(step, draft_s=0.0, verify_s=verify_s, other_s=0.0), contexts, width)

    budget.observe = exact
    return budget


@pytest.mark.parametrize("policy", ["chain", "best_first", "static"])
def test_batched_bastion_budget_lossless(tiny_qwen3, policy, tmp_path):
    """One budget over the whole batch (rows get different tree sizes), rows of different
    lengths, EOS in some rows only."""
    from bastion.budget.controller import BastionBudget
    from bastion.budget.hardware import HardwareProfile

    prompts = random_prompts(8, seed=11)
    target, expected = with_eos_mid_output(tiny_qwen3, prompts, 24)
    oracle = OracleDrafter(dict(zip(map(tuple, prompts), expected)), vocab=49152, block_size=6, top_k=4)
    # The oracle's decoys make its beliefs a poor guide; scaled down by measured acceptance
    # they would size most trees at zero, and its realised throughput would turn drafting off
    # for stretches: this test is about trees of different sizes.
    budget = on_exact_hardware(BastionBudget(max_nodes=32, probe=False, scale_acceptance=False, pause_drafting=False, smoothing=0.0))
    budget.start(target, HardwareProfile("cpu", {"float64": 0.05}, 8.0, 1.0), tmp_path)
    d = generate(target, prompts, drafter=oracle, policy=POLICIES[policy], budget=budget, max_new_tokens=24)
    for prompt, exp, gen in zip(prompts, expected, d.generations):
        assert_same_tokens(target, prompt, exp, gen.tokens, f"bastion batch {policy}")
    uneven = sum(len(set(s.tree_sizes)) > 1 for s in d.steps)
    assert uneven >= 3, f"rows should get different budgets (only {uneven} of {len(d.steps)} steps did)"
    # without decay, every accepted draft token and every verified node's belief is counted at its rank
    assert budget.hits.sum() == budget.accepted - 2 and budget.belief.sum() == pytest.approx(budget.believed - 2)


def test_ar_stretches_of_the_bastion_budget_stay_lossless(tiny_llama, tmp_path):
    """A weak (random) DFlash drafter on a target whose verification is expensive: the budget
    turns drafting off for stretches, the drafter absorbs those steps' tokens, and the output
    is still AR's."""
    from bastion.budget.controller import BastionBudget
    from bastion.budget.hardware import HardwareProfile
    from tests.test_dflash import random_drafter

    prompts = random_prompts(4, seed=9)
    expected = ar_outputs(tiny_llama, prompts, 40)
    budget = BastionBudget(max_nodes=16, probe=False)
    budget.start(tiny_llama, HardwareProfile("cpu", {"float64": 1e-6}, 8.0, 1.0), tmp_path)
    d = generate(tiny_llama, prompts, drafter=random_drafter(tiny_llama, block_size=6), policy=best_first, budget=budget, max_new_tokens=40)
    for prompt, exp, gen in zip(prompts, expected, d.generations):
        assert_same_tokens(tiny_llama, prompt, exp, gen.tokens, "bastion with AR stretches")
    sizes = [max(s.tree_sizes) for s in d.steps]
    assert 0 in sizes and max(sizes) > 0, sizes


def test_stop_strings_end_every_method_at_the_same_token(tiny_llama):
    prompts = random_prompts(4, seed=5)
    full = ar_outputs(tiny_llama, prompts, 24)
    text = tiny_llama.tokenizer.decode(full[0])
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a piece of the middle of AR's first answer
    ar = generate(tiny_llama, prompts, max_new_tokens=24, stop_strings=(stop,)).generations
    assert ar[0].finish == "stop" and stop in tiny_llama.tokenizer.decode(ar[0].tokens)
    assert stop not in tiny_llama.tokenizer.decode(ar[0].tokens[:-1])
    oracle = OracleDrafter(dict(zip(map(tuple, prompts), full)), vocab=49152, top_k=4)
    spec = generate(tiny_llama, prompts, drafter=oracle, policy=best_first, budget=FixedBudget(8), max_new_tokens=24,
                    stop_strings=(stop,)).generations
    assert [g.tokens for g in spec] == [g.tokens for g in ar] and [g.finish for g in spec] == [g.finish for g in ar]


@pytest.mark.parametrize("name", ["tiny_qwen3", "tiny_llama"])
def test_sampled_outputs_equal_ar_for_the_same_seed(name, tmp_path):
    """Temperature > 0, ranked children: every policy and budget, the BASTION budget sizing
    trees by this machine's real timings included, gives AR's sampled output token for token,
    and so does a second run with the same seed (keyed Gumbel-max sampling, sampling.py). A
    vocabulary of 2048: the tiny presets' 49152 spent the test hashing Gumbel noise."""
    from bastion.budget.controller import BastionBudget
    from bastion.budget.hardware import HardwareProfile

    cfg = target_config(name, dtype="float64", tokenizer=None)
    target = load_target(**{**cfg, "hf_config": {**cfg["hf_config"], "vocab_size": VOCAB}})
    prompts = random_prompts(6, seed=4, vocab=VOCAB)
    for sampling in (Sampling(1.0), Sampling(0.8, top_k=40, top_p=0.9)):
        ar = [g.tokens for g in generate(target, prompts, max_new_tokens=20, sampling=sampling, seed=7).generations]
        assert ar != ar_outputs(target, prompts, 20)
        assert ar != [g.tokens for g in generate(target, prompts, max_new_tokens=20, sampling=sampling, seed=8).generations]
        oracle = OracleDrafter(dict(zip(map(tuple, prompts), ar)), vocab=VOCAB, top_k=4)
        methods = [(policy, FixedBudget(n)) for policy in POLICIES for n in (2, 8, 24)]
        for _ in range(2):
            bastion = BastionBudget(max_nodes=16, probe=False, scale_acceptance=False)
            bastion.start(target, HardwareProfile("cpu", {"float64": 0.05}, 8.0, 1.0), tmp_path)
            methods.append(("best_first", bastion))
        deepest = 0  # over the fixed budgets: BASTION's sizes follow this machine's timings
        for policy, budget in methods:
            d = generate(target, prompts, drafter=oracle, policy=POLICIES[policy], budget=budget, max_new_tokens=20,
                         sampling=sampling, seed=7)
            for prompt, exp, gen in zip(prompts, ar, d.generations):
                assert gen.tokens == exp, f"{name} {policy} {type(budget).__name__} at T={sampling.temperature}: output differs from AR's"
            if isinstance(budget, FixedBudget):
                deepest = max(deepest, *(max(s.produced) for s in d.steps))
        assert deepest >= 4, "trees should accept deep paths"


def test_sampled_output_keys_follow_the_prompt_not_the_batch(tiny_qwen3):
    """A prompt's keyed sample is the same alone or in any batch, given its key."""
    prompts = random_prompts(4, seed=6)
    sampling = Sampling(1.0)
    batch = generate(tiny_qwen3, prompts, max_new_tokens=12, sampling=sampling, seed=1, keys=[10, 11, 12, 13]).generations
    alone = generate(tiny_qwen3, prompts[2:3], max_new_tokens=12, sampling=sampling, seed=1, keys=[12]).generations
    assert batch[2].tokens == alone[0].tokens
