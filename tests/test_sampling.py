"""Temperature > 0: every method's output distribution equals AR sampling's.

A tiny 16-token model, a fixed prompt, the first three tokens: their exact joint distribution
is computed from the target, and a chi-square test compares it with the samples of each
method (AR included). The drafter proposes noisy versions of the target's own distributions,
so trees accept deep paths and also reject. The test has the power to see a 2% shift, and it
does fail against a verifier that accepts by argmax (kept here, in the test only).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from functools import partial

import pytest
import torch

import bastion.engine
import bastion.sampling
from bastion.budget.fixed import FixedBudget
from bastion.drafters.base import DraftContext, Drafter
from bastion.drafters.flexdraft import FlexDraftDrafter
from bastion.engine import generate
from bastion.models.target import load_target
from bastion.sampling import Sampling
from bastion.tree.best_first import best_first
from bastion.tree.chain import chain
from bastion.tree.proposal import BlockProposal
from bastion.tree.static import static
from bastion.verify import Verdict
from tests.conftest import target_config
from tests.test_dflash import random_drafter

V, PROMPT, N_TOKENS = 16, [3, 5, 7, 9, 11], 3
ROWS, SEEDS = 8000, 3  # 24,000 samples per method
CATEGORIES = 12  # the 11 likeliest sequences and "any other": few degrees of freedom, high power


@pytest.fixture(scope="module")
def tiny16():
    cfg = target_config("tiny_qwen3", dtype="float64", tokenizer=None)
    cfg["hf_config"] = {**cfg["hf_config"], "vocab_size": V, "hidden_size": 32, "intermediate_size": 64,
                        "head_dim": 8, "initializer_range": 0.5}
    return dataclasses.replace(load_target(**cfg), eos_ids=frozenset())


def context_logits(target) -> dict[tuple[int, ...], torch.Tensor]:
    """Target logits after the prompt and every continuation of up to N_TOKENS - 1 tokens."""
    table = {}
    for n in range(N_TOKENS):
        conts = list(itertools.product(range(V), repeat=n))
        tokens = torch.tensor([PROMPT + list(c) for c in conts])
        B, L = tokens.shape
        cache = target.new_cache(B, L)
        hidden, _ = target.forward(tokens, torch.arange(L).expand(B, L), torch.ones(B, L, L, dtype=torch.bool).tril(), cache)
        table.update(zip(conts, target.logits(hidden[:, -1])))
    return table


def exact_joint(table, sampling: Sampling) -> dict[tuple[int, ...], float]:
    probs = {c: sampling.probs(l) for c, l in table.items()}
    return {seq: math.prod(probs[seq[:i]][seq[i]].item() for i in range(N_TOKENS))
            for seq in itertools.product(range(V), repeat=N_TOKENS)}


class TableDrafter(Drafter):
    """Proposes, for each position, the target's own logits along its greedy continuation,
    plus fixed noise: close to the target (deep acceptances), never equal (rejections)."""

    def __init__(self, table, block_size=3, noise=0.7, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.table = {c: l + noise * torch.randn(V, generator=gen, dtype=l.dtype) for c, l in table.items()}
        self.block_size = block_size

    def propose(self, ctx: DraftContext) -> BlockProposal:
        rows = []
        for seq in ctx.sequences:
            cont, logits = tuple(seq[len(PROMPT):]), []
            for _ in range(self.block_size):
                row = self.table.get(cont, torch.zeros(V, dtype=torch.float64))
                logits.append(row)
                cont = cont + (int(row.argmax()),)
            rows.append(torch.stack(logits))
        logits = torch.stack(rows)  # [B, K, V]
        top = torch.log_softmax(logits, -1).topk(4, dim=-1)
        return BlockProposal([s[-1] for s in ctx.sequences], top.indices, top.values, logits)


def sample_counts(target, sampling, method=None) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(SEEDS):
        d = generate(target, [PROMPT] * ROWS, max_new_tokens=N_TOKENS, sampling=sampling, seed=seed, **(method or {}))
        for g in d.generations:
            counts[tuple(g.tokens)] = counts.get(tuple(g.tokens), 0) + 1
    return counts


def chi_square_p_value(counts, joint) -> float:
    """Pearson's test over the CATEGORIES - 1 likeliest sequences plus the pooled rest; a
    sequence of probability zero (cut by top-k / top-p) that was sampled at all fails outright."""
    if any(counts.get(seq, 0) > 0 for seq, p in joint.items() if p == 0):
        return 0.0
    n = sum(counts.values())
    support = [seq for seq in sorted(joint, key=joint.get, reverse=True) if joint[seq] > 0]
    top = support[: CATEGORIES - 1]
    observed = [counts.get(seq, 0) for seq in top]
    expected = [n * joint[seq] for seq in top]
    if len(support) > len(top):
        observed.append(n - sum(observed))
        expected.append(n - sum(expected))
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return chi_square_tail(stat, len(observed) - 1)


def chi_square_tail(stat: float, dof: int) -> float:
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


SAMPLINGS = [Sampling(1.0), Sampling(0.7, top_k=6, top_p=0.9)]


def methods(table, target):
    drafter = TableDrafter(table)
    return {
        "chain": dict(drafter=drafter, policy=chain, budget=FixedBudget(3)),
        "best_first": dict(drafter=drafter, policy=best_first, budget=FixedBudget(6)),
        "static": dict(drafter=drafter, policy=partial(static, shape="eagle1_25"), budget=FixedBudget(8)),
        "flexdraft-parallel": real_drafters(target)["flexdraft-parallel"],
    }


def real_drafters(target):
    """The drafters run.py builds, with random weights: DFlash, and FlexDraft drafting apart
    from verification (sequential) and inside its forward (parallel)."""
    torch.manual_seed(0)
    flex = FlexDraftDrafter(target, tuned_layers=1, group_size=4, calibration_hidden=8, threshold=0.0, top_k=4)
    flex = flex.to(target.dtype).eval()
    return {
        "dflash": dict(drafter=random_drafter(target, block_size=3, mask_token_id=V - 1), policy=best_first, budget=FixedBudget(6)),
        "flexdraft-sequential": dict(drafter=flex, policy=best_first, budget=FixedBudget(4, mode="sequential")),
        "flexdraft-parallel": dict(drafter=flex, policy=best_first, budget=FixedBudget(4, mode="parallel")),
    }


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["T1", "T0.7-k6-p0.9"])
def test_ar_samples_the_target_distribution(tiny16, sampling):
    joint = exact_joint(context_logits(tiny16), sampling)
    assert chi_square_p_value(sample_counts(tiny16, sampling), joint) > 1e-3


@pytest.mark.parametrize("mode", ["sampled", "ranked"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["T1", "T0.7-k6-p0.9"])
def test_every_method_samples_the_target_distribution(tiny16, sampling, mode):
    table = context_logits(tiny16)
    joint = exact_joint(table, sampling)
    for name, method in methods(table, tiny16).items():
        p = chi_square_p_value(sample_counts(tiny16, dataclasses.replace(sampling, tree_mode=mode), method), joint)
        assert p > 1e-3, f"{name} ({mode} children): distribution differs from AR (chi-square p={p:.2g})"


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["T1", "T0.7-k6-p0.9"])
def test_every_method_outputs_ars_keyed_sample(tiny16, sampling):
    """Ranked children: every method, the real drafters included, outputs AR's sample token
    for token for the same seed (keyed Gumbel-max sampling, sampling.py), accepting drafts on
    the way."""
    table = context_logits(tiny16)
    ar = [g.tokens for g in generate(tiny16, [PROMPT] * 8, max_new_tokens=12, sampling=sampling, seed=5).generations]
    for name, method in {**methods(table, tiny16), **real_drafters(tiny16)}.items():
        d = generate(tiny16, [PROMPT] * 8, max_new_tokens=12, sampling=sampling, seed=5, **method)
        assert [g.tokens for g in d.generations] == ar, f"{name} at T={sampling.temperature}: output differs from AR's"
        assert max(max(s.produced) for s in d.steps) >= 2, f"{name} should accept drafted tokens"
        assert all(len(path) == n for s in d.steps for path, n in zip(s.paths, s.produced, strict=True))  # the budget's record


def test_drawn_children_leave_no_paths_in_the_sized_trees(tiny16):
    """Children drawn after sizing (tree_mode=sampled) renumber the trees: a step's accepted paths
    are not indices into the trees the budget sized, so none are reported."""
    table = context_logits(tiny16)
    d = generate(tiny16, [PROMPT] * 4, max_new_tokens=12, sampling=Sampling(1.0, tree_mode="sampled"), seed=5,
                 **methods(table, tiny16)["best_first"])
    assert max(max(s.produced) for s in d.steps) >= 2 and all(s.paths == [] for s in d.steps)


def test_the_test_sees_a_two_percent_shift(tiny16):
    joint = exact_joint(context_logits(tiny16), Sampling(1.0))
    n = ROWS * SEEDS
    top = sorted(joint, key=joint.get, reverse=True)
    shifted = dict(joint)
    shifted[top[0]] += 0.02  # 2 points more for the likeliest sequence: the hardest single shift to see
    for seq in top[1:]:
        shifted[seq] -= 0.02 * joint[seq] / (1 - joint[top[0]])
    expected_counts = {seq: n * p for seq, p in shifted.items()}
    assert chi_square_p_value(expected_counts, joint) < 1e-3


def argmax_verifier(target_probs, trees, generator, draft_probs, *packed):
    """The bug this suite must catch: drafts checked against the argmax, only the bonus sampled."""
    verdicts = []
    for b, tree in enumerate(trees):
        node, path, new = 0, [0], []
        while True:
            p = target_probs(torch.full((len(trees),), node))[b]
            best = int(p.argmax())
            child = next((c for c in tree.children[node] if tree.tokens[c] == best), None)
            if child is None:
                new.append(torch.multinomial(p, 1, generator=generator).item())
                break
            new.append(best)
            path.append(child)
            node = child
        verdicts.append(Verdict(path, new))
    return verdicts


def test_argmax_acceptance_fails_the_test(tiny16, monkeypatch):
    table = context_logits(tiny16)
    sampling = Sampling(1.0, tree_mode="sampled")
    monkeypatch.setattr(bastion.engine, "verify_sampled", argmax_verifier)
    counts = sample_counts(tiny16, sampling, methods(table, tiny16)["best_first"])
    assert chi_square_p_value(counts, exact_joint(table, sampling)) < 1e-6


def test_noise_shared_across_positions_fails_the_test(tiny16, monkeypatch):
    """The bug keyed sampling must not have: the same Gumbel noise at every output position
    (say, keyed by the step's root instead of each node's own position) ties each token to the
    ones before it. AR alone shows it."""
    real = bastion.sampling.gumbel
    monkeypatch.setattr(bastion.sampling, "gumbel", lambda seed, keys, positions, vocab: real(seed, keys, positions * 0, vocab))
    sampling = Sampling(1.0)
    assert chi_square_p_value(sample_counts(tiny16, sampling), exact_joint(context_logits(tiny16), sampling)) < 1e-6


def test_keyed_scores_a_chunk_of_nodes_at_a_time_take_the_same_samples(tiny16):
    """Verification takes keyed samples a few nodes at a time (Target.argmax's chunks; float64
    scores of every node at once would need 8x the logits' memory): one node at a time here,
    against every node at once."""
    sampling = Sampling(temperature=0.8, top_k=20, top_p=0.9)
    hidden = torch.randn(2, 7, tiny16.args.hidden_size, generator=torch.Generator().manual_seed(0)).to(tiny16.dtype)
    depths = torch.tensor([[0, 1, 1, 2, 3, 2, 4], [0, 1, 2, 3, 4, 5, 6]])
    keys, start = torch.tensor([3, 9]), torch.tensor([5, 40])
    noise = sampling.noise(7, keys, start, 7, tiny16.args.vocab_size)
    whole = sampling.scores(tiny16.logits(hidden), noise, depths).argmax(-1)

    def keyed(logits, nodes):
        return sampling.scores(logits, noise, depths[:, nodes])

    assert torch.equal(tiny16.argmax(hidden, chunk_elements=1, score=keyed), whole)
    assert not torch.equal(whole, tiny16.argmax(hidden))  # the samples are not simply the argmax


def test_keyed_noise_is_standard_gumbel_and_independent():
    """Moments of the counter-based noise, and no correlation between neighbouring keys,
    positions and tokens (what a weak hash would leave)."""
    g = bastion.sampling.gumbel(3, torch.arange(64), torch.arange(32).expand(64, 32), 512)  # [64, 32, 512]
    assert abs(g.mean() - 0.5772) < 0.01 and abs(g.var() - math.pi**2 / 6) < 0.02
    for a, b in [(g[1:], g[:-1]), (g[:, 1:], g[:, :-1]), (g[..., 1:], g[..., :-1])]:
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) < 0.01
    again = bastion.sampling.gumbel(3, torch.tensor([5]), torch.tensor([[7]]), 512)
    assert torch.equal(again[0, 0], g[5, 7]) and not torch.equal(bastion.sampling.gumbel(4, torch.tensor([5]), torch.tensor([[7]]), 512), again)


@pytest.mark.parametrize("name", ["chain", "static", "best_first"])
def test_same_seed_same_output(tiny16, name):
    """T=1, ranked children: a rerun with the same seed samples the same tokens, another seed others."""
    table = context_logits(tiny16)
    method = methods(table, tiny16)[name]
    runs = [generate(tiny16, [PROMPT] * 8, max_new_tokens=12, sampling=Sampling(1.0), seed=s, **method) for s in (5, 5, 6)]
    tokens = [[g.tokens for g in d.generations] for d in runs]
    assert tokens[0] == tokens[1] and tokens[0] != tokens[2]


def test_bad_sampling_settings_are_refused():
    with pytest.raises(ValueError, match="temperature >= 0"):
        Sampling(-1.0)
    with pytest.raises(ValueError, match="0 < top_p <= 1"):
        Sampling(1.0, top_p=0.0)
    with pytest.raises(ValueError, match="tree_mode must be one of sampled, ranked"):
        Sampling(1.0, tree_mode="coupled")


def lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_keyed_noise_is_the_documented_hash(monkeypatch):
    """gumbel's int32 words give lowbias32's unsigned bits (a Python-int reference here), for
    seeds, keys and positions past 32 bits and words past 2^31, a CPU's chunks included."""
    seed, key, position, vocab = 2**40 + 7, 2**33 + 5, 2**31 + 3, 300
    seed_word = lowbias32(lowbias32(seed & 0xFFFFFFFF) ^ (seed >> 32) & 0xFFFFFFFF)
    cell = lowbias32(lowbias32(lowbias32(key & 0xFFFFFFFF) ^ seed_word) ^ lowbias32(position & 0xFFFFFFFF))
    salt = lowbias32(cell ^ 0x5BD1E995)
    expected = [-math.log(-math.log((lowbias32(lowbias32(cell ^ t) ^ salt) + 0.5) / 2**32)) for t in range(vocab)]
    monkeypatch.setattr(bastion.sampling, "NOISE_CELLS", 1)  # three cells, hashed one at a time
    got = bastion.sampling.gumbel(seed, torch.tensor([key]), torch.tensor([[position] * 3]), vocab)
    assert all(got[0, m].tolist() == pytest.approx(expected, rel=1e-12) for m in range(3))
