"""DFlash drafter: the decoding path equals the training path, checkpoints round-trip in the
released format, mismatched drafters are refused, decoding with it stays lossless, and the
training log's val_chain_aal counts the steps chain decoding takes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from bastion.bench.datasets import chat_tokens
from bastion.budget.fixed import FixedBudget
from bastion.drafters.base import DraftContext
from bastion.drafters.checkpoint import save_checkpoint
from bastion.drafters.dflash import DFlashDrafter, evenly_spaced_layers, load_dflash, new_dflash_config
from bastion.engine import generate
from bastion.models.int8_linear import Int8Linear, int8_linear
from bastion.recorder import FeatureRecorder
from bastion.sampling import Sampling
from bastion.train.data import file_prompts
from bastion.train.dflash import chain_aal
from bastion.train.examples import Example
from bastion.tree.best_first import best_first
from bastion.tree.chain import chain
from tests.conftest import ROOT
from tests.helpers import ar_outputs, assert_same_tokens
from tests.test_lossless import random_prompts


def random_drafter(target, layers=2, block_size=5, seed=0, mask_token_id=16) -> DFlashDrafter:
    torch.manual_seed(seed)
    config = new_dflash_config(target, layers, block_size, [0, 1], mask_token_id=mask_token_id)
    return DFlashDrafter(config, target).to(target.dtype).eval()


def target_features(target, tokens, layers):
    n = len(tokens)
    cache = target.new_cache(1, n)
    _, feats = target.forward(torch.tensor([tokens]), torch.arange(n)[None], torch.ones(1, n, n, dtype=torch.bool).tril(), cache, layers)
    return feats  # [1, n, F]


def test_decoding_path_equals_training_path(tiny_qwen3):
    drafter = random_drafter(tiny_qwen3)
    tokens = list(range(300, 340))
    feats = target_features(tiny_qwen3, tokens, drafter.feature_layers)
    anchors = torch.tensor([[12, 25, 31]])
    with torch.no_grad():
        hidden = drafter.block_hidden(feats, torch.tensor([tokens]), anchors)  # [1, 3, K, h]
        expected = torch.log_softmax(tiny_qwen3.logits(hidden[:, :, 1:]), -1)
    # decoding: context arrives in pieces, as verification commits it
    drafter.reset(1, 64)
    done = 0
    for m, a in enumerate(anchors[0].tolist()):
        ctx = DraftContext([tokens[: a + 1]], feats[:, done:a], [a - done])
        proposal = drafter.propose(ctx)
        torch.testing.assert_close(torch.log_softmax(proposal.logits[0], -1), expected[0, m], rtol=1e-8, atol=1e-8)
        done = a


def test_rows_whose_contexts_differ_in_length_draft_as_they_would_alone(tiny_qwen3):
    """A batch's context arrives right-padded to its longest row; each row's proposal is the
    training path's for that row, step after step, with the cache sized for the rows' tokens."""
    drafter = random_drafter(tiny_qwen3)
    rows = [list(range(300, 320)), list(range(500, 514))]
    feats = [target_features(tiny_qwen3, tokens, drafter.feature_layers) for tokens in rows]
    anchors = [[11, 14, 18], [6, 11, 13]]  # each row's verified tokens before each step's root
    expected = []
    with torch.no_grad():
        for f, tokens, a in zip(feats, rows, anchors):
            hidden = drafter.block_hidden(f, torch.tensor([tokens]), torch.tensor([a]))
            expected.append(torch.log_softmax(tiny_qwen3.logits(hidden[:, :, 1:]), -1)[0])
    drafter.reset(2, 20)
    done = [0, 0]
    for step in range(3):
        pieces = [f[0, d:a[step]] for f, d, a in zip(feats, done, anchors)]
        T = max(len(p) for p in pieces)
        padded = torch.stack([torch.cat([p, p.new_zeros(T - len(p), p.shape[1])]) for p in pieces])
        ctx = DraftContext([tokens[: a[step] + 1] for tokens, a in zip(rows, anchors)], padded, [len(p) for p in pieces])
        proposal = drafter.propose(ctx)
        for b in range(2):
            torch.testing.assert_close(torch.log_softmax(proposal.logits[b], -1), expected[b][step], rtol=1e-8, atol=1e-8)
        done = [a[step] for a in anchors]


def test_absorbed_context_counts_like_drafted_context(tiny_qwen3):
    """Steps the budget makes AR steps hand their tokens over through absorb(): the next draft
    equals the training path's, as if every step had drafted."""
    drafter = random_drafter(tiny_qwen3)
    tokens = list(range(300, 340))
    feats = target_features(tiny_qwen3, tokens, drafter.feature_layers)
    with torch.no_grad():
        hidden = drafter.block_hidden(feats, torch.tensor([tokens]), torch.tensor([[31]]))
        expected = torch.log_softmax(tiny_qwen3.logits(hidden[:, :, 1:]), -1)
    drafter.reset(1, 64)
    drafter.propose(DraftContext([tokens[:13]], feats[:, 0:12], [12]))
    for start, end in [(12, 13), (13, 20), (20, 21)]:
        drafter.absorb(DraftContext([tokens[: end + 1]], feats[:, start:end], [end - start]))
    proposal = drafter.propose(DraftContext([tokens[:32]], feats[:, 21:31], [10]))
    torch.testing.assert_close(torch.log_softmax(proposal.logits[0], -1), expected[0, 0], rtol=1e-8, atol=1e-8)


def test_checkpoint_roundtrip_in_released_format(tiny_qwen3, tmp_path):
    drafter = random_drafter(tiny_qwen3)
    save_checkpoint(drafter, tmp_path, torch.float64)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["block_size"] == 5 and config["num_target_layers"] == 2
    assert config["dflash_config"] == {"target_layer_ids": [0, 1], "mask_token_id": 16}
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.1.self_attn.k_norm.weight", "layers.1.mlp.down_proj.weight"} <= names
    assert not any(n.startswith(("embed", "lm_head", "target")) for n in names)
    loaded = load_dflash(tiny_qwen3, str(tmp_path), top_k=4)
    for (name, a), b in zip(drafter.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_mismatched_drafter_is_refused(tiny_qwen3, tiny_llama, tmp_path):
    save_checkpoint(random_drafter(tiny_qwen3), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_target_layers"] = 36
    config["dflash_config"]["target_layer_ids"] = [1, 9, 17]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"does not fit target tiny_qwen3: 36 target layers vs 2; target_layer_ids \[1, 9, 17\] outside 0..1"):
        load_dflash(tiny_qwen3, str(tmp_path))
    save_checkpoint(random_drafter(tiny_qwen3), tmp_path / "other")
    big = {**json.loads((tmp_path / "other" / "config.json").read_text()), "hidden_size": 4096}
    (tmp_path / "other" / "config.json").write_text(json.dumps(big))
    with pytest.raises(ValueError, match="hidden size 4096 vs 64"):
        load_dflash(tiny_llama, str(tmp_path / "other"))


def test_no_checkpoint_says_how_to_train(tiny_qwen3):
    with pytest.raises(ValueError, match="python train.py drafter=dflash target=tiny_qwen3"):
        load_dflash(tiny_qwen3, None)


def test_evenly_spaced_layers():
    assert evenly_spaced_layers(36, 5) == [1, 9, 17, 25, 33]  # z-lab/Qwen3-8B-DFlash-b16
    assert evenly_spaced_layers(30, 1) == [15]
    assert evenly_spaced_layers(2, 5) == [1]  # a 2-layer test target: distinct, in range


@pytest.mark.parametrize("policy", [chain, best_first])
def test_lossless_with_a_dflash_drafter(tiny_llama, policy):
    prompts = random_prompts(6, seed=4)
    expected = ar_outputs(tiny_llama, prompts, 20)
    drafter = random_drafter(tiny_llama, block_size=6)
    for budget in (1, 8, 64):
        d = generate(tiny_llama, prompts, drafter=drafter, policy=policy, budget=FixedBudget(budget), max_new_tokens=20)
        for p, exp, gen in zip(prompts, expected, d.generations):
            assert_same_tokens(tiny_llama, p, exp, gen.tokens, f"dflash {policy.__name__} {budget}")


def assert_drafts_losslessly(target, drafter, seed: int, label: str) -> None:
    """Chain and best-first decoding with `drafter` give AR's tokens on 4 random prompts."""
    prompts = random_prompts(4, seed=seed)
    expected = ar_outputs(target, prompts, 16)
    for policy in (chain, best_first):
        d = generate(target, prompts, drafter=drafter, policy=policy, budget=FixedBudget(8), max_new_tokens=16)
        for p, exp, gen in zip(prompts, expected, d.generations):
            assert_same_tokens(target, p, exp, gen.tokens, f"{label}, {policy.__name__}")


@pytest.mark.parametrize("draft_vocab", [None, 300])
def test_a_bfloat16_drafter_drafts_for_a_wider_target_losslessly(tiny_llama, tmp_path, draft_vocab):
    """drafter.dtype: a bfloat16 drafter (auto's choice where bfloat16 matmuls are fast) proposes
    for a float64 target, scoring with a bfloat16 copy of the target's head, and the output is AR's."""
    config = new_dflash_config(tiny_llama, 1, 5, [0, 1], 16, draft_vocab_size=draft_vocab)
    torch.manual_seed(0)
    save_checkpoint(DFlashDrafter(config, tiny_llama).eval(), tmp_path)
    drafter = load_dflash(tiny_llama, str(tmp_path), top_k=4, dtype="bfloat16")
    assert {p.dtype for p in drafter.parameters()} == {torch.bfloat16} and drafter.cache is None
    assert_drafts_losslessly(tiny_llama, drafter, 11, "bfloat16 drafter")
    assert drafter.cache.k.dtype == torch.bfloat16
    hidden = torch.randn(2, 3, tiny_llama.args.hidden_size, dtype=torch.bfloat16)
    assert drafter.logits(hidden).shape == (2, 3, tiny_llama.args.vocab_size) and drafter.logits(hidden).dtype == torch.float32
    assert load_dflash(tiny_llama, str(tmp_path)).fc.weight.dtype == tiny_llama.dtype  # no dtype: the target's


def test_an_int8_drafter_drafts_losslessly_and_scores_by_its_int8_head(tiny_llama, tmp_path):
    """drafter.int8: every linear of the drafter and its draft head run on int8 weights; the
    output is still AR's, and its logits stay within int8 rounding of the float drafter's."""
    config = new_dflash_config(tiny_llama, 1, 5, [0, 1], 16, draft_vocab_size=300)
    torch.manual_seed(0)
    save_checkpoint(DFlashDrafter(config, tiny_llama).eval(), tmp_path)
    drafter = load_dflash(tiny_llama, str(tmp_path), top_k=4, dtype="float32", int8=True)
    float_drafter = load_dflash(tiny_llama, str(tmp_path), top_k=4, dtype="float32", int8=False)
    linears = [m for m in drafter.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is Int8Linear for m in linears) and drafter.int8_head and not float_drafter.int8_head
    hidden = torch.randn(2, 3, tiny_llama.args.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(drafter.draft_head(hidden), float_drafter.draft_head(hidden), rtol=0.05, atol=0.05)
    assert drafter._score.func is int8_linear
    assert_drafts_losslessly(tiny_llama, drafter, 13, "int8 drafter")
    assert not load_dflash(tiny_llama, str(tmp_path), int8="auto").int8_head  # float64, the target's: no int8 kernel
    with pytest.raises(ValueError, match="drafter.int8=true needs a drafter on a CPU"):
        load_dflash(tiny_llama, str(tmp_path), int8=True)


def test_auto_drafter_dtype_is_bfloat16_only_where_it_is_fast(monkeypatch):
    import bastion.models.target as target_module

    for fast, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(target_module, "fast_bfloat16", lambda device, fast=fast: fast)
        assert target_module.drafter_dtype("auto", "cpu", torch.float32) == expected
    assert target_module.drafter_dtype(None, "cpu", torch.float64) == torch.float64
    assert target_module.drafter_dtype("float16", "cpu", torch.float32) == torch.float16
    with pytest.raises(ValueError, match="Unknown dtype 'fp8'"):
        target_module.drafter_dtype("fp8", "cpu", torch.float32)


def test_draft_vocabulary_limits_drafts_and_round_trips(tiny_llama, tmp_path):
    config = new_dflash_config(tiny_llama, 1, 5, [0, 1], 16, draft_vocab_size=300)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, tiny_llama).to(tiny_llama.dtype).eval()
    vocab = torch.arange(0, 49152, 164)[:300]
    drafter.set_draft_vocab(vocab)
    save_checkpoint(drafter, tmp_path)
    loaded = load_dflash(tiny_llama, str(tmp_path), top_k=4)
    assert torch.equal(loaded.draft_vocab, vocab)
    prompts = random_prompts(4, seed=9)
    expected = ar_outputs(tiny_llama, prompts, 16)
    d = generate(tiny_llama, prompts, drafter=loaded, policy=best_first, budget=FixedBudget(8), max_new_tokens=16)
    for p, exp, gen in zip(prompts, expected, d.generations):
        assert_same_tokens(tiny_llama, p, exp, gen.tokens, "draft vocabulary")
    loaded.reset(1, 64)
    proposal = loaded.propose(DraftContext([prompts[0]], target_features(tiny_llama, prompts[0], (0, 1))[:, :-1], [len(prompts[0]) - 1]))
    assert set(proposal.tokens.flatten().tolist()) <= set(vocab.tolist())
    # ranked within the draft vocabulary as if over the whole one with -inf elsewhere
    full = loaded.in_full_vocab(proposal.logits)  # [1, K-1, V]
    top = torch.log_softmax(full, -1).topk(4, -1)
    assert torch.equal(proposal.tokens, top.indices)
    torch.testing.assert_close(proposal.logprobs, top.values, rtol=0, atol=1e-12)
    sampling = Sampling(temperature=0.8, top_k=20, top_p=0.9)
    torch.testing.assert_close(proposal.distributions(sampling, tiny_llama.args.vocab_size), sampling.probs(full), rtol=0, atol=1e-12)


@pytest.mark.slow
def test_chain_aal_walks_the_steps_chain_decoding_takes(smollm2_packed):
    """val_chain_aal: walking the drafter's blocks along the target's greedy answers takes as
    many steps as chain decoding those prompts does (SmolLM2 and the committed drafter)."""
    target = smollm2_packed
    drafter = load_dflash(target, str(ROOT / "checkpoints" / "dflash_smollm2_135m"))
    prompts = [chat_tokens(target, messages) for _, messages in file_prompts("gsm8k", 4, seed=5)]
    layers = tuple(drafter.config["dflash_config"]["target_layer_ids"])
    recorder = FeatureRecorder(layers)
    answers = generate(target, prompts, max_new_tokens=64, recorder=recorder).generations
    walked, decoded = [], []
    for prompt, answer, features in zip(prompts, answers, recorder.features):
        example = Example(torch.tensor(prompt + answer.tokens), features, len(prompt))
        walked.append((len(answer.tokens) - 1) / chain_aal(drafter, [example]))
        decoding = generate(target, [prompt], drafter=drafter, policy=chain, budget=FixedBudget(drafter.block_size - 1), max_new_tokens=64)
        assert decoding.generations[0].tokens == answer.tokens
        decoded.append(len(decoding.steps))
    assert [round(w) for w in walked] == decoded
    assert sum(decoded) < sum(len(a.tokens) - 1 for a in answers)  # the drafter is accepted: the walk is not trivial
