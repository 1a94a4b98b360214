"""EAGLE-3 drafter: its cached tree drafting equals a plain forward of each path, checkpoints
load in the released format (safetensors or pytorch_model.bin) and are refused when made for
another target, and decoding with it under every tree policy is lossless."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from bastion.budget.fixed import FixedBudget
from bastion.drafters.base import DraftContext
from bastion.drafters.checkpoint import save_checkpoint
from bastion.drafters.eagle3 import Eagle3Drafter, load_eagle3, new_eagle3_config
from bastion.engine import generate
from bastion.sampling import Sampling
from bastion.tree.best_first import best_first
from bastion.tree.chain import chain
from bastion.tree.proposal import TreeProposal
from bastion.tree.static import static
from tests.test_dflash import target_features
from tests.test_lossless import random_prompts


def random_eagle3(target, seed=0, top_k=3, depth=3, draft_vocab_size=None) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(new_eagle3_config(target, draft_vocab_size), target, top_k=top_k, depth=depth)
    if draft_vocab_size:  # the draft vocabulary: every third target token
        drafter.d2t.copy_(torch.arange(draft_vocab_size) * 2)
    return drafter.to(target.dtype).eval()


def reference_children(drafter, target, tokens: list[int], path: list[int]) -> torch.Tensor:
    """Log-probabilities over the draft vocabulary after `path` below the root tokens[-1],
    from one uncached causal forward: verified positions read the target's features, drafted
    ones the drafter's own output one position back (as EAGLE-3 drafts)."""
    feats = target_features(target, tokens[:-1], drafter.feature_layers)  # [1, n - 1, F]
    sequence, n = tokens + path, len(tokens) - 1
    feature = drafter.fc(feats.to(drafter.fc.weight.dtype))
    for _ in range(len(path) + 1):
        m = feature.shape[1]
        positions = torch.arange(m)[None]
        cos, sin = drafter.rotary(positions, feature.dtype)
        out = drafter.midlayer(drafter.embed(torch.tensor([sequence[1 : m + 1]])), feature, cos, sin,
                               torch.ones(1, 1, m, m, dtype=torch.bool).tril())
        feature = torch.cat([feature[:, :n], out[:, n - 1 :]], 1)  # drafted positions read the output one back
    return drafter.draft_logprobs(out[0, -1])


@pytest.mark.parametrize("draft_vocab_size", [None, 300])
def test_cached_tree_drafting_equals_a_plain_forward_of_each_path(tiny_qwen3, draft_vocab_size):
    drafter = random_eagle3(tiny_qwen3, top_k=3, depth=3, draft_vocab_size=draft_vocab_size)
    tokens = list(range(300, 330))
    feats = target_features(tiny_qwen3, tokens, drafter.feature_layers)
    drafter.reset(1, 64)
    with torch.no_grad():
        drafter.propose(DraftContext([tokens[:13]], feats[:, :12], [12]))  # context arriving in pieces
        proposal = drafter.propose(DraftContext([tokens[:21]], feats[:, 12:20], [8]))
        tree_tokens, parents, logq = proposal.tokens[0].tolist(), proposal.parents[0].tolist(), proposal.logq[0]
        assert len(tree_tokens) == 1 + 3 + 2 * 9 and tree_tokens[0] == tokens[20]
        grown = {p for p in parents if p > 0}  # the leaves each step grew: 3 per step
        assert len(grown) == 6
        for c in range(1, len(tree_tokens)):  # every candidate, depths 1 to 3
            path, node = [], parents[c]
            while node > 0:
                path.insert(0, tree_tokens[node])
                node = parents[node]
            assert proposal.depths[c] == len(path) + 1
            expected = reference_children(drafter, tiny_qwen3, tokens[:21], path)
            draft_id = int(torch.arange(len(drafter.d2t))[torch.arange(len(drafter.d2t)) + drafter.d2t == tree_tokens[c]][0])
            parent_logq = logq[parents[c]] if parents[c] > 0 else 0.0
            torch.testing.assert_close(logq[c] - parent_logq, expected[draft_id].to(logq.dtype), rtol=1e-7, atol=1e-7)


def test_best_first_takes_the_likeliest_candidates_and_chain_follows_top_ranks():
    # root 5; children 6 (rank 0, p .6) and 7 (rank 1, p .3); 6's children 8 (rank 0, .5) and 9 (rank 1, .4)
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    parents = torch.tensor([[-1, 0, 0, 1, 1]])
    logq = torch.tensor([[1.0, 0.6, 0.3, 0.3, 0.24]]).log()
    proposal = TreeProposal([5], tokens, parents, logq, torch.tensor([[0, 0, 1, 0, 1]]), np.array([0, 1, 1, 2, 2]))
    (tree,) = best_first(proposal, 3)
    assert tree.tokens.tolist() == [5, 6, 7, 8] and tree.parents.tolist() == [-1, 0, 0, 1]  # .6, then .3 twice: the earlier first
    assert tree.depths.tolist() == [0, 1, 1, 2]  # the proposal's column depths, carried to pack
    (tree,) = chain(proposal, 5)
    assert tree.tokens.tolist() == [5, 6, 8] and tree.parents.tolist() == [-1, 0, 1]
    (tree,) = static(proposal, 5, [[1], [0], [0, 1], [1, 0]])  # [1, 0] was never grown: skipped
    assert tree.tokens.tolist() == [5, 7, 6, 9] and tree.parents.tolist() == [-1, 0, 0, 2]


def test_checkpoints_load_in_the_released_format(tiny_qwen3, tmp_path):
    drafter = random_eagle3(tiny_qwen3, draft_vocab_size=300)
    save_checkpoint(drafter, tmp_path / "st", torch.float64)
    config = json.loads((tmp_path / "st" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 300
    weights = load_file(tmp_path / "st" / "model.safetensors")
    h = tiny_qwen3.args.hidden_size
    assert weights["fc.weight"].shape == (h, 3 * h) and weights["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert weights["lm_head.weight"].shape == (300, h) and weights["d2t"].dtype == torch.long and weights["t2d"].dtype == torch.bool
    assert "embed_tokens.weight" not in weights  # the target's own is used
    # as SafeAILab's releases ship: pytorch_model.bin, the target's embedding copied in
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text(json.dumps(config))
    torch.save({**weights, "embed_tokens.weight": tiny_qwen3.model.embed_tokens.weight.detach()}, tmp_path / "bin" / "pytorch_model.bin")
    tokens = list(range(300, 330))
    feats = target_features(tiny_qwen3, tokens, drafter.feature_layers)
    proposals = []
    for d in (drafter, load_eagle3(tiny_qwen3, str(tmp_path / "st"), top_k=3, depth=3), load_eagle3(tiny_qwen3, str(tmp_path / "bin"), top_k=3, depth=3)):
        d.reset(1, 64)
        with torch.no_grad():
            proposals.append(d.propose(DraftContext([tokens[:21]], feats[:, :20], [20])))
    for p in proposals[1:]:
        assert torch.equal(p.tokens, proposals[0].tokens) and torch.allclose(p.logq, proposals[0].logq)


def test_a_drafter_for_another_target_is_refused(tiny_qwen3, tmp_path):
    config = new_eagle3_config(tiny_qwen3)
    for change, message in [({"target_hidden_size": 96}, "target hidden size 96 vs 64"),
                            ({"vocab_size": 1000}, "vocab 1000 vs 49152"),
                            ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}}, r"feature layers \[1, 2, 9\] are not three of 1..2")]:
        with pytest.raises(ValueError, match=f"does not fit target tiny_qwen3: {message}"):
            Eagle3Drafter({**config, **change}, tiny_qwen3)
    drafter = random_eagle3(tiny_qwen3, draft_vocab_size=300)
    drafter.d2t.fill_(49000)
    save_checkpoint(drafter, tmp_path, torch.float32)
    with pytest.raises(ValueError, match="d2t maps draft tokens outside the target's vocabulary"):
        load_eagle3(tiny_qwen3, str(tmp_path))


class OracleEagle3(Eagle3Drafter):
    """The real tree drafting (cache, masks, expansion), with the prompt's AR continuation
    planted at a random sibling rank below every node on the true path (missing at times):
    decoding then accepts deep paths through non-first ranks."""

    def __init__(self, *args, continuations=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.continuations, self.rng = continuations, random.Random(0)

    def propose(self, ctx):
        proposal = super().propose(ctx)
        tokens, parents, ranks = proposal.tokens.clone(), proposal.parents.tolist(), proposal.ranks.tolist()
        for b, seq in enumerate(ctx.sequences):
            truth = next((c[len(seq) - len(p):] for p, c in self.continuations.items() if seq[: len(p)] == list(p)), [])
            on_path, planted = {0: 0}, {}  # candidate -> depth, for candidates on the true path
            for c in range(1, tokens.shape[1]):
                parent = parents[b][c]
                if parent not in on_path or on_path[parent] >= len(truth):
                    continue
                depth = on_path[parent]
                rank = planted.setdefault(parent, self.rng.choice([0, 1, 2, None]))
                if ranks[b][c] == rank:
                    tokens[b, c] = truth[depth]
                    on_path[c] = depth + 1
                elif tokens[b, c] == truth[depth]:
                    tokens[b, c] = 3  # a decoy, not the truth at another rank
        return TreeProposal(proposal.roots, tokens, proposal.parents, proposal.logq, proposal.ranks, proposal.depths)


@pytest.mark.parametrize("policy", ["best_first", "chain", "static"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decoding_with_eagle3_is_lossless_under_every_policy(tiny_qwen3, policy, temperature):
    prompts, max_new = random_prompts(5, seed=3), 24
    sampling = Sampling(temperature=temperature)
    truth = [g.tokens for g in generate(tiny_qwen3, prompts, max_new_tokens=max_new, sampling=sampling).generations]
    torch.manual_seed(0)
    drafter = OracleEagle3(new_eagle3_config(tiny_qwen3), tiny_qwen3, top_k=3, depth=4,
                           continuations={tuple(p): t for p, t in zip(prompts, truth)}).to(tiny_qwen3.dtype).eval()
    tree = {"best_first": best_first, "chain": chain, "static": lambda p, n: static(p, n, "eagle1_25")}[policy]
    out = generate(tiny_qwen3, prompts, drafter=drafter, policy=tree, budget=FixedBudget(12), max_new_tokens=max_new, sampling=sampling)
    assert [g.tokens for g in out.generations] == truth  # float64 target: exact
    assert sum(sum(s.produced) - len(s.produced) for s in out.steps) > 10  # drafts were accepted


def test_a_shallower_budget_drafts_the_same_tree_top(tiny_qwen3):
    tokens = list(range(300, 321))
    feats = target_features(tiny_qwen3, tokens, random_eagle3(tiny_qwen3).feature_layers)
    proposals = []
    for max_depth in (None, 2, 1):
        drafter = random_eagle3(tiny_qwen3, top_k=3, depth=4)
        drafter.reset(1, 64)
        proposals.append(drafter.propose(DraftContext([tokens], feats[:, :20], [20], max_depth=max_depth)))
    full, two, one = proposals
    assert (full.depth, two.depth, one.depth) == (4, 2, 1)
    for shallow in (two, one):  # the first levels' candidates, each a draft forward fewer per level left out
        n = shallow.tokens.shape[1]
        assert n == 1 + 3 + 9 * (shallow.depth - 1)
        assert torch.equal(shallow.tokens, full.tokens[:, :n]) and torch.equal(shallow.parents, full.parents[:, :n])
        torch.testing.assert_close(shallow.logq, full.logq[:, :n])


def test_the_bastion_budget_sizes_eagle3_trees_in_depth_too_and_stays_lossless(tiny_qwen3, tmp_path):
    from bastion.budget.controller import BastionBudget
    from bastion.budget.hardware import HardwareProfile
    from tests.test_lossless import on_exact_hardware

    prompts, max_new = random_prompts(4, seed=5), 24
    truth = [g.tokens for g in generate(tiny_qwen3, prompts, max_new_tokens=max_new).generations]
    torch.manual_seed(0)
    drafter = OracleEagle3(new_eagle3_config(tiny_qwen3), tiny_qwen3, top_k=3, depth=6,
                           continuations={tuple(p): t for p, t in zip(prompts, truth)}).to(tiny_qwen3.dtype).eval()
    depths, propose = [], drafter.propose

    def recorded(ctx):
        proposal = propose(ctx)
        depths.append(proposal.depth)
        return proposal

    drafter.propose = recorded
    budget = on_exact_hardware(BastionBudget(max_nodes=12, probe=False, scale_acceptance=False, pause_drafting=False))
    budget.start(tiny_qwen3, HardwareProfile("cpu", {"float64": 0.05}, 8.0, 1.0), tmp_path)
    out = generate(tiny_qwen3, prompts, drafter=drafter, policy=best_first, budget=budget, max_new_tokens=max_new)
    assert [g.tokens for g in out.generations] == truth
    assert depths[0] == 6 and min(depths) < 6, depths  # later steps draft only as deep as the budget goes


def test_sampled_children_are_refused(tiny_qwen3):
    drafter = random_eagle3(tiny_qwen3)
    with pytest.raises(ValueError, match="drafts ranked children only: use decode.tree_mode=ranked"):
        generate(tiny_qwen3, [[5, 6, 7]], drafter=drafter, policy=best_first, budget=FixedBudget(4), max_new_tokens=4,
                 sampling=Sampling(temperature=1.0, tree_mode="sampled"))


def test_the_training_forward_is_tree_drafting_along_the_true_path(tiny_qwen3):
    """Training-time test unrolls exactly what decoding computes: step j of the chain whose
    context ends at position c scores the token at c + 2 + j as drafting does below the path
    tokens[c + 2 : c + 2 + j]."""
    drafter = random_eagle3(tiny_qwen3, draft_vocab_size=300)
    tokens = list(range(300, 330))
    feats = target_features(tiny_qwen3, tokens[:-1], drafter.feature_layers)  # positions 0..28
    with torch.no_grad():
        for first in (0, 3):  # every chain unrolled, or those from index 3 on
            outputs = drafter.unrolled(feats, torch.tensor([tokens]), 3, first)
            for c in (4, 17, 26):
                for j in range(3):
                    expected = reference_children(drafter, tiny_qwen3, tokens[: c + 2], tokens[c + 2 : c + 2 + j])
                    torch.testing.assert_close(drafter.draft_logprobs(outputs[j][0, c - first]), expected, rtol=1e-7, atol=1e-7)
