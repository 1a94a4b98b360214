"""EAGLE-3: an autoregressive drafter over the target's low, middle and high features.

One decoder layer reads, at each position p, the token at p + 1 (embedded with the target's
frozen embeddings) beside a feature of position p: for verified tokens the target's hidden
states at three layers, concatenated and fused by `fc`; for drafted ones its own output there
(EAGLE-3 trains on its own outputs: training-time test). The logits of its output over a
draft vocabulary give the token at p + 2 (`d2t` maps a draft id to the target's:
target = draft + d2t[draft]).

Drafting grows a tree as EAGLE-2 does: the root's top-k children; then, depth - 1 times, the
k likeliest leaves (by path probability) each run one step and offer their own top-k
children (fewer times where the budget can use no deeper tree: DraftContext.max_depth, which
the BASTION controller keeps a level below the trees it chose last, so a draft forward per
level is not spent on levels it cuts). Every candidate goes to the tree policy as a
TreeProposal: best-first takes the N likeliest (EAGLE-2's rerank), chain and static follow
sibling ranks. The tree's steps see the
verified context's cached keys and values and their own ancestors' (written past the cache's
verified length, so the next step's context overwrites them).

Checkpoints use the released format (SafeAILab/EAGLE, SpecForge): a Llama-style config.json
with `draft_vocab_size` (and `target_hidden_size` where the target is wider), the target
layers in `eagle_config.eagle_aux_hidden_state_layer_ids` where given (the layers whose input
is taken, vLLM's convention; by default 2, L/2 and L-3), and weights `fc.weight`,
`midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d` in safetensors or
pytorch_model.bin. A checkpoint's `embed_tokens.weight`, a copy of the target's, is not
needed: the target's own embedding is used (a drafter narrower than its target keeps its own).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from torch import nn
from transformers import AutoConfig

from bastion.drafters.base import DraftContext, Drafter
from bastion.drafters.checkpoint import read_checkpoint, shaped_like
from bastion.models.kv_cache import KVCache
from bastion.models.target import Target
from bastion.models.transfer import to_device
from bastion.models.transformer import MLP, Attention, ModelArgs, RMSNorm, Rotary
from bastion.tree.proposal import TreeProposal


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer ("midlayer"): attention reads the normed token embedding and the
    normed feature side by side; the residual stream is the feature."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        h = args.hidden_size
        self.self_attn = Attention(args, input_size=2 * h)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, args.rms_norm_eps)

    def forward(self, embeds, feature, cos, sin, mask, extend_kv=None):
        """embeds, feature: [B, N, h] -> [B, N, h]."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)
        h = feature + self.self_attn(x, cos, sin, mask, extend_kv)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module, Drafter):
    proposes_trees = True

    def __init__(self, config: dict, target: Target, top_k: int = 10, depth: int = 7):
        super().__init__()
        if top_k < 1 or depth < 1:
            raise ValueError(f"drafter.top_k and drafter.depth must be at least 1 (got {top_k} and {depth}).")
        self.config, self.top_k, self.depth = config, top_k, depth
        hf_config = AutoConfig.for_model(**{**config, "model_type": "llama"})
        self.args = ModelArgs.from_hf_config(hf_config)
        self.feature_layers = feature_layers(config, target.args.n_layers)
        target_width = int(config.get("target_hidden_size") or self.args.hidden_size)
        check_fits(self, target, target_width)
        h = self.args.hidden_size
        self.fc = nn.Linear(3 * target_width, h, bias=False)
        self.midlayer = Eagle3Layer(self.args)
        self.norm = RMSNorm(h, self.args.rms_norm_eps)
        draft_vocab = int(config.get("draft_vocab_size") or self.args.vocab_size)
        if top_k > draft_vocab:  # every node grows top_k children
            raise ValueError(f"drafter.top_k={top_k} is more than this drafter's {draft_vocab}-token draft vocabulary.")
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))  # draft id -> target id - draft id
        self.register_buffer("t2d", torch.zeros(self.args.vocab_size, dtype=torch.bool))  # target ids in the draft vocabulary
        self.embed_tokens = nn.Embedding(self.args.vocab_size, h) if h != target.args.hidden_size else None
        self.rotary = Rotary(hf_config)
        self.target = target  # a plain dataclass: its weights are shared, not registered here
        self.cache: KVCache | None = None

    # ---- decoding ---------------------------------------------------------------------------
    def reset(self, batch_size: int, capacity: int) -> None:
        a, weight = self.args, self.fc.weight
        # the tree's steps write top_k entries each past the verified length
        self.cache = None  # the last decode's freed before the next one's is made
        self.cache = KVCache(1, batch_size, a.n_kv_heads, a.head_dim, capacity + self.top_k * self.depth, weight.dtype, weight.device)

    def keep_rows(self, rows: list[int]) -> None:
        self.cache.keep_rows(rows)

    @torch.inference_mode()
    def absorb(self, ctx: DraftContext) -> None:
        self._append_context(ctx)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> TreeProposal:
        last = self._append_context(ctx)  # [B, h]: the output that predicts the root's children
        roots = [seq[-1] for seq in ctx.sequences]
        B, k, h, device = len(roots), self.top_k, last.shape[-1], last.device
        lengths = to_device(self.cache.lengths, device)  # [B]: the root's children run at these positions
        logp, ids = self.top_children(last[:, None])  # [B, 1, k] each
        every = torch.arange(k, device=device)
        tokens, parents = [to_device(roots, device)[:, None], ids[:, 0]], [torch.full((B, 1), -1, device=device), every.new_zeros(B, k)]
        logq, ranks = [logp.new_zeros(B, 1), logp[:, 0]], [every.new_zeros(B, 1), every.expand(B, k)]
        beam, beam_logq, n_candidates = 1 + every.expand(B, k), logp[:, 0], 1 + k  # [B, k]: the leaves to grow, as candidate ids
        beam_tokens, beam_feature = ids[:, 0], last[:, None].expand(B, k, h)
        itself = torch.eye(k, dtype=torch.bool, device=device).expand(B, k, k)  # each leaf's own new entry
        sees = itself  # [B, k, E]: tree entries each leaf sees
        depth = min(self.depth, ctx.max_depth or self.depth)  # a draft forward per depth: none the budget cannot use
        for step in range(1, depth):
            E = step * k  # tree entries once this step's are written
            write_pos = lengths[:, None] + (E - k) + every  # [B, k]
            S = max(self.cache.lengths) + E
            j = torch.arange(S, device=device) - lengths[:, None]  # [B, S]: slot -> tree entry
            mask = (j < 0)[:, None, :] | ((j < E)[:, None, :] & sees.gather(2, j.clamp(0, E - 1)[:, None, :].expand(B, k, S)))
            cos, sin = self.rotary((lengths + step - 1)[:, None].expand(B, k), beam_feature.dtype)
            out = self.midlayer(self.embed(beam_tokens), beam_feature, cos, sin, mask[:, None],
                                partial(self.cache.write, 0, write_pos=write_pos, s_view=S))  # [B, k, h]
            logp, ids = self.top_children(out)  # [B, k, k]
            children = (beam_logq[:, :, None] + logp).flatten(1)  # [B, k * k]
            tokens.append(ids.flatten(1))
            parents.append(beam.repeat_interleave(k, dim=1))
            logq.append(children)
            ranks.append(every.repeat(k).expand(B, -1))
            top = children.topk(k, dim=1)
            slot = top.indices // k  # [B, k]: each new leaf's parent in the beam
            beam, beam_logq, n_candidates = n_candidates + top.indices, top.values, n_candidates + k * k
            beam_tokens = ids.flatten(1).gather(1, top.indices)
            beam_feature = out.gather(1, slot[..., None].expand(-1, -1, h))
            sees = torch.cat([sees.gather(1, slot[..., None].expand(-1, -1, E)), itself], 2)
        depths = np.repeat(np.arange(depth + 1), [1, k] + [k * k] * (depth - 1))  # [C]: the root, k children, then k * k a step
        return TreeProposal(roots, torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(logq, 1), torch.cat(ranks, 1), depths)

    def _append_context(self, ctx: DraftContext) -> torch.Tensor:
        """Run the newly verified positions (their target features beside the token after each)
        and cache their keys and values; return each row's last output [B, h]."""
        features, n = ctx.features, ctx.n_features  # [B, T, F]
        T, device = features.shape[1], features.device
        following = [seq[len(seq) - m:] + [0] * (T - m) for seq, m in zip(ctx.sequences, n)]  # ends with the root
        write_pos, layout = self.cache.prepare(T)
        feature = self.fc(features.to(self.fc.weight.dtype))
        cos, sin = self.rotary(write_pos, feature.dtype)
        out = self.midlayer(self.embed(to_device(following, device)), feature, cos, sin, layout,
                            partial(self.cache.write, 0, write_pos=write_pos, s_view=layout.n_keys))
        self.cache.commit([list(range(m)) for m in n])
        return out[torch.arange(len(n), device=device), to_device(n, device) - 1]

    # ---- shared by decoding and training ----------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else self.target.model.embed_tokens
        return table(tokens).to(self.fc.weight.dtype)

    def draft_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., h] -> log-probabilities over the draft vocabulary [..., V_draft] (float32 at least)."""
        logits = self.lm_head(self.norm(hidden))
        return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)

    def top_children(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, N, h] -> the top_k children of each: log-probabilities and target token ids [B, N, k]."""
        top = self.draft_logprobs(hidden).topk(self.top_k, dim=-1)
        return top.values, top.indices + self.d2t[top.indices]

    def unrolled(self, features: torch.Tensor, tokens: torch.Tensor, steps: int, first: int = 0) -> list[torch.Tensor]:
        """Training forward (EAGLE-3's training-time test): `steps` draft steps of every chain at
        once. features [B, P, 3 h_target] of positions 0..P-1, tokens [B, P + 1] (padded with
        anything). Index q holds the chain whose verified context ends at position q: its step
        j reads the token at q + 1 + j beside step j - 1's output (the fused target features
        for j = 0), sits at position q + j, sees step 0's keys at positions <= q and its own
        earlier steps' keys, and predicts the token at q + 2 + j, as tree drafting does on the
        path of those tokens. Only the chains from index `first` on are unrolled (those whose
        tokens carry loss: the prompt's positions are needed as context only). Returns each
        step's outputs for those chains [B, P - first, h]."""
        B, P, _ = features.shape
        device = features.device
        tokens = torch.nn.functional.pad(tokens, (0, steps))  # the last chains' steps read padding: no label there
        index = torch.arange(first, P, device=device)  # the chains unrolled
        n = len(index)
        context = torch.arange(P, device=device)[None, :] <= index[:, None]  # [n, P]: step 0's keys a chain sees
        keys, values, outputs = [], [], []

        def extend(k, v):
            keys.append(k)
            values.append(v)
            return torch.cat(keys, 2), torch.cat(values, 2)

        feature = self.fc(features.to(self.fc.weight.dtype))  # step 0 runs every position: the context's keys
        cos, sin = self.rotary(torch.arange(P, device=device).expand(B, P), feature.dtype)
        full = self.midlayer(self.embed(tokens[:, 1 : 1 + P]), feature, cos, sin, torch.ones(P, P, dtype=torch.bool, device=device).tril()[None, None], extend)
        feature = full[:, first:]
        outputs.append(feature)
        for j in range(1, steps):
            cos, sin = self.rotary((index + j).expand(B, n), feature.dtype)
            mask = torch.cat([context, *[torch.eye(n, dtype=torch.bool, device=device)] * j], 1)  # [n, P + j n]: a chain's own earlier steps at its index
            feature = self.midlayer(self.embed(tokens[:, first + 1 + j : first + 1 + j + n]), feature, cos, sin, mask[None, None], extend)
            outputs.append(feature)
        return outputs

    # ---- checkpoints ------------------------------------------------------------------------

def feature_layers(config: dict, n_target_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs EAGLE-3 reads: the config's layer ids name the layers
    whose input is taken (vLLM's convention), by default 2, L/2 and L-3 (SafeAILab/EAGLE)."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = ids or [min(2, n_target_layers), max(1, n_target_layers // 2), max(1, n_target_layers - 3)]  # shallow test targets too
    return tuple(int(i) - 1 for i in ids)


def check_fits(drafter: Eagle3Drafter, target: Target, target_width: int) -> None:
    """Refuse a drafter made for another target, in one sentence, before any decoding."""
    t, config = target.args, drafter.config
    problems = []
    if target_width != t.hidden_size:
        problems.append(f"target hidden size {target_width} vs {t.hidden_size}")
    if config.get("vocab_size", t.vocab_size) != t.vocab_size:
        problems.append(f"vocab {config['vocab_size']} vs {t.vocab_size}")
    if len(drafter.feature_layers) != 3 or not all(0 <= i < t.n_layers for i in drafter.feature_layers):
        problems.append(f"feature layers {[i + 1 for i in drafter.feature_layers]} are not three of 1..{t.n_layers}")
    if problems:
        raise ValueError(f"This EAGLE-3 drafter does not fit target {target.name}: {'; '.join(problems)}.")


def new_eagle3_config(target: Target, draft_vocab_size: int | None = None) -> dict:
    """A Llama-style EAGLE-3 config as wide as the target (so it shares its embeddings)."""
    a = target.args
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **shaped_like(target, "llama", 1),
        "draft_vocab_size": draft_vocab_size or a.vocab_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in feature_layers({}, a.n_layers)]},
    }


def load_eagle3(target: Target, checkpoint: str | None, top_k: int = 10, depth: int = 7) -> Eagle3Drafter:
    config, state = read_checkpoint(checkpoint, "eagle3", target.name)
    drafter = Eagle3Drafter(config, target, top_k=top_k, depth=depth)
    if drafter.embed_tokens is None:
        state.pop("embed_tokens.weight", None)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{checkpoint} is not an EAGLE-3 checkpoint of this shape: missing {missing[:3]}, unexpected {unexpected[:3]}.")
    mapped = torch.arange(len(drafter.d2t)) + drafter.d2t
    if mapped.min() < 0 or mapped.max() >= target.args.vocab_size:
        raise ValueError(f"{checkpoint}'s d2t maps draft tokens outside the target's vocabulary of {target.args.vocab_size}.")
    return drafter.to(device=target.device, dtype=target.dtype).eval()
