"""Attention kernels against the dense-mask SDPA reference, and Layout's mask against its definition."""

import pytest
import torch
import torch.nn.functional as F

from bastion.models import attention
from bastion.models.attention import MATMUL_KEY_BUCKET, Groups, Layout, attend, choose_kernel, flex_options, matmul_attention
from bastion.models.kv_cache import KVCache


def random_tree_masks(B: int, N: int, generator: torch.Generator) -> torch.Tensor:
    """[B, N, N] ancestor masks of random trees (node 0 the root, parents before children)."""
    masks = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        for i in range(N):
            if i:
                masks[b, i] = masks[b, int(torch.randint(i, (1,), generator=generator))]
            masks[b, i, i] = True
    return masks


def definition(layout: Layout) -> torch.Tensor:
    """The mask as the docstring states it, slot by slot."""
    B, N, S = len(layout.prefix), layout.n_new, layout.n_keys
    mask = torch.zeros(B, 1, N, S, dtype=torch.bool)
    for b in range(B):
        p = int(layout.prefix[b])
        for i in range(N):
            for s in range(S):
                j = s - p
                among = j <= i if layout.tree is None else bool(layout.tree[b, i, j]) if 0 <= j < N else False
                mask[b, 0, i, s] = s < p or (0 <= j < N and among)
    return mask


def case(B=3, H=4, Hkv=2, N=7, prefix=(0, 5, 11), tree=True, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.tensor(prefix[:B])
    S = int(prefix.max()) + N
    q = torch.randn(B, H, N, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, S + 5, D, generator=g).to(dtype)[:, :, :S] for _ in range(2))  # cache slices
    layout = Layout(prefix, random_tree_masks(B, N, g) if tree else None, N, S)
    return q, k, v, layout


@pytest.mark.parametrize("tree", [True, False])
def test_layout_mask_is_its_definition(tree):
    _, _, _, layout = case(tree=tree)
    assert torch.equal(layout.dense(), definition(layout))
    assert torch.equal(layout.sdpa_mask, definition(layout))  # what sdpa attends under, built once for every layer
    assert Layout(torch.zeros(2, dtype=torch.long), None, 5, 5).sdpa_mask is None  # causal: SDPA's own causal path


def reference(q, k, v, layout):
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=definition(layout), enable_gqa=True)
    B, H, N, D = out.shape
    return out.transpose(1, 2).reshape(B, N, H * D)


@pytest.mark.parametrize("shape", [
    dict(),  # ragged rows, a tree, GQA
    dict(tree=False),  # a prompt chunk after a verified prefix
    dict(Hkv=4),  # no GQA
    dict(prefix=(0, 0, 0), tree=False),  # a prefill: the causal SDPA path without a mask
    dict(B=1, prefix=(9,)),
])
def test_sdpa_equals_the_reference(shape):
    q, k, v, layout = case(**shape)
    assert torch.allclose(attend(q, k, v, layout), reference(q, k, v, layout), atol=1e-5)


@pytest.mark.parametrize("matmuls", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [dict(), dict(Hkv=4), dict(tree=False), dict(N=1, prefix=(3, 9, 1))])
def test_short_half_precision_queries_on_cpu_equal_the_reference(shape, dtype, matmuls, monkeypatch):
    """bfloat16/float16 decode and verify steps on a CPU, by matmuls (no AMX) or the flash kernel (AMX)."""
    monkeypatch.setattr(attention, "cpu_matmuls_beat_flash", lambda: matmuls)
    calls = []
    monkeypatch.setattr(attention, "matmul_attention", lambda *a: calls.append(1) or matmul_attention(*a))
    q, k, v, layout = case(**shape, dtype=dtype)
    assert torch.allclose(attend(q, k, v, layout).float(), reference(q, k, v, layout), atol=2e-2)
    assert len(calls) == matmuls


def test_matmul_attention_gives_zeros_where_a_query_sees_nothing_as_sdpa_does():
    q, k, v, layout = case(dtype=torch.bfloat16)
    mask = layout.dense().clone()
    mask[1, 0, 2] = False
    out = matmul_attention(q, k, v, mask)
    assert torch.equal(out[1, :, 2], torch.zeros_like(out[1, :, 2]))
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    assert torch.allclose(out.float(), expected.nan_to_num(0.0), atol=2e-2)


@pytest.mark.parametrize("dtype, matmuls", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)])
def test_a_step_attending_by_half_precision_matmuls_reads_a_bucket_of_keys_the_extra_ones_masked(dtype, matmuls, monkeypatch):
    """oneDNN builds a half-precision matmul for every shape it meets: a decode step that attends
    by them reads a multiple of MATMUL_KEY_BUCKET key slots (stale ones past the new tokens,
    masked); the flash kernel and float32 read exactly the keys there are."""
    monkeypatch.setattr(attention, "cpu_matmuls_beat_flash", lambda: matmuls)
    g = torch.Generator().manual_seed(0)
    B, N, prefix = 2, 4, [70, 5]
    cache = KVCache(1, B, 2, 16, 200, dtype, "cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=g) * 1e3)  # stale slots hold values that would show if read
    cache.v.copy_(torch.randn(cache.v.shape, generator=g) * 1e3)
    cache.k[:, :, :, : max(prefix) + N] /= 1e3
    cache.v[:, :, :, : max(prefix) + N] /= 1e3
    cache.lengths = prefix
    tree = random_tree_masks(B, N, g)
    _, layout = cache.prepare(N, tree)
    exact = max(prefix) + N
    assert layout.n_keys == (MATMUL_KEY_BUCKET * 2 if dtype == torch.bfloat16 and matmuls else exact)
    assert not layout.sdpa_mask[..., exact:].any()
    q = torch.randn(B, 4, N, 16, generator=g).to(dtype)
    keys, values = cache.k[0], cache.v[0]
    out = attend(q, keys[:, :, : layout.n_keys], values[:, :, : layout.n_keys], layout)
    expected = reference(q, keys[:, :, :exact], values[:, :, :exact], Layout(layout.prefix, tree, N, exact))
    assert torch.allclose(out.float(), expected, atol=2e-2)


@pytest.mark.parametrize("clean_first", [False, True])
@pytest.mark.parametrize("Hkv", [2, 4])
def test_group_attention_equals_sdpa_under_its_dense_mask(Hkv, clean_first):
    """Training FlexDraft's groups: each sees the clean tokens before its anchor and itself; a
    clean first slot sees none of its group's masks."""
    g = torch.Generator().manual_seed(0)
    B, H, M, G, S, D = 2, 4, 5, 3, 11, 8
    anchors = torch.randint(0, S + 1, (B, M), generator=g)
    q = torch.randn(B, H, M * G, D, generator=g)
    k, v = (torch.randn(B, Hkv, S + M * G, D, generator=g) for _ in range(2))
    group, slot = torch.arange(M * G) // G, torch.arange(M * G) % G
    own = (group[:, None] == group[None, :]) & ~(clean_first & (slot[:, None] == 0) & (slot[None, :] > 0))
    dense = torch.cat([torch.arange(S) < anchors.repeat_interleave(G, 1)[:, :, None], own.expand(B, -1, -1)], -1)[:, None]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    out = attend(q, k, v, Groups(anchors, G, S, clean_first))
    assert torch.allclose(out, expected.transpose(1, 2).reshape(B, M * G, H * D), atol=1e-5)


LONG = [dict(N=150, prefix=(0, 300, 127)),  # two query blocks; full key blocks; trees across block edges
        dict(N=5, prefix=(128, 255, 256), tree=False)]  # after a prefix: flex, causal among the new tokens


def test_flex_equals_the_reference():
    """FlexAttention compiled as CUDA runs it (inductor's CPU template here), on two shapes in one
    compile (dynamic shapes: every decode step has its own N and S)."""
    for shape in (dict(), dict(N=5, prefix=(0, 3, 20), Hkv=1), dict(prefix=(0, 0, 0), tree=False), *LONG):
        q, k, v, layout = case(**shape)
        flex = Layout(layout.prefix, layout.tree, layout.n_new, layout.n_keys, "flex")
        assert torch.allclose(attend(q, k, v, flex), reference(q, k, v, layout), atol=1e-5)
        # a prompt's first chunk takes SDPA's causal path (flash on a GPU): no block mask is built for it
        assert (flex.block_mask is None) == flex.causal_only


@pytest.mark.parametrize("shape", LONG)
def test_flex_block_mask_skips_only_hidden_blocks_and_trusts_only_visible_ones(shape):
    _, _, _, layout = case(**shape)
    flex = Layout(layout.prefix, layout.tree, layout.n_new, layout.n_keys, "flex")
    mask, (B, N, S) = definition(layout)[:, 0], (len(layout.prefix), layout.n_new, layout.n_keys)
    listed, full = flex.block_mask.to_dense()[:, 0], torch.zeros_like(flex.block_mask.to_dense()[:, 0])
    for b in range(B):
        for m in range(-(-N // 128)):
            full[b, m, flex.block_mask.full_kv_indices[b, 0, m, :flex.block_mask.full_kv_num_blocks[b, 0, m]]] = 1
            for n in range(-(-S // 128)):
                block = mask[b, 128 * m : 128 * (m + 1), 128 * n : 128 * (n + 1)]
                assert not block.any() or listed[b, m, n], (b, m, n)  # a block with a visible key is attended
                assert not full[b, m, n] or block.all(), (b, m, n)  # a full block skips the mask: all visible
    assert full.sum() == sum(int(p) // 128 for p in layout.prefix) * -(-N // 128)  # the prefix's whole blocks


def test_kernel_choice():
    assert choose_kernel("auto", "cpu") == "sdpa" and choose_kernel("auto", "cuda:0") == "flex"
    with pytest.raises(ValueError, match="Unknown attention kernel 'xformers'; choose auto, sdpa, flex, triton."):
        choose_kernel("xformers", "cpu")


def test_flex_decoding_kernel_only_where_its_row_block_fits():
    # a single-row tree of 33 tokens under 4 query heads per KV head: 132 rows, past the block inductor can size
    assert flex_options("cuda", 32 * 4) is None and flex_options("cuda", 33 * 4) == {"BACKEND": "TRITON"}
    assert flex_options("cpu", 1024) is None  # inductor's CPU template has no decoding kernel
