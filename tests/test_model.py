"""The compact decoder against transformers, and the cache operations against fresh forwards."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bastion.models.kv_cache import fill_holes
from bastion.models.target import load_target
from bastion.tree.draft_tree import DraftTree, pack
from tests.conftest import target_config

QWEN2 = dict(model_type="qwen2", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
             initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
LLAMA31_ROPE = dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


def small(name: str, **kw):
    cfg = target_config(name, dtype="float64", tokenizer=None)
    cfg["hf_config"] = {**cfg["hf_config"], "vocab_size": 300, **kw}
    return cfg


@pytest.mark.parametrize(
    "cfg",
    [small("tiny_qwen3"), small("tiny_llama"), {**small("tiny_llama"), "hf_config": QWEN2},
     {**small("tiny_llama"), "hf_config": LLAMA31_ROPE}],
    ids=["qwen3", "llama", "qwen2", "llama3-rope"],
)
def test_logits_equal_transformers(cfg):
    target = load_target(**cfg)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg["hf_config"])).double().eval()
    state = {(k if k == "lm_head.weight" else f"model.{k}"): v for k, v in target.model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and not missing
    tokens = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0)).tolist()[0]
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(target.score(tokens), expected, rtol=1e-9, atol=1e-9)


def fresh_logits(target, sequence):
    return target.score(sequence)[-1]


def test_tree_forward_equals_sequential(tiny_qwen3):
    prefix = list(range(100, 120))
    # root 7 with children 8, 9; 8 -> 10 -> 11; 9 -> 12
    tree = DraftTree((7, 8, 9, 10, 11, 12), (-1, 0, 0, 1, 3, 2), (0.0,) * 6)
    cache = tiny_qwen3.new_cache(1, 64)
    n = len(prefix)
    tiny_qwen3.forward(torch.tensor([prefix]), torch.arange(n)[None], torch.ones(1, n, n, dtype=torch.bool).tril(), cache)
    cache.commit([list(range(n))])
    tokens, depths, mask, *_ = pack([tree], "cpu")
    hidden, _ = tiny_qwen3.forward(tokens, depths, mask, cache)
    logits = tiny_qwen3.logits(hidden)[0]
    for node in range(len(tree.tokens)):
        path_tokens = [tree.tokens[i] for i in tree.path(node)]
        torch.testing.assert_close(logits[node], fresh_logits(tiny_qwen3, prefix + path_tokens), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("keep", [[0, 2, 6], [0], [0, 1, 3, 4]])
def test_commit_keeps_exactly_the_accepted_path(tiny_llama, keep):
    prefix = list(range(200, 230))
    tree = DraftTree((7, 8, 9, 10, 11, 12, 13), (-1, 0, 0, 1, 3, 2, 2), (0.0,) * 7)
    assert all(tree.parents[b] == a for a, b in zip(keep, keep[1:]))
    cache = tiny_llama.new_cache(1, 64)
    n = len(prefix)
    tiny_llama.forward(torch.tensor([prefix]), torch.arange(n)[None], torch.ones(1, n, n, dtype=torch.bool).tril(), cache)
    cache.commit([list(range(n))])
    tiny_llama.forward(*pack([tree], "cpu")[:3], cache)
    cache.commit([keep])
    assert cache.lengths == [n + len(keep)]
    nxt = DraftTree.root_only(42)
    hidden, _ = tiny_llama.forward(*pack([nxt], "cpu")[:3], cache)
    accepted = [tree.tokens[i] for i in keep]
    torch.testing.assert_close(tiny_llama.logits(hidden)[0, 0], fresh_logits(tiny_llama, prefix + accepted + [42]), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("survivors", [[2, 0], [0, 2]])  # a reordering (copied whole), a row filling a hole (copied in place)
def test_ragged_batch_rows_equal_single_rows(tiny_qwen3, survivors):
    """Rows of different lengths in one batch, different trees, different commits; then a row
    finishes and the survivors go on."""
    prefixes = [list(range(50, 61)), list(range(300, 304)), list(range(900, 925))]
    trees = [DraftTree((1, 2, 3), (-1, 0, 1), (0.0,) * 3), DraftTree.root_only(5),
             DraftTree((6, 7, 8, 9), (-1, 0, 0, 2), (0.0,) * 4)]
    keeps = [[0, 1, 2], [0], [0, 2, 3]]
    cache = tiny_qwen3.new_cache(3, 64)
    width = max(map(len, prefixes))
    tokens = torch.tensor([p + [0] * (width - len(p)) for p in prefixes])
    causal = torch.ones(3, width, width, dtype=torch.bool).tril()
    tiny_qwen3.forward(tokens, torch.arange(width).expand(3, width), causal, cache)
    cache.commit([list(range(len(p))) for p in prefixes])
    hidden, _ = tiny_qwen3.forward(*pack(trees, "cpu")[:3], cache)
    logits = tiny_qwen3.logits(hidden)
    for b, (prefix, tree) in enumerate(zip(prefixes, trees)):
        for node in range(len(tree.tokens)):
            expected = fresh_logits(tiny_qwen3, prefix + [tree.tokens[i] for i in tree.path(node)])
            torch.testing.assert_close(logits[b, node], expected, rtol=1e-9, atol=1e-9)
    cache.commit(keeps)
    cache.keep_rows(survivors)
    hidden, _ = tiny_qwen3.forward(*pack([DraftTree.root_only(11), DraftTree.root_only(12)], "cpu")[:3], cache)
    logits = tiny_qwen3.logits(hidden)
    for row, (b, token) in enumerate(zip(survivors, [11, 12])):
        accepted = [trees[b].tokens[i] for i in keeps[b]]
        torch.testing.assert_close(logits[row, 0], fresh_logits(tiny_qwen3, prefixes[b] + accepted + [token]), rtol=1e-9, atol=1e-9)


def test_captured_features_are_the_named_layers_outputs(tiny_llama):
    tokens = torch.tensor([[5, 6, 7, 8]])
    cache = tiny_llama.new_cache(1, 8)
    mask = torch.ones(1, 4, 4, dtype=torch.bool).tril()
    _, features = tiny_llama.forward(tokens, torch.arange(4)[None], mask, cache, capture=(1, 0))
    x = tiny_llama.model.embed_tokens(tokens)
    cos, sin = tiny_llama.model.rotary(torch.arange(4)[None], x.dtype)
    outs = []
    for layer in tiny_llama.model.layers:
        x = layer(x, cos, sin, mask[:, None])
        outs.append(x)
    torch.testing.assert_close(features, torch.cat([outs[1], outs[0]], dim=-1))


def test_fill_holes_moves_only_rows_past_the_new_batch_size():
    assert fill_holes([0, 2, 3, 5]) == [0, 5, 2, 3]  # rows 1 and 4 finished: 5 fills 1, the rest stay
    assert fill_holes([1, 2]) == [2, 1]
    assert fill_holes([0, 1, 2]) == [0, 1, 2]


def test_a_target_keeps_its_rotary_frequencies_on_its_device():
    """The inverse frequencies are a plain attribute (float32 under any model dtype), which
    model.to(device) leaves on the host: load_target moves them, so that a compiled forward's
    first call reads no host tensor (inductor would skip its CUDA graph). The meta device stands
    in for a GPU."""
    target = load_target(**{**small("tiny_qwen3"), "device": "meta"})
    assert target.model.rotary.inv_freq.device.type == "meta"
