"""Prepacked oneDNN linears (CPU inference): same results as nn.Linear, trainable copies, and
decoding with them stays lossless against AR decoding with them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from bastion.budget.fixed import FixedBudget
from bastion.engine import generate
from bastion.models.packed_linear import PackedLinear, linear_kernels, prepack_linears
from bastion.models.target import load_target
from bastion.tree.best_first import best_first
from tests.conftest import target_config
from tests.helpers import OracleDrafter, ar_outputs, assert_same_tokens, assert_trains_like_linear
from tests.test_lossless import random_prompts

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_packed_linear_equals_linear(bias, rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(2, rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert packed.weight is linear.weight and packed.state_dict().keys() == linear.state_dict().keys()


def test_packed_linear_trains_like_linear():
    assert_trains_like_linear(PackedLinear)


def test_deepcopy_of_a_packed_model_is_plain_and_independent():
    layer = nn.Sequential(nn.Linear(8, 8), nn.SiLU(), nn.Linear(8, 4, bias=False))
    prepack_linears(layer)
    clone = copy.deepcopy(layer)
    assert type(clone[0]) is nn.Linear and type(clone[2]) is nn.Linear
    assert torch.equal(clone[0].weight, layer[0].weight) and clone[0].weight is not layer[0].weight
    assert linear_kernels(layer) == "packed" and linear_kernels(clone) == "dense"


def test_prepack_keeps_tied_weights_and_skips_float64(tiny_qwen3):
    assert linear_kernels(prepack_linears(tiny_qwen3.model)) == "dense"  # float64: oneDNN has no kernels
    target = load_target(**target_config("tiny_qwen3", dtype="float32"))
    prepack_linears(target.model)
    assert isinstance(target.model.lm_head, PackedLinear)
    if target.args.tie_word_embeddings:
        assert target.model.lm_head.weight is target.model.embed_tokens.weight


def test_bfloat16_is_packed_only_where_onednn_has_bf16_kernels():
    """An AMD EPYC Zen 3 has no AVX-512: oneDNN refuses to pack bf16 there, so the model stays
    dense and still runs (the CI machine hit that refusal)."""
    layer = prepack_linears(nn.Sequential(nn.Linear(16, 8)).to(torch.bfloat16))
    expected = "packed" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "dense"
    assert linear_kernels(layer) == expected
    with torch.inference_mode():
        assert layer(torch.randn(2, 16, dtype=torch.bfloat16)).shape == (2, 8)


def test_decoding_with_packed_weights_is_lossless():
    """float32 tiny target, packed: every tree size reproduces AR decoding on the same kernels."""
    target = load_target(**target_config("tiny_qwen3", dtype="float32"))
    prepack_linears(target.model)
    prompts = random_prompts(6, seed=4)
    expected = ar_outputs(target, prompts, 20)
    oracle = OracleDrafter(dict(zip(map(tuple, prompts), expected)), vocab=49152, top_k=4)
    for budget in (1, 8, 32):
        decoding = generate(target, prompts, drafter=oracle, policy=best_first, budget=FixedBudget(budget), max_new_tokens=20)
        for prompt, exp, gen in zip(prompts, expected, decoding.generations):
            assert_same_tokens(target, prompt, exp, gen.tokens, f"packed budget={budget}")
