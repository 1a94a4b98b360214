"""Tree attention as one Triton kernel: flash attention that reads the Layout's B x N x N bits.

Each program takes BLOCK_M new tokens of one (row, head) and streams the row's key slots in
blocks of BLOCK_N with an online softmax (fp32 running max, sum and output), so no [N, S] score
matrix is ever built: at paper scale SDPA's dense masked path needs ~2.3 GB of fp32 scores per
layer. A key slot s is visible to new token i of row b when s < prefix[b] (verified) or when
j = s - prefix[b] < N and tree[b, i, j] (None: j <= i). Key blocks past the last visible slot
are never loaded, so short rows in a ragged batch cost only their own length.

On CPU, Triton runs this under its interpreter (TRITON_INTERPRET=1 before triton is imported):
exact in fp32/fp16, but its `tl.dot` is wrong for bf16.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, prefix_ptr, tree_ptr,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_tb, stride_ti, stride_tj,
    H, N, D, group, scale_log2,
    HAS_TREE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (m, b * H + h): new tokens m*BLOCK_M .. +BLOCK_M of row b, query head h, which
    reads kv head h // group."""
    m_block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kv_h = h // group
    prefix = tl.load(prefix_ptr + b).to(tl.int32)

    i = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]: index among the new tokens
    d = tl.arange(0, BLOCK_D)
    q_mask = (i[:, None] < N) & (d[None, :] < D)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + i[:, None] * stride_qn + d[None, :] * stride_qd,
                mask=q_mask, other=0.0)  # [BLOCK_M, BLOCK_D]

    # A finite start for the running max: a block with nothing visible (a row's tree may hide a
    # whole block) then gives exp(-inf - m) = 0 and a rescale of exp(0) = 1, never NaN.
    m_run = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Causally, this block's last token sees up to slot prefix + its index; a tree may let a
    # token see a later one, so there every new token's slot is read.
    if HAS_TREE:
        end = prefix + N
    else:
        end = prefix + tl.minimum(N, (m_block + 1) * BLOCK_M)
    k_base = k_ptr + b * stride_kb + kv_h * stride_kh
    v_base = v_ptr + b * stride_vb + kv_h * stride_vh
    for start in range(0, end, BLOCK_N):
        s = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]: key slots
        kv_mask = (s[:, None] < end) & (d[None, :] < D)
        k = tl.load(k_base + s[:, None] * stride_ks + d[None, :] * stride_kd, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_base + s[:, None] * stride_vs + d[None, :] * stride_vd, mask=kv_mask, other=0.0)

        j = s - prefix  # [BLOCK_N]: index among the new tokens (negative: verified)
        if HAS_TREE:
            in_new = (j[None, :] >= 0) & (j[None, :] < N) & (i[:, None] < N)
            among = tl.load(tree_ptr + b * stride_tb + i[:, None] * stride_ti + j[None, :] * stride_tj,
                            mask=in_new, other=0)
            visible = (j[None, :] < 0) | (among != 0)  # [BLOCK_M, BLOCK_N]
        else:
            visible = j[None, :] <= i[:, None]

        # ieee: fp32 models stay exact on GPUs (tf32 otherwise); other dtypes ignore it.
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [BLOCK_M, BLOCK_N], log2 units
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_run, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        rescale = tl.exp2(m_run - m_new)
        l_run = l_run * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_run = m_new

    out = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]  # l_run is 0 only on padding rows i >= N
    tl.store(out_ptr + b * stride_ob + h * stride_oh + i[:, None] * stride_on + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: torch.Tensor,
                   tree: torch.Tensor | None, block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """q: [B, H, N, D]; k, v: [B, Hkv, S, D] (views into a KV cache are read in place); prefix:
    [B] long, verified slots per row; tree: [B, N, N] bool (new token i sees new token j) or
    None (causal) -> [B, H, N, D] in q's dtype.

    The output is a [B, H, N, D] view of a [B, N, H, D] buffer, so attend()'s transpose and
    reshape to [B, N, H*D] cost no copy. Block sizes are at least 16 (tl.dot's minimum)."""
    B, H, N, D = q.shape
    Hkv = k.shape[1]
    out = q.new_empty(B, N, H, D).transpose(1, 2)  # [B, H, N, D]
    # A bool tensor read as bytes (no copy); a causal forward passes prefix as a pointer never read.
    tree_arg = tree.view(torch.uint8) if tree is not None else prefix
    tree_strides = tree.stride() if tree is not None else (0, 0, 0)
    grid = (triton.cdiv(N, block_m), B * H)
    _tree_attention_kernel[grid](
        q, k, v, out, prefix, tree_arg,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *tree_strides,
        H, N, D, H // Hkv, math.log2(math.e) / math.sqrt(D),
        HAS_TREE=tree is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    return out
