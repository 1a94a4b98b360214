"""DFlash: a block-diffusion drafter conditioned on the target's hidden states.

One forward drafts a whole block. The block is the root (the last verified token) followed by
mask tokens, embedded with the target's frozen embeddings; its positions attend to each other
bidirectionally and to the context. The context is the target's hidden states of every
verified token, taken at `target_layer_ids`, concatenated, projected by `fc` and normed by
`hidden_norm`; each draft layer turns it into keys and values with its own k/v projections
("KV injection"), cached across steps. The target's LM head turns the block's last hidden
states into per-position marginals: a BlockProposal.

Checkpoints use the released format (z-lab/dflash): a Qwen3-style config.json with
`block_size`, `num_target_layers` and `dflash_config.{target_layer_ids, mask_token_id}`, and
safetensors named `layers.N.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight`.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from transformers import AutoConfig

from bastion.drafters.base import DraftContext, Drafter, DraftVocabulary
from bastion.drafters.checkpoint import read_checkpoint, shaped_like
from bastion.models.int8_linear import int8_weights, quantize_linears
from bastion.models.kv_cache import KVCache
from bastion.models.target import Target, drafter_dtype
from bastion.models.transfer import to_device
from bastion.models.transformer import Block, ModelArgs, RMSNorm, Rotary
from bastion.tree.proposal import BlockProposal, top_candidates


class DFlashDrafter(nn.Module, DraftVocabulary, Drafter):
    def __init__(self, config: dict, target: Target, top_k: int = 8, block_size: int | None = None):
        super().__init__()
        dflash = config.get("dflash_config", {})
        self.config = config
        self.block_size = int(block_size or dflash.get("block_size") or config["block_size"])  # root + drafts
        self.mask_token_id = int(dflash.get("mask_token_id", config.get("mask_token_id")))
        self.feature_layers = target_layer_ids(config)
        self.embedding_scale = float(dflash.get("input_embedding_scale", 1.0))
        self.top_k = top_k
        hf_config = AutoConfig.for_model(**{**config, "model_type": "qwen3"})
        self.args = ModelArgs.from_hf_config(hf_config)
        check_fits(self, target)
        h = self.args.hidden_size
        self.layers = nn.ModuleList(Block(self.args) for _ in range(self.args.n_layers))
        self.fc = nn.Linear(len(self.feature_layers) * target.args.hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, self.args.rms_norm_eps)
        self.norm = RMSNorm(h, self.args.rms_norm_eps)
        self.rotary = Rotary(hf_config)
        # An optional draft vocabulary (base.DraftVocabulary; our extension of the format)
        vocab = dflash.get("draft_vocab_size")
        self.register_buffer("draft_vocab", torch.arange(vocab) if vocab else None)
        self.target = target  # a plain dataclass: its weights are shared, not registered here
        self.cache: KVCache | None = None

    # ---- decoding ---------------------------------------------------------------------------
    def reset(self, batch_size: int, capacity: int) -> None:
        a = self.args
        weight = self.fc.weight
        # past the context: the block's slots, and past them a shorter row's padding (propose), at most a block of it
        slots = capacity + 2 * self.block_size
        self.cache = None  # the last decode's freed before the next one's is made
        self.cache = KVCache(a.n_layers, batch_size, a.n_kv_heads, a.head_dim, slots, weight.dtype, weight.device)

    def keep_rows(self, rows: list[int]) -> None:
        self.cache.keep_rows(rows)

    @torch.inference_mode()
    def absorb(self, ctx: DraftContext) -> None:
        self._append_context(ctx.features, ctx.n_features)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> BlockProposal:
        """One forward over the newly verified context and the block: each layer projects both
        into keys and values by one matmul (the context's cached for later steps), and the block
        asks the queries."""
        context = self.project(ctx.features.to(self.fc.weight.dtype))  # [B, T, h]
        roots = [seq[-1] for seq in ctx.sequences]
        B, T, K = len(roots), context.shape[1], self.block_size
        device = context.device
        first = to_device(self.cache.lengths, device)[:, None]  # [B, 1] the context's first slot
        self.cache.commit([list(range(n)) for n in ctx.n_features])  # the context is verified: its slots fill below
        block_pos, layout = self.cache.prepare(K, torch.ones(B, K, K, dtype=torch.bool, device=device))  # [B, K] after it
        t = torch.arange(T, device=device)
        n = to_device(ctx.n_features, device)[:, None]
        context_pos = torch.where(t < n, first + t, first + K + t)  # a shorter row's padding lands past its block: scratch
        write_pos = torch.cat([context_pos, block_pos], dim=1)  # [B, T + K] slots, and positions: a token's slot is its position
        block = torch.full((B, K), self.mask_token_id, device=device)
        block[:, 0] = to_device(roots, device)
        x = self.embed(block)
        cos, sin = self.rotary(write_pos, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, layout, partial(self.cache.write, i, write_pos=write_pos, s_view=layout.n_keys), context)
        logits = self.draft_head(self.norm(x)[:, 1:])  # [B, K-1, V']: the root needs no draft
        return top_candidates(logits, roots, self.top_k, self.draft_vocab)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., h] -> full-vocabulary logits [..., V] (float32 at least); tokens outside the draft vocabulary get -inf."""
        return self.in_full_vocab(self.draft_head(hidden))

    def _append_context(self, features: torch.Tensor, n_features: list[int]) -> None:
        """Project newly verified tokens' target features [B, T, F] and cache every layer's K/V."""
        context = self.project(features.to(self.fc.weight.dtype))
        lengths = to_device(self.cache.lengths, context.device)
        write_pos = lengths[:, None] + torch.arange(context.shape[1], device=context.device)
        cos, sin = self.rotary(write_pos, context.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(context, cos, sin)
            self.cache.store(i, k, v, write_pos)
        self.cache.commit([list(range(n)) for n in n_features])

    # ---- shared by decoding and training ----------------------------------------------------
    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [.., len(layers) * h_target] -> context states [.., h]."""
        return self.hidden_norm(self.fc(features))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target.model.embed_tokens(tokens).to(self.fc.weight.dtype) * self.embedding_scale

    def block_hidden(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Training forward: many blocks per sequence in one pass.

        features [B, S, F] and tokens [B, S] of whole sequences; anchors [B, M] (the positions
        whose token roots a block). Each block sees the context strictly before its anchor (at
        decoding time the root's own features are not known yet) and itself, never another
        block. Returns the blocks' final hidden states [B, M, K, h]; position k of a block
        predicts the token at anchor + k.
        """
        B, S, _ = features.shape
        M, K = anchors.shape[1], self.block_size
        device = features.device
        context = self.project(features)
        cos_c, sin_c = self.rotary(torch.arange(S, device=device).expand(B, S), context.dtype)
        block = torch.full((B, M, K), self.mask_token_id, device=device)
        block[:, :, 0] = tokens.gather(1, anchors)
        x = self.embed(block).view(B, M * K, -1)
        block_pos = (anchors[:, :, None] + torch.arange(K, device=device)).view(B, M * K)
        cos_b, sin_b = self.rotary(block_pos, x.dtype)
        block_id = torch.arange(M * K, device=device) // K
        sees_context = torch.arange(S, device=device)[None, None, :] < anchors.repeat_interleave(K, dim=1)[:, :, None]
        sees_block = (block_id[:, None] == block_id[None, :]).expand(B, M * K, M * K)
        mask = torch.cat([sees_context, sees_block], dim=-1)[:, None]  # [B, 1, MK, S + MK]
        cos, sin = torch.cat([cos_c, cos_b], dim=2), torch.cat([sin_c, sin_b], dim=2)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, context=context)
        return self.norm(x).view(B, M, K, -1)

    # ---- checkpoints ------------------------------------------------------------------------

def check_fits(drafter: DFlashDrafter, target: Target) -> None:
    """Refuse a drafter trained for another target, in one sentence, before any decoding."""
    t, d, config = target.args, drafter.args, drafter.config
    problems = []
    if d.hidden_size != t.hidden_size:
        problems.append(f"hidden size {d.hidden_size} vs {t.hidden_size}")
    if config.get("vocab_size", t.vocab_size) != t.vocab_size:
        problems.append(f"vocab {config['vocab_size']} vs {t.vocab_size}")
    if config.get("num_target_layers", t.n_layers) != t.n_layers:
        problems.append(f"{config['num_target_layers']} target layers vs {t.n_layers}")
    if not all(0 <= i < t.n_layers for i in drafter.feature_layers):
        problems.append(f"target_layer_ids {list(drafter.feature_layers)} outside 0..{t.n_layers - 1}")
    if not 0 <= drafter.mask_token_id < t.vocab_size:
        problems.append(f"mask_token_id {drafter.mask_token_id} outside the vocab")
    if problems:
        raise ValueError(f"This DFlash drafter does not fit target {target.name}: {'; '.join(problems)}.")


def target_layer_ids(config: dict) -> tuple[int, ...]:
    """The target layers whose outputs a DFlash checkpoint's config says it reads."""
    return tuple((config.get("dflash_config") or {}).get("target_layer_ids", config.get("target_layer_ids")))


def new_dflash_config(target: Target, layers: int, block_size: int, target_layer_ids: list[int], mask_token_id: int,
                      draft_vocab_size: int | None = None) -> dict:
    """A Qwen3-style drafter config shaped like the target (so it shares embeddings and head)."""
    a = target.args
    dflash = {"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id}
    if draft_vocab_size:
        dflash["draft_vocab_size"] = draft_vocab_size
    return {
        "architectures": ["DFlashDraftModel"],
        **shaped_like(target, "qwen3", layers),
        "block_size": block_size,
        "num_target_layers": a.n_layers,
        "dflash_config": dflash,
    }


def evenly_spaced_layers(n_target_layers: int, n: int) -> list[int]:
    """Up to n distinct target layers from the second to the third-last, evenly spaced (DFlash's
    choice); shallow test targets get fewer layers rather than out-of-range ids."""
    if n == 1:
        return [n_target_layers // 2]
    first = min(1, n_target_layers - 1)
    last = max(first, n_target_layers - 3)
    return sorted({round(first + i * (last - first) / (n - 1)) for i in range(n)})


def load_dflash(target: Target, checkpoint: str | None, top_k: int = 8, block_size: int | None = None,
                dtype: str | None = None, int8: bool | str = False) -> DFlashDrafter:
    """`dtype`: the drafter's (models/target.py drafter_dtype: a name, auto, or None for the target's);
    `int8`: its linear layers and draft head by int8 weights (models/int8_linear.py int8_weights: true, false or auto)."""
    config, state = read_checkpoint(checkpoint, "dflash", target.name)
    drafter = DFlashDrafter(config, target, top_k=top_k, block_size=block_size)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{checkpoint} is not a DFlash checkpoint: missing {missing[:3]}, unexpected {unexpected[:3]}.")
    drafter = drafter.to(device=target.device, dtype=drafter_dtype(dtype, target.device, target.dtype)).eval()
    if int8_weights(int8, drafter):
        drafter.int8_head = True
        quantize_linears(drafter)
    return drafter
