"""FlexDraft: parallel drafting equals sequential drafting, verification is untouched by the
mask groups, selective verification keeps the right nodes, and every mode is lossless."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from bastion.budget.fixed import FixedBudget
from bastion.budget.latency import ForwardCost, LatencyModel
from bastion.drafters.base import DraftContext
from bastion.drafters.checkpoint import save_checkpoint
from bastion.drafters.flexdraft import FlexDraftDrafter, group_layout, load_flexdraft
from bastion.engine import generate
from bastion.tree.best_first import best_first
from bastion.tree.chain import chain
from bastion.tree.draft_tree import DraftTree, pack
from tests.helpers import ar_outputs, assert_same_tokens
from tests.test_attention import random_tree_masks
from tests.test_lossless import random_prompts, with_eos_mid_output


def random_flexdraft(target, seed=0, **kw) -> FlexDraftDrafter:
    torch.manual_seed(seed)
    drafter = FlexDraftDrafter(target, tuned_layers=1, group_size=4, calibration_hidden=16, mask_token_id=16, **kw)
    with torch.no_grad():
        for p in drafter.parameters():  # move away from the target's own weights and from zero
            p.add_(0.05 * torch.randn_like(p))
    return drafter.to(target.dtype).eval()


def committed_cache(target, tokens, extra=64):
    cache = target.new_cache(1, len(tokens) + extra)
    n = len(tokens)
    target.forward(torch.tensor([tokens]), torch.arange(n)[None], torch.ones(1, n, n, dtype=torch.bool).tril(), cache)
    cache.commit([list(range(n))])
    return cache


TREE = DraftTree((7, 8, 9, 10, 11), (-1, 0, 1, 0, 3), (0.0, -0.2, -0.5, -1.0, -1.5))


@pytest.mark.parametrize("node", [0, 2, 4])
def test_parallel_group_equals_the_sequential_draft(tiny_qwen3, node):
    drafter = random_flexdraft(tiny_qwen3, threshold=0.0)
    prefix = list(range(400, 420))
    cache = committed_cache(tiny_qwen3, prefix)
    tokens, depths, mask, *_ = pack([TREE], "cpu")
    hidden, _ = drafter.verify_and_draft(cache, [TREE], tokens, depths, mask)
    # verification sees exactly what a plain target forward sees
    plain = committed_cache(tiny_qwen3, prefix)
    expected, _ = tiny_qwen3.forward(tokens, depths, mask, plain)
    torch.testing.assert_close(hidden, expected, rtol=1e-9, atol=1e-9)
    path = TREE.path(node)
    cache.commit([path])
    drafter.accept([path])
    parallel = drafter._pending[0]
    fresh = committed_cache(tiny_qwen3, prefix + [TREE.tokens[i] for i in path])
    (sequential,) = drafter.draft_after_prefix(fresh, [0], [TREE.tokens[path[-1]]])
    torch.testing.assert_close(parallel, sequential, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mode", ["sequential", "parallel", "flex"])
def test_a_clean_bonus_drafts_after_verification_only_and_stays_lossless(tiny_llama, mode):
    """With bonus=clean a group's first slot is the verified bonus token: it drafts only after
    verification (no budget mode makes it draft inside), its drafts depend on the bonus, and
    decoding stays lossless."""
    prompts = random_prompts(4, seed=11)
    target, expected = with_eos_mid_output(tiny_llama, prompts, 20)
    drafter = random_flexdraft(target, threshold=0.0, bonus="clean")
    assert drafter.parallel_tokens([TREE]) == (0, 0) and not drafter.drafts_inside_verification
    cache = committed_cache(target, list(range(400, 420)))
    first, second = (drafter.draft_after_prefix(cache, [0], [root])[0] for root in (7, 8))
    assert not torch.allclose(first, second)  # the bonus is read
    # its slot sees the prefix and itself only: the target's own hidden state at the bonus, whose
    # next token is the first draft (the calibration MLP leaves that one be)
    own, _ = target.forward(torch.tensor([[8]]), torch.zeros(1, 1, dtype=torch.long), None, cache)
    torch.testing.assert_close(second[0], own[0, 0])
    with torch.inference_mode():
        plain, calibrated = drafter.draft_logits(second[None], torch.tensor([8]))
        assert torch.equal(plain[0, 0], target.model.lm_head(own[0, 0]).float()) and torch.equal(plain[0, 0], calibrated[0, 0])
        skipped, same = drafter.draft_logits(second[None], torch.tensor([8]), plain=False)  # what decoding with calibration on reads
        assert skipped is None and torch.equal(same, calibrated)
    assert not torch.equal(plain[0, 1:], calibrated[0, 1:])
    masked = random_flexdraft(target, threshold=0.0)
    assert torch.equal(*(masked.draft_after_prefix(cache, [0], [root])[0] for root in (7, 8)))  # the paper's layout does not
    assert masked.drafts_inside_verification
    budget = budget_with(target, 4, synthetic_latency(target, parallel_cheaper=True), mode=mode)
    d = generate(target, prompts, drafter=drafter, policy=best_first, budget=budget, max_new_tokens=20)
    for p, exp, gen in zip(prompts, expected, d.generations):
        assert_same_tokens(target, p, exp, gen.tokens, f"bonus=clean {mode}")
    with pytest.raises(ValueError, match="drafter.bonus must be one of mask, clean"):
        random_flexdraft(target, bonus="both")


def test_selective_verification():
    drafter = FlexDraftDrafter.__new__(FlexDraftDrafter)
    drafter.selection, drafter.threshold = "min_confidence", math.exp(-0.6)
    assert drafter.selected_nodes(TREE) == [0, 1, 2]
    drafter.selection, drafter.threshold = "cumulative_product", 0.3
    # path probabilities 1, .82, .61, .37, .22 (sum 3.02): the best cover 70% = 2.11 -> nodes 0, 1, 2
    assert drafter.selected_nodes(TREE) == [0, 1, 2]


def synthetic_latency(target, parallel_cheaper: bool) -> LatencyModel:
    """Memory-bound (extra tokens nearly free: parallel wins) or compute-bound from 1 token (sequential wins)."""
    theta = [math.log(1e-3), math.log(1e-9), math.log(1e3), 0.0] if parallel_cheaper else [math.log(1e-6), math.log(1e6), math.log(1e-9), 0.0]
    return LatencyModel(ForwardCost(target.args, 8), 1e12, 1e12, np.asarray(theta))


def budget_with(target, nodes: int, latency: LatencyModel | None = None, **kw) -> FixedBudget:
    budget = FixedBudget(nodes, **kw)
    budget.latency = latency
    return budget


def test_flex_mode_follows_the_latency_model(tiny_qwen3):
    drafter = random_flexdraft(tiny_qwen3, threshold=0.0)
    inside, apart = drafter.parallel_tokens([TREE])
    assert (inside, apart) == (5 * 4, 4) and drafter.draft_tokens == 4  # every node kept: a group of 4 after each
    for cheaper in (True, False):
        budget = budget_with(tiny_qwen3, 4, synthetic_latency(tiny_qwen3, parallel_cheaper=cheaper), mode="flex")
        budget.predicted_s = float(budget.predict(len(TREE.tokens), [100]))  # the trees' forecast, as a controller sets it
        assert budget.parallel(len(TREE.tokens), lambda: (inside, apart), [100]) == cheaper
        wider = len(TREE.tokens) + (inside if cheaper else 0)  # drafting inside: the forecast is the wider forward's
        assert budget.predicted_s == float(budget.predict(wider, [100]))
    assert budget_with(tiny_qwen3, 4, mode="parallel").parallel(5, lambda: (inside, apart), [100])
    assert not budget_with(tiny_qwen3, 4, mode="sequential").parallel(5, lambda: (inside, apart), [100])
    with pytest.raises(ValueError, match="budget.mode=flex and pause_drafting=False need a latency model"):
        budget_with(tiny_qwen3, 4, mode="flex").parallel(5, lambda: (inside, apart), [100])


@pytest.mark.parametrize("mode", ["sequential", "parallel", "flex"])
def test_lossless_in_every_mode(tiny_llama, mode):
    prompts = random_prompts(6, seed=7)
    target, expected = with_eos_mid_output(tiny_llama, prompts, 20)
    drafter = random_flexdraft(target, threshold=0.05)
    latency = synthetic_latency(target, parallel_cheaper=True)
    for policy in (chain, best_first):
        for nodes in (1, 4, 16):
            budget = budget_with(target, nodes, latency, mode=mode)
            d = generate(target, prompts, drafter=drafter, policy=policy, budget=budget, max_new_tokens=20)
            for p, exp, gen in zip(prompts, expected, d.generations):
                assert_same_tokens(target, p, exp, gen.tokens, f"flexdraft {mode} {policy.__name__} {nodes}")


def test_checkpoint_roundtrip_and_mismatch(tiny_qwen3, tmp_path):
    drafter = random_flexdraft(tiny_qwen3)
    save_checkpoint(drafter, tmp_path, torch.float64)
    loaded = load_flexdraft(tiny_qwen3, str(tmp_path), calibration=False)
    for (name, a), b in zip(drafter.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert loaded.calibration_mode == "off"
    with pytest.raises(ValueError, match="python train.py drafter=flexdraft target=tiny_qwen3"):
        load_flexdraft(tiny_qwen3, None)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_target_layers": 36}))
    with pytest.raises(ValueError, match="trained for tiny_qwen3 \\(36 layers"):
        load_flexdraft(tiny_qwen3, str(tmp_path))
    # a clean-bonus drafter from before its first slot ran as the target's own token is refused
    clean = random_flexdraft(tiny_qwen3, bonus="clean")
    save_checkpoint(clean, tmp_path, torch.float64)
    assert load_flexdraft(tiny_qwen3, str(tmp_path)).bonus == "clean"
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "first_slot"}))
    with pytest.raises(ValueError, match="saw its masks.*retrain it: python train.py drafter=flexdraft target=tiny_qwen3"):
        load_flexdraft(tiny_qwen3, str(tmp_path))


def test_a_draft_vocabulary_narrows_the_head_the_calibration_and_the_drafts(tiny_qwen3, tmp_path):
    drafter = with_draft_vocab(random_flexdraft(tiny_qwen3, draft_vocab_size=300))
    assert drafter.calibration[2].out_features == 300 and drafter.head_weight().shape == (300, 64)
    cache = committed_cache(tiny_qwen3, list(range(300, 340)))
    proposal = drafter.propose(DraftContext([list(range(300, 341))], None, [0], cache))
    assert set(proposal.tokens.flatten().tolist()) <= set(range(0, 900, 3)) and len(drafter.draft_vocab) == 300
    assert proposal.logits.shape[-1] == 49152 and proposal.logits[..., 1].isneginf().all()  # the full vocabulary, -inf outside
    save_checkpoint(drafter, tmp_path, torch.float64)
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 300
    loaded = load_flexdraft(tiny_qwen3, str(tmp_path))
    assert torch.equal(loaded.draft_vocab, drafter.draft_vocab)
    cache = committed_cache(tiny_qwen3, list(range(300, 340)))
    again = loaded.propose(DraftContext([list(range(300, 341))], None, [0], cache))
    assert torch.equal(again.tokens, proposal.tokens)


def overhead_bound_latency(target, token_share: float) -> LatencyModel:
    """A fixed cost per forward plus `token_share` of it per token (a small model on a CPU)."""
    cost = ForwardCost(target.args, 8)
    flops, _ = cost.flops_bytes(np.array([1]), np.array([100]))
    t0 = 1e-3
    return LatencyModel(cost, 1e12, 1e12, np.array([math.log(t0), math.log(token_share * t0 * 1e12 / float(flops)), math.log(1e-9), 0.0]))


def on_latency_model(budget: FixedBudget) -> FixedBudget:
    """Report every step as taking what the budget's latency model says its forward takes
    (drafting inside it: parallel mode), so that its choices do not follow how busy the test
    machine is."""
    observe = budget.observe

    def modelled(step, contexts, width):
        seconds = float(budget.predict(width, contexts))
        observe(dataclasses.replace(step, draft_s=0.0, verify_s=seconds, other_s=0.0), contexts, width)

    budget.observe = modelled
    return budget


@pytest.mark.parametrize("token_share, drafted_steps", [
    # the drafter believes in almost none of its tokens, so the forecast stops drafting at the
    # first step; a drafted step costs ~1.01 AR steps: AR steps 1-7, a retry at 8 that fails
    # once measured, AR steps 9-23 (twice as many with the retry), a retry at 24, AR steps
    # 25-55, a retry at 56
    (0.001, [0, 8, 24, 56]),
    # compute-bound: the forecast prices a draft forward and a verify of 4 tokens at 2.5 AR steps,
    # so the stretch is 30 steps (its retry wastes <= 5%); measured at 4.5, the next is >= 70
    (1.0, [0, 30]),
])
def test_paused_drafting_stops_a_drafter_that_cannot_pay(tiny_llama, token_share, drafted_steps):
    """A random drafter produces ~1 token per drafted step, which never pays: with drafting
    off on, the budget decodes AR steps, retrying after stretches that double and that are long
    enough for a retry to waste at most 5% of them, and stays lossless."""
    prompts = random_prompts(1, seed=8)
    expected = ar_outputs(tiny_llama, prompts, 60)
    budget = on_latency_model(budget_with(tiny_llama, 3, overhead_bound_latency(tiny_llama, token_share),
                                          mode="parallel", pause_drafting=True))
    d = generate(tiny_llama, prompts, drafter=random_flexdraft(tiny_llama), policy=chain, budget=budget, max_new_tokens=60)
    assert_same_tokens(tiny_llama, prompts[0], expected[0], d.generations[0].tokens, "drafting off")
    assert [i for i, s in enumerate(d.steps) if s.drafted] == drafted_steps


def test_auto_calibration_races_the_two_heads():
    """calibration=auto scores the last drafted step's top-1 drafts with and without the MLP
    against the tokens the target produced, and drafts with whichever has won more steps."""
    drafter = FlexDraftDrafter.__new__(FlexDraftDrafter)
    drafter.calibration_mode, drafter.mlp_wins = "auto", [0, 1]
    assert drafter.uses_mlp()  # the prior: one win for the MLP
    for plain, mlp, wins in [([5, 6, 7], [9, 9, 9], [1, 1]),  # the target went on 5, 6, 8: plain reached 2, the MLP 0
                             ([5, 9, 9], [5, 9, 8], [1, 1]),  # a tie (both reached 1) teaches nothing
                             ([5, 6, 9], [5, 9, 9], [2, 1])]:
        drafter._lengths, drafter._race = [3], (torch.tensor([plain]), torch.tensor([mlp]))  # root at position 2
        drafter._score_race(DraftContext([[1, 2, 3, 5, 6, 8]], None, [1]))
        assert drafter.mlp_wins == wins and drafter._race is None
    assert not drafter.uses_mlp()
    drafter.mlp_wins = [0, 1]  # rows of a batch, one short of the group: each scored on its own
    drafter._lengths, drafter._race = [3, 2], (torch.tensor([[5, 6, 7], [4, 4, 4]]), torch.tensor([[9, 9, 9], [4, 4, 0]]))
    drafter._score_race(DraftContext([[1, 2, 3, 5, 6, 8], [1, 2, 4, 4]], None, [1, 1]))
    assert drafter.mlp_wins == [1, 1]  # row 0: plain reached 2, the MLP 0; row 1: both reached 2 (all it produced)
    drafter.calibration_mode = "on"
    assert drafter.uses_mlp()


def with_draft_vocab(drafter, size=300, including=()):
    """The drafter drafting from `including` and every third token only, `size` tokens in all."""
    others = [t for t in range(0, 3 * size, 3) if t not in set(including)]
    drafter.set_draft_vocab(torch.tensor(sorted({*including, *others[: size - len(set(including))]})))
    return drafter


@pytest.mark.parametrize("draft_vocab", [False, True], ids=["", "draft_vocab"])
@pytest.mark.parametrize("calibration", ["on", "off", "auto"])
def test_lossless_with_every_calibration(tiny_llama, calibration, draft_vocab):
    prompts = random_prompts(4, seed=3)
    target, expected = with_eos_mid_output(tiny_llama, prompts, 20)
    drafter = random_flexdraft(target, draft_vocab_size=300 if draft_vocab else None)
    if draft_vocab:  # AR's tokens among others, so that drafts can be accepted
        with_draft_vocab(drafter, including={t for e in expected for t in e})
    drafter.calibration_mode = calibration
    d = generate(target, prompts, drafter=drafter, policy=best_first, budget=FixedBudget(4), max_new_tokens=20)
    for p, exp, gen in zip(prompts, expected, d.generations):
        assert_same_tokens(target, p, exp, gen.tokens, f"calibration {calibration}")
    assert sum(drafter.mlp_wins) > 1 or calibration != "auto" or draft_vocab  # the race was scored (a narrower head ties more)
    assert sum(sum(s.produced) - len(s.produced) for s in d.steps) > 0  # drafts were accepted


@pytest.mark.slow
def test_chain_aal_walks_the_steps_sequential_chain_decoding_takes(smollm2_packed):
    """val_chain_aal (with the calibration MLP and without): walking the drafter's groups along
    the target's greedy answers takes as many steps as sequential chain decoding does
    (SmolLM2 and the committed drafter), as for DFlash (tests/test_dflash.py)."""
    from bastion.bench.datasets import chat_tokens
    from bastion.train.data import file_prompts
    from bastion.train.examples import Example
    from bastion.train.flexdraft import chain_aal
    from tests.conftest import ROOT

    target = smollm2_packed
    drafter = load_flexdraft(target, str(ROOT / "checkpoints" / "flexdraft_smollm2_135m"))
    prompts = [chat_tokens(target, messages) for _, messages in file_prompts("gsm8k", 3, seed=5)]
    answers = [g.tokens for g in generate(target, prompts, max_new_tokens=48).generations]
    examples = [Example(torch.tensor(p + a), torch.zeros(0), len(p)) for p, a in zip(prompts, answers)]  # features unused
    walked = [chain_aal(drafter, [e]) for e in examples]
    steps = {}
    for calibration, name in (("on", "val_chain_aal"), ("off", "val_chain_aal_plain")):
        drafter.calibration_mode = calibration
        for prompt, answer, aal in zip(prompts, answers, walked):
            decoding = generate(target, [prompt], drafter=drafter, policy=chain, budget=FixedBudget(drafter.group_size - 1),
                                max_new_tokens=48)
            assert decoding.generations[0].tokens == answer
            produced = sum(s.produced[0] for s in decoding.steps)  # its last step may accept drafts past max_new_tokens:
            assert aal[name] == round(min(produced, len(answer)) / len(decoding.steps), 4)  # the walk ends with the answer
            steps[calibration] = steps.get(calibration, 0) + len(decoding.steps)
    assert min(steps.values()) < sum(len(a) - 1 for a in answers)  # drafts are accepted: the walk is not trivial


def test_group_layout_is_its_definition():
    """Parallel mode's mask, slot by slot: a group sees its kept node's path and itself; a row's
    groups past its own keep see only themselves, at depth 0."""
    g, G = torch.Generator().manual_seed(0), 3
    tree_mask = random_tree_masks(3, 6, g)
    depths = tree_mask.sum(-1) - 1
    keep = [[0, 2, 5], [0], [0, 4]]
    full, group_depth = group_layout(tree_mask, depths, keep, G)
    K, M = 3, 6
    expected = torch.zeros(3, M + K * G, M + K * G, dtype=torch.bool)
    expected[:, :M, :M] = tree_mask
    depth = torch.zeros(3, K, dtype=torch.long)
    for b, nodes in enumerate(keep):
        for k in range(K):
            s = M + k * G
            expected[b, s : s + G, s : s + G] = True
            if k < len(nodes):
                expected[b, s : s + G, :M] = tree_mask[b, nodes[k]]
                depth[b, k] = depths[b, nodes[k]] + 1
    assert torch.equal(full, expected) and torch.equal(group_depth, depth)
