"""Attention over a KV cache whose rows hold different numbers of verified tokens.

A forward's N new tokens per row sit at key slots prefix[b] .. prefix[b] + N - 1, right after
the row's verified tokens; each sees every verified token and the new tokens its row of `tree`
allows (a draft tree's ancestors, a prompt chunk's earlier tokens). `Layout` says exactly that
in B x N x N bits, so kernels that never build a score matrix (FlexAttention, Triton) can read
it at paper scale, where a dense float32 score tensor per layer does not fit (B=16, 32 heads,
N=257, S=4353: 2.3 GB). SDPA, the CPU path, gets the dense [B, 1, N, S] mask built from it;
drafters that attend over their own context pass such dense masks directly.

Kernels: `sdpa` (PyTorch's scaled_dot_product_attention), `flex` (FlexAttention over a block
mask from the layout, compiled) and `triton` (our tree attention, models/triton_attention.py).
`auto` is flex on CUDA and sdpa elsewhere. Whatever the kernel, a forward with no tree and nothing
verified (a prompt's first chunk) is plain causal attention and takes SDPA's causal path with no
mask: the flash kernel on GPUs, with no block mask to build nor a shape to compile flex for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import torch
import torch.nn.functional as F

from bastion.models.cpu import has_amx
from bastion.models.dynamo import allow_recompiles

KERNELS = ("sdpa", "flex", "triton")
FLEX_BLOCK = 128  # FlexAttention's block of queries and of keys (its default)
FLEX_DECODE_ROWS = 128  # query rows (N x query heads per KV head) inductor's flex decoding kernel fits in a block
MATMUL_QUERIES = 32  # longest query that sdpa() runs as matmuls in bfloat16/float16 on a CPU without AMX (at 64 the flash kernel wins)
MATMUL_KEY_BUCKET = 64  # those matmuls attend over a multiple of this many key slots (key_bucket)


def choose_kernel(name: str, device: torch.device | str) -> str:
    """`auto` -> the kernel for `device`; a named kernel as given, once known to exist."""
    if name == "auto":
        return "flex" if torch.device(device).type == "cuda" else "sdpa"
    if name not in KERNELS:
        raise ValueError(f"Unknown attention kernel '{name}'; choose auto, {', '.join(KERNELS)}.")
    return name


@dataclass(frozen=True)
class Layout:
    """Which key slots each of a forward's new tokens may attend to."""

    prefix: torch.Tensor  # [B] long: verified tokens per row, in slots 0 .. prefix[b] - 1
    tree: torch.Tensor | None  # [B, N, N] bool: new token i sees new token j; None: causal
    n_new: int  # N
    n_keys: int  # S: key slots attended over: the longest prefix + N, or more (a bucket: a compiled forward's, key_bucket)
    kernel: str = "sdpa"
    block_mask: object = field(init=False, default=None, repr=False)  # flex: FlexAttention's, shared by every layer
    sdpa_mask: torch.Tensor | None = field(init=False, default=None, repr=False)  # sdpa: dense(), shared by every layer

    def __post_init__(self):
        # built once when the layout is made, before the forward: per layer it cost every forward a
        # millisecond on a CPU; inside a compiled forward (decode.compile) a lazy build
        # (functools.cached_property takes a lock on Python 3.11) splits the graph at every layer
        if self.causal_only:
            return
        if self.kernel == "flex":
            object.__setattr__(self, "block_mask", self._flex_block_mask())
        elif self.kernel == "sdpa":
            object.__setattr__(self, "sdpa_mask", self.dense())

    @property
    def causal_only(self) -> bool:
        """No tree and no row has verified tokens: plain causal attention over the N tokens."""
        return self.tree is None and self.n_keys == self.n_new

    def dense(self) -> torch.Tensor:
        """[B, 1, N, S] bool: True where a new token may attend."""
        B, N, S = self.prefix.shape[0], self.n_new, self.n_keys
        device = self.prefix.device
        offset = torch.arange(S, device=device)[None, :] - self.prefix[:, None]  # [B, S]: index among the new tokens
        if self.tree is None:
            return (offset[:, None, :] <= torch.arange(N, device=device)[None, :, None])[:, None]
        among = self.tree.gather(2, offset.clamp(0, N - 1)[:, None, :].expand(B, N, S))  # [B, N, S]
        return ((offset < 0)[:, None, :] | ((offset < N)[:, None, :] & among))[:, None]

    def _flex_block_mask(self):
        """FlexAttention's block mask, read off the layout rather than found as create_block_mask
        finds it, by evaluating the mask at every (query, key) pair (milliseconds of host work
        every step, more than the attention). Per row, key blocks wholly inside the verified
        prefix are full; those from the prefix's last block through the new tokens' are partial,
        decided by the mask function; the rest are empty. Every query block alike."""
        from torch.nn.attention.flex_attention import BlockMask

        # contiguous: a packed tree is a slice [:, :, :N] of wider rows, and compiled flex guards on strides
        prefix, tree, N, S = self.prefix, None if self.tree is None else self.tree.contiguous(), self.n_new, self.n_keys
        if tree is None:
            def visible(b, h, i, s):
                return s <= prefix[b] + i
        else:
            def visible(b, h, i, s):
                j = s - prefix[b]
                return (j < 0) | ((j < N) & tree[b, i, j.clamp(0, N - 1)])
        B, q_blocks, kv_blocks = len(prefix), -(-N // FLEX_BLOCK), -(-S // FLEX_BLOCK)
        full = (prefix // FLEX_BLOCK).int()  # [B]: blocks 0 .. full - 1 hold verified keys only
        partial = (prefix + N - 1) // FLEX_BLOCK - full + 1  # [B]: blocks full .. full + partial - 1
        blocks = torch.arange(kv_blocks, dtype=torch.int32, device=prefix.device)

        def per_query_block(t: torch.Tensor) -> torch.Tensor:  # [B, ...] -> [B, 1, q_blocks, ...]
            return t[:, None, None].expand(B, 1, q_blocks, *t.shape[1:]).contiguous()

        return BlockMask.from_kv_blocks(
            per_query_block(partial.int()), per_query_block((full[:, None] + blocks).clamp(max=kv_blocks - 1)),
            per_query_block(full), per_query_block(blocks.expand(B, kv_blocks)),
            BLOCK_SIZE=FLEX_BLOCK, mask_mod=visible, seq_lengths=(N, S), compute_q_blocks=False)


@dataclass(frozen=True)
class Groups:
    """Training FlexDraft's layout: M groups of G mask tokens (the queries, group by group)
    after a sequence of S clean tokens (key slots 0..S-1; the groups' own keys follow, in the
    same order). A group sees the clean tokens before its anchor and, bidirectionally, itself;
    a `clean_first` slot (FlexDraft's bonus=clean) sees the clean tokens and itself only, as in
    the target's own forward. As a dense mask most of it would say that groups do not see each
    other: [M*G, M*G] of [M*G, S + M*G] bits, the attention's cost growing with anchors squared."""

    anchors: torch.Tensor  # [B, M] long: clean tokens each group sees
    size: int  # G
    n_clean: int  # S
    clean_first: bool = False


def within_group(size: int, clean_first: bool, device: torch.device | None = None) -> torch.Tensor:
    """[G, G] bool: which slots of its own group each slot of a FlexDraft group sees (Groups)."""
    sees = torch.ones(size, size, dtype=torch.bool, device=device)
    if clean_first:
        sees[0, 1:] = False
    return sees


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Layout | Groups | torch.Tensor) -> torch.Tensor:
    """q: [B, H, N, D], k/v: [B, Hkv, S, D]; mask: a Layout, Groups, or a dense [B, 1, N, S] bool
    mask (True = may attend) -> [B, N, H*D]."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, torch.Tensor):
        out = sdpa(q, k, v, mask)
    elif isinstance(mask, Groups):
        out = group_attention(q, k, v, mask)
    elif mask.causal_only:  # a prompt's first chunk, whatever the kernel: flash on GPUs, GQA included
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    elif mask.kernel == "flex":
        options = flex_options(q.device.type, q.shape[2] * (q.shape[1] // k.shape[1]))
        out = _flex(q.device.type)(q, k, v, block_mask=mask.block_mask, enable_gqa=gqa, kernel_options=options)
    elif mask.kernel == "triton":
        from bastion.models.triton_attention import tree_attention

        out = tree_attention(q, k, v, mask.prefix, mask.tree)
    else:
        out = sdpa(q, k, v, mask.sdpa_mask)
    B, H, N, D = out.shape
    return out.transpose(1, 2).reshape(B, N, H * D)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA under a dense [B, 1, N, S] bool mask -> [B, H, N, D]. On a CPU without AMX, a short
    bfloat16 or float16 query (a decode or verify step) runs as two batched matmuls instead
    (cpu_matmuls_beat_flash)."""
    if q.shape[2] <= MATMUL_QUERIES and cpu_half_precision(q.device, q.dtype) and cpu_matmuls_beat_flash():
        return matmul_attention(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


@cache
def cpu_matmuls_beat_flash() -> bool:
    """Whether short half-precision queries attend faster by matmuls than by PyTorch's CPU flash
    kernel. Without AMX they do: with AVX512-BF16 alone (a Zen 5) the flash kernel takes many
    times longer (the self-distillation data's AR steps). With AMX the flash kernel wins, since
    oneDNN builds a new AMX matmul for every key length it meets and a decode's grows every step
    (both measured in experiments/NOTES.md)."""
    return not has_amx()


def cpu_half_precision(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Queries sdpa() may run as matmuls rather than by the flash kernel: half precision on a CPU."""
    return dtype in (torch.bfloat16, torch.float16) and torch.device(device).type == "cpu"  # dtype first: fp32 steps stop there


def attention_path(kernel: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """The attention a target's decode steps run, as latency caches name it: `kernel`, and for
    SDPA on a CPU with half-precision queries which of sdpa()'s two paths (matmuls or the flash
    kernel, cpu_matmuls_beat_flash), since they cost differently and the choice has changed
    with what was measured: a fit taken on one must not price the other."""
    if kernel == "sdpa" and cpu_half_precision(device, dtype):
        return "sdpa-matmul" if cpu_matmuls_beat_flash() else "sdpa-flash"
    return kernel


def key_bucket(kernel: str, device: torch.device | str, dtype: torch.dtype) -> int:
    """The multiple of key slots a decode step's keys are rounded up to (the extra slots
    masked): MATMUL_KEY_BUCKET where sdpa() attends by half-precision matmuls, else 1. oneDNN
    builds a half-precision matmul for each shape it meets and a decode's key length grows
    every step, so unrounded every drafted step paid a build in its first layer; rounded, a
    decode meets a new shape every MATMUL_KEY_BUCKET tokens (experiments/NOTES.md)."""
    return MATMUL_KEY_BUCKET if attention_path(kernel, device, dtype) == "sdpa-matmul" else 1


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA's result by matmuls, softmax in float32; the query heads that share a KV head are
    stacked as one matmul's rows, so K/V are never repeated. A query that may attend nowhere
    gets zeros, as SDPA's CPU kernel gives. q: [B, H, N, D], k/v: [B, Hkv, S, D] -> [B, H, N, D]."""
    B, H, N, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    scores = (q.reshape(B, Hkv, H // Hkv * N, D) @ k.transpose(-1, -2)).float().mul_(D**-0.5)
    scores = scores.view(B, Hkv, H // Hkv, N, S).masked_fill_(~mask[:, :, None], float("-inf"))
    probs = scores.softmax(-1).nan_to_num(0.0).to(q.dtype).view(B, Hkv, H // Hkv * N, S)  # (out of place: autograd keeps the softmax)
    return (probs @ v).view(B, H, N, D)


def group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Attention under `groups` by matmuls: each query against the clean keys and its own
    group's G keys only, one softmax (float32) over both. q: [B, H, M*G, D], k/v: [B, Hkv,
    S + M*G, D] -> [B, H, M*G, D]."""
    B, H, N, D = q.shape
    Hkv, S, (M, G) = k.shape[1], groups.n_clean, (groups.anchors.shape[1], groups.size)
    q = q.reshape(B, Hkv, H // Hkv, M, G, D)
    own_k, own_v = (t[:, :, S:].reshape(B, Hkv, 1, M, G, D) for t in (k, v))
    clean = q.flatten(2, 4) @ k[:, :, :S].transpose(-1, -2)  # [B, Hkv, H/Hkv * M * G, S]
    visible = torch.arange(S, device=q.device) < groups.anchors[:, :, None]  # [B, M, S]
    clean = clean.view(B, Hkv, H // Hkv, M, G, S).masked_fill(~visible[:, None, None, :, None], float("-inf"))
    own = q @ own_k.transpose(-1, -2)  # [..., M, G, G]
    if groups.clean_first:
        own = own.masked_fill(~within_group(G, True, q.device), float("-inf"))
    scores = torch.cat([clean, own], -1).float().mul_(D**-0.5)  # [..., M, G, S + G]
    probs = scores.softmax(-1).to(v.dtype)
    out = probs[..., :S].flatten(2, 4) @ v[:, :, :S] + (probs[..., S:] @ own_v).flatten(2, 4)
    return out.view(B, H, N, D)


def flex_options(device_type: str, rows: int) -> dict | None:
    """FlexAttention's kernel options for a query of `rows` rows per KV head (N x query heads per
    KV head). Inductor takes its decoding kernel for short queries at a static batch (B=1 under
    dynamic shapes) and sizes its row block from the N it first compiles for: past
    FLEX_DECODE_ROWS rows no block fits and the compile fails (torch 2.11 on an H200: B=1, N=64,
    4 query heads per KV head). Such queries take the main kernel, as every batch above 1 does."""
    return {"BACKEND": "TRITON"} if device_type == "cuda" and rows > FLEX_DECODE_ROWS else None


@cache
def _flex(device_type: str):
    """FlexAttention compiled once per device type (eager flex is a dense reference
    implementation). Dynamic shapes on CUDA, since every decode step has its own N and S;
    inductor's CPU flex template does not compile with dynamic shapes (torch 2.13), so a CPU
    compiles per shape (its default kernel is sdpa anyway)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not torch.compiler.is_compiling():  # traced inside a compiled forward (decode.compile), its compile_forward raised the
        allow_recompiles()  # limit already, and setting it there would guard the forward's graphs on dynamo's config
    return torch.compile(flex_attention, dynamic=device_type == "cuda")

