"""Peak device memory of a decode, from the target's shape alone, before any weights load.

A run that does not fit the GPU otherwise fails after minutes of downloading and loading, or
deep inside a decode when the largest tree first meets the longest prompt. The peak is what a
decode holds from start to end (the weights and the KV cache, preallocated once) plus the most
that one forward allocates on top of it. Forwards run one at a time, and inside a forward the
attention scores, the MLP's activations and the logits are not alive together, so only the
largest of those transients counts. The figures leave out what is small or not known before
loading (the CUDA context, allocator fragmentation, kernel workspaces, the drafter's own
forward); `check_fits` keeps a margin for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from bastion.models.attention import FLEX_BLOCK
from bastion.models.target import ARGMAX_CHUNK, cache_slots, token_bucket
from bastion.models.transformer import ModelArgs

BLOCK_MASK_BYTES = 8  # per (query block, key block) of a flex forward: Layout's block mask, two int32 index tables
HEADROOM = 0.9  # the share of device memory a plan may fill; the rest is for what it leaves out
GB = 1e9

# What to do when a part is the largest one, in run.py's settings.
ADVICE = {
    "target weights": "use a smaller target.dtype (bfloat16 is half of float32) or a smaller target",
    "drafter weights": "use a smaller drafter",
    "drafter KV cache": "lower decode.batch_size or plan_context (the prompt tokens per row it assumes)",
    "KV cache": "lower decode.batch_size, budget.max_nodes or plan_context (the prompt tokens per row it assumes)",
    "verify logits": "lower budget.max_nodes or decode.batch_size",
    "verify attention scores": "lower budget.max_nodes or decode.batch_size, or use attention=flex",
    "verify block mask": "lower budget.max_nodes or decode.batch_size",
    "verify MLP": "lower budget.max_nodes or decode.batch_size",
    "prefill MLP": "lower decode.batch_size or plan_context (the prompt tokens per row it assumes)",
    "prefill features": "lower decode.batch_size or plan_context (the prompt tokens per row it assumes)",
}


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of a decode's peak, by part; `how` says how each was counted, for the table."""

    target_weights: int
    drafter_weights: int
    kv_cache: int
    drafter_kv_cache: int
    transients: dict[str, int]  # what one forward adds at its largest point, by where; only the largest counts
    how: dict[str, str]

    @property
    def resident(self) -> dict[str, int]:
        return {"target weights": self.target_weights, "drafter weights": self.drafter_weights, "KV cache": self.kv_cache,
                "drafter KV cache": self.drafter_kv_cache}

    @property
    def largest_transient(self) -> str:
        return max(self.transients, key=self.transients.get)

    @property
    def total(self) -> int:
        return sum(self.resident.values()) + self.transients[self.largest_transient]

    def largest_part(self) -> str:
        parts = {**self.resident, self.largest_transient: self.transients[self.largest_transient]}
        return max(parts, key=parts.get)

    def lines(self) -> list[str]:
        """The table plan=true prints: a row per part, the largest transient marked, then the peak."""
        rows = [(name, n, self.how[name] + ("  <- the largest transient" if name == self.largest_transient else ""))
                for name, n in {**self.resident, **self.transients}.items()]
        rows.append(("peak", self.total, "weights + KV cache + the largest transient"))
        return [f"  {name:<24}{n / GB:8.2f} GB  {how}" for name, n, how in rows]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def model_args(fields: dict) -> ModelArgs:
    """The decoder's shape from transformers config fields (a preset's `shape`, a random target's
    `hf_config`, a model directory's config.json), without any weights."""
    from transformers import AutoConfig

    return ModelArgs.from_hf_config(AutoConfig.for_model(**fields))


def parameter_count(args: ModelArgs) -> int:
    """The parameters of models/transformer.py's Transformer with this shape."""
    h, d, heads, kv = args.hidden_size, args.head_dim, args.n_heads, args.n_kv_heads
    attention = h * heads * d + 2 * h * kv * d + heads * d * h  # q, k, v, o
    attention += (heads + 2 * kv) * d * args.attention_bias + h * args.output_bias + 2 * d * args.qk_norm
    layer = attention + 3 * h * args.intermediate_size + 2 * h  # + gate/up/down and the two norms
    embeddings = args.vocab_size * h * (1 if args.tie_word_embeddings else 2)  # lm_head shares them when tied
    return embeddings + args.n_layers * layer + h  # + the final norm


def checkpoint_parameters(path: Path) -> int:
    """Parameters in a checkpoint directory's *.safetensors, read from the files' headers only."""
    from safetensors import SafetensorError, safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(file, "pt") as weights:
                total += sum(math.prod(weights.get_slice(key).get_shape()) for key in weights.keys())
        except SafetensorError as error:
            raise ValueError(f"{file} is not a readable safetensors file ({error}); train or download it again.") from None
    return total


def plan_memory(args: ModelArgs, dtype: torch.dtype, batch: int, context: int, max_new_tokens: int, max_nodes: int,
                kernel: str, drafter_params: int = 0, extra_tokens: int = 0, captured_layers: int = 0,
                drafter_kv_width: int = 0, cuda: bool = True, sampled: bool = False, compiled: bool = False,
                ranked: bool = True) -> MemoryPlan:
    """The peak of decoding `batch` prompts of `context` tokens for `max_new_tokens` with trees of
    up to `max_nodes` draft nodes (0: AR only) under the attention `kernel`, weights in `dtype`.
    `extra_tokens`: cache slots a verify forward uses beyond its tree (Drafter.extra_tokens);
    `captured_layers`: target layers whose outputs the drafter reads (a prefill keeps them for
    every prompt token: each layer's output, their concatenation, the engine's buffer of them);
    `drafter_kv_width`: the keys and values a drafter caches per row and slot (2 x its layers x
    KV heads x head_dim), over the target cache's slots;
    `sampled`: temperature > 0, where `ranked` children (decode.tree_mode) are verified by keyed
    scores a chunk of tokens at a time and sampled children by one row's logits at a time, a
    level of the descent (greedy verification takes Target.argmax's chunks of the logits alone);
    `compiled`: decode.compile, whose forwards run their token count's bucket (Target.padded)."""
    B, L, V, I = batch, args.n_layers, args.vocab_size, args.intermediate_size
    size = dtype.itemsize
    n_params = parameter_count(args)
    n = max_nodes + 1  # a verify forward's tokens per row: the tree and its root
    n_forward = token_bucket(n + extra_tokens) if compiled else n + extra_tokens  # what it runs, a drafter's extra tokens included
    capacity = cache_slots(max(context + max_new_tokens + n_forward, token_bucket(context) if compiled else 0), compiled)  # engine.generate's
    chunk = min(n, max(1, ARGMAX_CHUNK // (B * V)))  # Target.argmax's tokens at a time
    upcast = 4 if size < 4 else 0  # Target.logits' float32 copy of a narrower lm_head output
    if sampled and ranked:  # a chunk's logits, and at most 32 B of sampling.scores' float64 temporaries
        logit_tokens, logit_size, what = chunk, size + upcast + 32, "keyed scores a chunk of tokens at a time"
    elif sampled:  # a level's logits, and verify_sampled's [B, V] temporaries (p, q, residuals, top-p's sort: <= 16 words)
        logit_tokens, logit_size, what = 1, size + upcast + 64, "a level of sampled verification at a time"
    else:  # the argmax a chunk at a time, in the model's dtype
        logit_tokens, logit_size, what = chunk, size, "greedy: the argmax a chunk of tokens at a time"
    score_matrix = kernel == "sdpa" and cuda  # SDPA with a tree mask runs the math backend on CUDA; flex and triton build none
    scores, scores_how = math_attention(args, B, n_forward, capacity, size)
    blocks = -(-n_forward // FLEX_BLOCK) * -(-capacity // FLEX_BLOCK)  # flex's (query block, key block) pairs per row
    transients = {
        "verify logits": B * logit_tokens * V * logit_size,
        "verify attention scores": scores if score_matrix else 0,
        "verify block mask": B * (blocks * BLOCK_MASK_BYTES + n_forward**2) if kernel == "flex" and cuda else 0,
        "verify MLP": 3 * B * n_forward * I * size,
        "prefill MLP": 3 * B * context * I * size,  # worst case: every row in one chunk; causal SDPA is flash, no scores
        "prefill features": 3 * captured_layers * B * context * args.hidden_size * size,
    }
    dtype_name = str(dtype).removeprefix("torch.")
    how = {
        "target weights": f"{n_params:,} parameters x {size} B ({dtype_name})",
        "drafter weights": f"{drafter_params:,} parameters x {size} B",
        "KV cache": f"2 x {L} layers x {B} rows x {args.n_kv_heads} heads x {capacity} slots x {args.head_dim} x {size} B",
        "drafter KV cache": f"{B} rows x {capacity} slots x {drafter_kv_width} values x {size} B",
        "verify logits": f"{B} rows x {logit_tokens} tokens x {V} vocab x {logit_size} B ({what})",
        "verify attention scores": (scores_how if score_matrix else f"none: {kernel} builds no score matrix" if cuda
                                    else f"not counted: {kernel} on a CPU"),
        "verify block mask": (f"{B} rows x ({blocks} query x key blocks x {BLOCK_MASK_BYTES} B of index tables + the tree's "
                              f"{n_forward}^2 B, contiguous)" if kernel == "flex" and cuda else "none: not flex on CUDA"),
        "verify MLP": f"3 x {B} rows x {n_forward} tokens x {I} x {size} B (gate, up, their product)",
        "prefill MLP": f"3 x {B} rows x {context} tokens x {I} x {size} B (one chunk of every row)",
        "prefill features": (f"3 x {captured_layers} layers x {B} rows x {context} tokens x {args.hidden_size} x {size} B (the "
                             f"drafter's target features: each layer's output, their concatenation, the engine's buffer)"),
    }
    return MemoryPlan(n_params * size, drafter_params * size, 2 * L * B * args.n_kv_heads * capacity * args.head_dim * size,
                      B * capacity * drafter_kv_width * size, transients, how)


def math_attention(args: ModelArgs, batch: int, queries: int, keys: int, size: int) -> tuple[int, str]:
    """Bytes PyTorch's math SDPA backend (what SDPA with a tree mask runs on CUDA) holds at once in
    one layer, and how they were counted: float32 scores and their softmax [B, H, n, S], K and V
    upcast to float32 when narrower, and repeated to every query head under GQA: the terms a
    measurement of the same C++ function on a CPU shows (experiments/NOTES.md)."""
    B, H, Hkv, D = batch, args.n_heads, args.n_kv_heads, args.head_dim
    scores = 2 * B * H * queries * keys * 4
    upcast = 2 * B * Hkv * keys * D * 4 if size < 4 else 0
    repeated = 2 * B * H * keys * D * 4 if H != Hkv else 0
    how = (f"2 x {B} rows x {H} heads x {queries} x {keys} keys x 4 B (sdpa with a tree mask: the math backend's float32 "
           f"scores and softmax)" + (", K and V in float32" if upcast else "") + (f" and repeated to {H} heads" if repeated else ""))
    return scores + upcast + repeated, how


def check_fits(plan: MemoryPlan, memory: int, device: str) -> None:
    """Refuse, in one sentence naming its largest part and what to lower, a plan whose peak
    exceeds HEADROOM of the `device`'s `memory` bytes."""
    if plan.total <= HEADROOM * memory:
        return
    part = plan.largest_part()
    size = {**plan.resident, **plan.transients}[part]
    raise ValueError(f"This run needs about {plan.total / GB:.1f} GB at its peak, more than {HEADROOM:.0%} of the "
                     f"{memory / GB:.0f} GB of the {device}, and its largest part is the {part} ({size / GB:.1f} GB): "
                     f"{ADVICE[part]} (plan=true prints the whole plan).")
