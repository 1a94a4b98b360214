"""The Triton tree-attention kernel equals SDPA over the Layout's dense mask, alone and in a model.

Without a GPU, Triton runs the kernel under its interpreter, which must be chosen before the
kernel is defined: hence the environment variable ahead of the import. The shapes are small and
the blocks 16 wide, so ragged rows still span several query and key blocks while the slow
interpreter stays within seconds."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from bastion.engine import generate  # noqa: E402
from bastion.models import triton_attention  # noqa: E402
from bastion.models.attention import Layout  # noqa: E402
from bastion.models.target import load_target  # noqa: E402
from tests.conftest import target_config  # noqa: E402

INTERPRETED = isinstance(triton_attention._tree_attention_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("bastion.models.triton_attention was imported without TRITON_INTERPRET=1 before this module, and "
                "there is no GPU to compile it for", allow_module_level=True)

# The interpreter's tl.dot is wrong for bf16, so bf16 is checked on GPUs only.
DTYPES = [(torch.float32, 1e-5), (torch.float16, 2e-3)] + ([] if INTERPRETED else [(torch.bfloat16, 1.6e-2)])


def ancestor_masks(B: int, N: int, generator: torch.Generator) -> torch.Tensor:
    """[B, N, N] bool: each row a random tree (parents[i] < i) whose tokens see their ancestors and themselves."""
    mask = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        for i in range(N):
            if i > 0:
                mask[b, i] = mask[b, int(torch.randint(i, (1,), generator=generator))]
            mask[b, i, i] = True
    return mask


def block_diagonal(B: int, N: int, generator: torch.Generator, size: int = 8) -> torch.Tensor:
    """[B, N, N] bool: tokens see every token of their own block of `size`, later ones included
    (FlexDraft's mask-token blocks); with nothing verified, later query blocks see nothing in the
    first key block."""
    block = torch.arange(N) // size
    return (block[:, None] == block[None, :]).expand(B, N, N)


def check(prefix: list[int], N: int, H: int, Hkv: int, D: int, tree, dtype, atol: float, seed: int = 0):
    """Kernel vs an fp32 SDPA reference, keys and values sliced from a larger cache buffer;
    `tree` makes the [B, N, N] mask (None: causal)."""
    g = torch.Generator().manual_seed(seed)
    B, S = len(prefix), max(prefix) + N
    q = torch.randn(B, N, H, D, generator=g).to(DEVICE, dtype).transpose(1, 2)  # [B, H, N, D], as a model makes it
    cache = torch.randn(2, B, Hkv, S + 7, D, generator=g).to(DEVICE, dtype)  # [2, B, Hkv, capacity, D]
    k, v = cache[0, :, :, :S], cache[1, :, :, :S]  # [B, Hkv, S, D] views: never copied
    prefix_t = torch.tensor(prefix, device=DEVICE)
    tree_t = tree(B, N, g).to(DEVICE) if tree else None
    out = triton_attention.tree_attention(q, k, v, prefix_t, tree_t, block_m=16, block_n=16)
    mask = Layout(prefix_t, tree_t, N, S).dense()
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                           enable_gqa=True)
    assert out.shape == (B, H, N, D) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype, atol", DTYPES, ids=lambda x: str(x).removeprefix("torch."))
@pytest.mark.parametrize("tree", [ancestor_masks, None], ids=["tree", "causal"])
@pytest.mark.parametrize("H, Hkv", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_ragged_rows(dtype, atol, tree, H, Hkv):
    """Rows with different verified lengths (one with none), so rows skip different key blocks."""
    check([37, 0, 21], N=20, H=H, Hkv=Hkv, D=16, tree=tree, dtype=dtype, atol=atol)


@pytest.mark.parametrize("dtype, atol", DTYPES, ids=lambda x: str(x).removeprefix("torch."))
def test_prefill(dtype, atol):
    """A prompt: nothing verified, N = S, causal; D = 32 and a partial last block."""
    check([0, 0], N=40, H=4, Hkv=2, D=32, tree=None, dtype=dtype, atol=atol)


def test_block_diagonal_tree():
    check([0, 9], N=40, H=2, Hkv=1, D=16, tree=block_diagonal, dtype=torch.float32, atol=1e-5)


def test_head_dim_not_a_power_of_two():
    check([5, 18], N=9, H=2, Hkv=1, D=24, tree=ancestor_masks, dtype=torch.float32, atol=1e-5)


@pytest.fixture(scope="module")
def targets():
    """The tiny Qwen3 (fp32) with SDPA and the same weights with the Triton kernel."""
    sdpa = load_target(**target_config("tiny_qwen3", device=DEVICE, attention="sdpa"))
    return sdpa, dataclasses.replace(sdpa, attention="triton")


def test_model_tree_forward(targets):
    """A prefill, a ragged commit, then a tree forward: logits through Triton equal SDPA's."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(100, 1000, (2, 12), generator=g).to(DEVICE)
    tree = ancestor_masks(2, 10, g).to(DEVICE)
    depths = tree.sum(-1) - 1  # [B, N]: a token's depth is its number of ancestors
    tokens = torch.randint(100, 1000, (2, 10), generator=g).to(DEVICE)
    logits = []
    for target in targets:
        cache = target.new_cache(2, 40)
        hidden, _ = target.forward(prompt, torch.arange(12, device=DEVICE).expand(2, 12), None, cache)
        prefill = target.logits(hidden)
        cache.commit([list(range(12)), list(range(7))])
        hidden, _ = target.forward(tokens, depths, tree, cache)
        logits.append((prefill, target.logits(hidden)))
    for sdpa, triton_ in zip(*logits):
        torch.testing.assert_close(triton_, sdpa, atol=1e-4, rtol=1e-4)


def test_model_decode(targets):
    """AR decoding of two prompts of different lengths gives the same tokens with either kernel."""
    prompts = [[5, 80, 700, 31, 9, 412, 1000], [17, 23, 4000]]
    sdpa, triton_ = ([g.tokens for g in generate(t, prompts, max_new_tokens=8).generations] for t in targets)
    assert triton_ == sdpa
