"""The target model: the frozen LLM whose outputs speculative decoding must reproduce."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from bastion.models.kv_cache import KVCache
from bastion.models.loading import resolve_source
from bastion.models.transformer import ModelArgs, Rotary, Transformer

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Target:
    """A decoder and its tokenizer, with the three operations speculative decoding needs:
    forward a batch of token trees against a KV cache, read logits, and (on the cache) commit
    the accepted path."""

    model: Transformer
    tokenizer: object | None  # a transformers tokenizer; None for token-level test models
    name: str
    config: object  # the transformers config the model was built from
    eos_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def args(self) -> ModelArgs:
        return self.model.args

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        a = self.args
        return KVCache(a.n_layers, batch, a.n_kv_heads, a.head_dim, capacity, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, tokens, depths, tree_mask, cache: KVCache, capture: tuple[int, ...] = ()):
        """Run N new tokens per row after each row's verified prefix.

        tokens, depths: [B, N] (depth = offset from the row's next free position); tree_mask:
        [B, N, N]. The tokens' KV is written to the cache but kept only by `cache.commit`.
        Returns final hidden states [B, N, h] and the `capture` layers' outputs [B, N, F].
        """
        write_pos, mask = cache.prepare(tree_mask)
        positions = torch.tensor(cache.lengths, device=self.device)[:, None] + depths
        return self.model(tokens, positions, mask, cache, write_pos, capture)

    @torch.inference_mode()
    def score(self, sequence: list[int]) -> torch.Tensor:
        """Logits [N, V] at every position of one sequence, from a fresh cache: the reference
        that every cached, tree-shaped or batched forward must reproduce."""
        n = len(sequence)
        cache = self.new_cache(1, n)
        causal = torch.ones(1, n, n, dtype=torch.bool, device=self.device).tril()
        depths = torch.arange(n, device=self.device)[None]
        hidden, _ = self.forward(torch.tensor([sequence], device=self.device), depths, causal, cache)
        return self.logits(hidden[0])

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., h] -> [..., V] in float32 (float64 for float64 models)."""
        return self.model.lm_head(hidden).to(torch.promote_types(self.dtype, torch.float32))


def load_target(
    name: str,
    source: str,
    dtype: str = "float32",
    device: str = "cpu",
    hf_config: dict | None = None,
    tokenizer: str | None = None,
    seed: int = 0,
) -> Target:
    """Build a Target from a config entry (see conf/target/*.yaml and models/loading.py)."""
    from transformers import AutoConfig, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"Unknown dtype '{dtype}'; choose one of {', '.join(DTYPES)}.")
    torch_dtype = DTYPES[dtype]
    if source == "random":
        if hf_config is None:
            raise ValueError(f"Target '{name}' has source=random but no hf_config.")
        config = AutoConfig.for_model(**hf_config)
        model = _random_model(config, seed, torch_dtype, device)
        tok = AutoTokenizer.from_pretrained(resolve_source(tokenizer)) if tokenizer else None
    else:
        path = resolve_source(source)
        config = AutoConfig.from_pretrained(path)
        model = _load_model(path, config, torch_dtype, device)
        tok = AutoTokenizer.from_pretrained(resolve_source(tokenizer) if tokenizer else path)
    return Target(model.eval(), tok, name, config, frozenset(_eos_ids(config, tok)))


def _eos_ids(config, tokenizer) -> set[int]:
    ids = set()
    for source in (config, getattr(tokenizer, "generation_config", None)):
        eos = getattr(source, "eos_token_id", None)
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _random_model(config, seed: int, dtype, device) -> Transformer:
    generator = torch.Generator().manual_seed(seed)
    model = Transformer(ModelArgs.from_hf_config(config), config)
    std = config.initializer_range
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(std * torch.randn(p.shape, generator=generator))
    return model.to(device=device, dtype=dtype)


def _load_model(path: Path, config, dtype, device) -> Transformer:
    args = ModelArgs.from_hf_config(config)
    with torch.device("meta"):
        model = Transformer(args, config)
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        for key, value in load_file(file, device=str(device)).items():
            if "rotary_emb" not in key:
                state[key.removeprefix("model.")] = value.to(dtype)
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (args.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"Weights in {path} do not match a {args.arch} model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(config)  # built on the meta device above
    return model
