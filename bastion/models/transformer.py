"""A compact decoder for the Llama, Qwen2 and Qwen3 families (gpt-fast style).

Why our own forward and not transformers' modeling classes: speculative decoding needs exact
control of the KV cache (rows holding different numbers of verified tokens, tree tokens
written past the verified prefix, accepted paths compacted in place) and of the attention
mask, and FlexDraft swaps attention projections for some tokens of some layers. transformers
hides all three behind cache objects whose API changes between releases. The weights are the
Hub's own (same parameter names, loaded unchanged) and the tests check our logits against
transformers' implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from bastion.models.attention import Layout, attend
from bastion.models.kv_cache import KVCache

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelArgs:
    """The shape of a decoder, read from a transformers config."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: biases on q/k/v
    output_bias: bool  # Llama with attention_bias=true: bias on o_proj too
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k

    @classmethod
    def from_hf_config(cls, config) -> ModelArgs:
        arch = config.model_type
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"Model type '{arch}' is not supported; bastion runs {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
            raise ValueError("Only SiLU MLPs without bias are supported (hidden_act=silu, mlp_bias=false).")
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Sliding-window attention is not supported; use a config with use_sliding_window=false.")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            arch=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            n_layers=config.num_hidden_layers,
            n_heads=config.num_attention_heads,
            n_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position=config.max_position_embeddings,
            tie_word_embeddings=bool(config.tie_word_embeddings),
            attention_bias=arch == "qwen2" or bool(getattr(config, "attention_bias", False)),
            output_bias=arch != "qwen2" and bool(getattr(config, "attention_bias", False)),
            qk_norm=arch == "qwen3",
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementations, so bf16 runs match them (F.rms_norm:
        # their x * rsqrt(mean(x^2) + eps) in one call, not five)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class Rotary(nn.Module):
    """RoPE tables; the inverse frequencies come from transformers so every rope_type of the Hub
    configs (default, llama3, yarn, ...) is computed exactly as upstream."""

    def __init__(self, hf_config):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(hf_config, "rope_parameters", None) or {"rope_type": "default"}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params["rope_theta"]
            dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
            inv_freq, scaling = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.inv_freq = inv_freq.float()
        self.scaling = scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, N] -> the tables apply_rotary takes, cos and sin [B, 1, N, D] in `dtype`
        (a head axis to broadcast over; sin's first half negated, the sign of rotate-half)."""
        if self.inv_freq.device != positions.device:  # moved once, not copied to the device every call
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None, :, None].float() * self.inv_freq  # [B, 1, N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)
        sin[..., : freqs.shape[-1]].neg_()
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, N, D]; cos, sin: [B, 1, N, D] (Rotary). The reference's x * cos + rotate_half(x) * sin,
    rotate_half(x) = [-x2, x1], as x * cos + [x2, x1] * [-sin1, sin2]: the same products, in half the ops
    (they are a decode step's most numerous)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, input_size: int | None = None):
        """`input_size`: what q, k and v project from, when not the hidden size (EAGLE-3's
        layer reads a token embedding and a feature side by side)."""
        super().__init__()
        self.args = args
        h, d = args.hidden_size, args.head_dim
        x = input_size or h
        self.q_proj = nn.Linear(x, args.n_heads * d, bias=args.attention_bias)
        self.k_proj = nn.Linear(x, args.n_kv_heads * d, bias=args.attention_bias)
        self.v_proj = nn.Linear(x, args.n_kv_heads * d, bias=args.attention_bias)
        self.o_proj = nn.Linear(args.n_heads * d, h, bias=args.output_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [B, N, h] -> rotated queries [B, H, N, D]."""
        B, N, _ = x.shape
        q = self.q_proj(x).view(B, N, -1, self.args.head_dim)
        if self.args.qk_norm:
            q = self.q_norm(q)
        return apply_rotary(q.transpose(1, 2), cos, sin)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, N, h] -> rotated keys and values [B, Hkv, N, D]."""
        B, N, _ = x.shape
        k = self.k_proj(x).view(B, N, -1, self.args.head_dim)
        v = self.v_proj(x).view(B, N, -1, self.args.head_dim).transpose(1, 2)
        if self.args.qk_norm:
            k = self.k_norm(k)
        return apply_rotary(k.transpose(1, 2), cos, sin), v

    def forward(self, x, cos, sin, mask: Layout | torch.Tensor, extend_kv=None, context: torch.Tensor | None = None):
        """mask: a Layout or a dense [B, 1, N, S] bool mask (models/attention.py). `extend_kv(k, v)` returns the keys and
        values to attend over, the new ones included (a KV cache write); without it tokens attend
        among themselves. `context` [B, T, h]: states that enter the keys and values ahead of x's
        but ask nothing (a DFlash drafter's context, "KV injection"); cos and sin then cover T + N."""
        if context is None:
            k, v = self.keys_values(x, cos, sin)
        else:
            k, v = self.keys_values(torch.cat([context, x], dim=1), cos, sin)
            cos, sin = cos[:, :, context.shape[1]:], sin[:, :, context.shape[1]:]
        if extend_kv is not None:
            k, v = extend_kv(k, v)
        return self.o_proj(attend(self.queries(x, cos, sin), k, v, mask))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, mask, extend_kv=None, context=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, extend_kv, context)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Decoder with the Hub's parameter names minus the leading 'model.'."""

    def __init__(self, args: ModelArgs, hf_config):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(hf_config)

    def forward(
        self,
        tokens: torch.Tensor,  # [B, N]
        positions: torch.Tensor,  # [B, N] absolute positions
        layout: Layout,  # who attends to what (models/attention.py)
        cache: KVCache,
        write_pos: torch.Tensor,  # [B, N] cache slots for the new tokens
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the final normed hidden states [B, N, h] and, when `capture` names layers,
        the concatenated outputs of those layers [B, N, len(capture) * h] (what drafters use)."""
        x = self.embed_tokens(tokens)
        cos, sin = self.rotary(positions, x.dtype)
        captured = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, layout, partial(cache.write, i, write_pos=write_pos, s_view=layout.n_keys))
            if i in capture:
                captured[i] = x
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return self.norm(x), features
