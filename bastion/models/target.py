"""The target model: the frozen LLM whose outputs speculative decoding must reproduce."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from bastion.files import read_json
from bastion.models.attention import choose_kernel
from bastion.models.cpu import has_amx
from bastion.models.dynamo import allow_recompiles
from bastion.models.kv_cache import KVCache
from bastion.models.loading import resolve_source
from bastion.models.transformer import ModelArgs, Rotary, Transformer

KEY_BUCKET = 512  # a compiled target attends over a multiple of this many key slots
ARGMAX_CHUNK = 1 << 26  # logits computed at once by Target.argmax (256 MB in float32)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Compiled:
    """decode.compile's forward of a target's model (compile_forward): torch.compile's capture,
    which on CUDA also replays CUDA graphs (mode reduce-overhead), one per bucketed shape: a
    forward is then one launch, where eagerly it was thousands (experiments/gpu_h200.md). Graphs
    replay over fixed addresses, so every KV cache of a graphed target is a view of the same
    buffers (one cache at a time)."""

    forward: Callable
    graphs: bool
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # graphs: keys and values [L, B, Hkv, S, D], the largest asked for

    def __call__(self, *args):
        if not self.graphs:
            return self.forward(*args)
        torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs are no longer read (cloned below)
        hidden, features = self.forward(*args)
        return hidden.clone(), None if features is None else features.clone()  # the next replay rewrites them

    def kv_buffers(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers of at least `shape` [L, B, Hkv, S, D]: the same ones while they are large enough
        (new ones move the graphs' addresses: each re-records once)."""
        if self.buffers is None or any(have < need for have, need in zip(self.buffers[0].shape, shape)):
            grown = tuple(shape) if self.buffers is None else tuple(map(max, self.buffers[0].shape, shape))
            self.buffers = None  # the old ones are freed first
            self.buffers = torch.zeros(grown, dtype=dtype, device=device), torch.zeros(grown, dtype=dtype, device=device)
        return self.buffers


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
    chat_args: dict = field(default_factory=dict)  # the chat template's keyword arguments (Qwen3: enable_thinking)
    attention: str = "sdpa"  # the attention kernel of its forwards (models/attention.py)
    compiled: Compiled | None = None  # decode.compile: the captured forward (compile_forward), else None

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
        """A KV cache of at least `capacity` slots per row (cache_slots: a compiled target's are bucketed)."""
        a = self.args
        slots = cache_slots(capacity, self.compiled is not None)
        if self.execution != "graphed":
            return KVCache(a.n_layers, batch, a.n_kv_heads, a.head_dim, slots, self.dtype, self.device, self.attention)
        buffers = self.compiled.kv_buffers((a.n_layers, batch, a.n_kv_heads, slots, a.head_dim), self.dtype, self.device)
        return KVCache(a.n_layers, batch, a.n_kv_heads, a.head_dim, buffers[0].shape[3], self.dtype, self.device, self.attention, buffers)

    @property
    def execution(self) -> str:
        """How its forwards run: `eager`, `compiled` (decode.compile) or `graphed` (decode.compile
        on CUDA: replayed CUDA graphs)."""
        if self.compiled is None:
            return "eager"
        return "graphed" if self.compiled.graphs else "compiled"

    @torch.inference_mode()
    def forward(self, tokens, depths, tree_mask, cache: KVCache, capture: tuple[int, ...] = ()):
        """Run N new tokens per row after each row's verified prefix.

        tokens, depths: [B, N] (depth = offset from the row's next free position); tree_mask:
        [B, N, N], or None for tokens that see each other causally (a prompt). The tokens' KV is
        written to the cache but kept only by `cache.commit`. Returns final hidden states
        [B, N, h] and the `capture` layers' outputs [B, N, F].

        A compiled target runs bucketed shapes (see compile_forward): N padded to a power of two
        (padding tokens see only themselves in a tree, and causally in a prompt; their outputs are
        dropped), the attended keys to a multiple of KEY_BUCKET. A graphed one runs prompts
        (tree_mask None) eagerly: a prompt's forward is compute-bound, its launches a sliver of
        it, and a graph per prompt shape would keep that shape's activations in the graphs' pool.
        Its steps also pad the rows to a power of two (at most the rows its KV buffers hold; the
        padding rows see only their own tokens): each batch size compiles and records graphs of its
        own, for every N and key bucket, and a decode of 16 rows leaving one by one would compile
        16 times as many, past dynamo's limit (models/dynamo.py), after which it runs eagerly.
        """
        (B, n), width = tokens.shape, self.padded(tokens.shape[1])
        batch = min(token_bucket(B), cache.rows_held) if self.execution == "graphed" and tree_mask is not None else B
        if width > n or batch > B:
            tokens, depths = (F.pad(x, (0, width - n, 0, batch - B)) for x in (tokens, depths))
            if tree_mask is not None:
                padded = torch.eye(width, dtype=torch.bool, device=tokens.device).repeat(batch, 1, 1)
                padded[:B, :n, :n] = tree_mask
                tree_mask = padded
        if batch > B:
            cache = cache.padded(batch)
        write_pos, layout = cache.prepare(width, tree_mask, key_bucket=1 if self.compiled is None else KEY_BUCKET)
        eager = self.compiled is None or (self.compiled.graphs and tree_mask is None)
        forward = self.model if eager else self.compiled
        hidden, features = forward(tokens, layout.prefix[:, None] + depths, layout, cache, write_pos, capture)
        return hidden[:B, :n], None if features is None else features[:B, :n]

    def padded(self, n: int) -> int:
        """The tokens a forward of n runs: n, or its bucket when compiled."""
        return n if self.compiled is None else token_bucket(n)

    @torch.inference_mode()
    def score(self, sequence: list[int], positions: slice = slice(None)) -> torch.Tensor:
        """Logits [N, V] at every position of one sequence (or at `positions` of them: a long
        sequence's float32 logits take GBs), from a fresh cache: the reference that every
        cached, tree-shaped or batched forward must reproduce."""
        n = len(sequence)
        cache = self.new_cache(1, self.padded(n))
        depths = torch.arange(n, device=self.device)[None]
        hidden, _ = self.forward(torch.tensor([sequence], device=self.device), depths, None, cache)
        return self.logits(hidden[0, positions])

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., h] -> [..., V] in float32 (float64 for float64 models)."""
        return self.model.lm_head(hidden).to(torch.promote_types(self.dtype, torch.float32))

    @torch.inference_mode()
    def argmax(self, hidden: torch.Tensor, chunk_elements: int = ARGMAX_CHUNK, score=None) -> torch.Tensor:
        """hidden [B, M, h] -> the likeliest next token after each [B, M]: logits(hidden).argmax(-1)
        without a float32 copy of the logits (upcasting cannot change an argmax) and a few
        tokens' logits at a time (B=16, M=257, V=152k: 2.5 GB in float32 at once). A GPU's
        matmul may round a chunk's near-ties unlike a whole forward's, as it rounds an AR step's
        unlike a tree's (lossless_ties). With `score`, the argmax of score(logits, columns), a
        chunk's float32 logits [B, m, V] and the slice of the M columns they are (keyed
        sampling's log p + Gumbel noise, float64: 8x the logits' memory if taken at once)."""
        B, M, _ = hidden.shape
        step = max(1, chunk_elements // (B * self.args.vocab_size))
        if score is None:
            return torch.cat([self.model.lm_head(part).argmax(-1) for part in hidden.split(step, dim=1)], dim=1)
        columns = [slice(i, i + step) for i in range(0, M, step)]
        return torch.cat([score(self.logits(hidden[:, c]), c).argmax(-1) for c in columns], dim=1)


def token_bucket(n: int) -> int:
    """The tokens a compiled forward of n runs: the next power of two, so a decode compiles few shapes."""
    return 1 << (n - 1).bit_length()


def cache_slots(n: int, compiled: bool) -> int:
    """The KV slots a decode that needs n gets: n, or for a compiled target n rounded up to a
    multiple of KEY_BUCKET, since the cache's shape is part of what a compiled forward was
    compiled for: a capacity of its own per batch would recompile every bucket for every batch."""
    return -(-n // KEY_BUCKET) * KEY_BUCKET if compiled else n


def dtype_named(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"Unknown dtype '{name}'; choose one of {', '.join(DTYPES)}.")
    return DTYPES[name]


def fast_bfloat16(device: str | torch.device) -> bool:
    """Whether bfloat16 matmuls beat float32 ones on `device`: on CUDA, and on CPUs with AMX
    tiles or AVX512-BF16 instructions. On CPUs with neither oneDNN's bfloat16 path is slower
    than float32 (experiments/NOTES.md)."""
    if str(device).startswith("cuda"):
        return torch.cuda.is_bf16_supported()
    return torch.backends.mkldnn.is_available() and (has_amx(device) or torch.cpu._is_avx512_bf16_supported())


def drafter_dtype(choice: str | None, device: str | torch.device, target_dtype: torch.dtype) -> torch.dtype:
    """A drafter's dtype: `choice` by name, the target's (None), or `auto`: bfloat16 where its
    matmuls are fast on `device`, else the target's. A drafter only proposes, so its rounding
    changes which tokens are drafted, never the output, while bfloat16 halves the bytes its
    weights stream each step."""
    if choice == "auto":
        return torch.bfloat16 if fast_bfloat16(device) else target_dtype
    return target_dtype if choice is None else dtype_named(choice)


def compile_forward(target: Target, graphs: bool | None = None) -> Target:
    """decode.compile=true: the target's forward captured by torch.compile (inductor's fused
    kernels), replayed as CUDA graphs on CUDA (Compiled; `graphs` forces either way: a CPU, which
    has none, then runs the same mode, buffers and marks without them). Target.forward buckets
    shapes, so a decode compiles a few graphs once each: one per batch size, token bucket and
    key bucket."""
    check_compilable(target.attention, target.device)
    allow_recompiles()
    graphs = target.device.type == "cuda" if graphs is None else graphs
    forward = torch.compile(target.model, dynamic=False, mode="reduce-overhead" if graphs else None)
    return replace(target, compiled=Compiled(forward, graphs))


def check_compilable(kernel: str, device: str | torch.device) -> None:
    """Refuse decode.compile where its forward would be wrong: FlexAttention on a CPU, whose
    inductor template (torch 2.13) reads the keys of every layer after the first from the wrong
    place in the KV cache when compiled inside the forward (experiments/NOTES.md)."""
    if kernel == "flex" and torch.device(device).type == "cpu":
        raise ValueError("decode.compile=true with attention=flex computes wrong attention on a CPU (torch's CPU "
                         "FlexAttention template misreads the KV cache's layers): use attention=sdpa, the CPU default.")


def load_target(
    name: str,
    source: str,
    dtype: str = "float32",
    device: str = "cpu",
    hf_config: dict | None = None,
    tokenizer: str | None = None,
    seed: int = 0,
    cache_dir: str | None = None,
    chat_template_args: dict | None = None,
    attention: str = "auto",
) -> Target:
    """Build a Target from a config entry (see conf/target/*.yaml and models/loading.py);
    packaged models are converted under `cache_dir` (compose.build_target passes the run's).
    `chat_template_args` go to the tokenizer's chat template wherever a prompt is built;
    `attention` names the attention kernel (auto: the device's; models/attention.py)."""
    from transformers import AutoConfig, AutoTokenizer

    torch_dtype = dtype_named(dtype)
    choose_kernel(attention, device)  # an unknown kernel is refused before any weights load
    if source == "random":
        if hf_config is None:
            raise ValueError(f"Target '{name}' has source=random but no hf_config.")
        config = AutoConfig.for_model(**hf_config)
        model = _random_model(config, seed, torch_dtype, device)
        tok = AutoTokenizer.from_pretrained(resolve_source(tokenizer, cache_dir)) if tokenizer else None
        generation = {}
    else:
        path = resolve_source(source, cache_dir)
        config = _read_config(path)
        model = _load_model(path, config, torch_dtype, device)
        tok = AutoTokenizer.from_pretrained(resolve_source(tokenizer, cache_dir) if tokenizer else path)
        file = path / "generation_config.json"
        generation = read_json(file, "restore it from the model's source") if file.exists() else {}
    # the rotary frequencies are a plain attribute, which model.to(device) leaves on the host: moved before a
    # compiled forward's first call, whose graph would otherwise hold a host tensor (and get no CUDA graph)
    model.rotary.inv_freq = model.rotary.inv_freq.to(device)
    return Target(model.eval(), tok, name, config, frozenset(_eos_ids(config, generation, tok)), dict(chat_template_args or {}),
                  choose_kernel(attention, device))


def _read_config(path: Path):
    """The model directory's transformers config; a config.json that is not JSON (an OSError
    from transformers, so a traceback) or names no model_type is refused naming the file."""
    from transformers import AutoConfig

    file = path / "config.json"
    fields = read_json(file, "restore it from the model's source")
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ValueError(f"{file} names no model_type; restore it from the model's source (the transformers config "
                         f"of the weights beside it).")
    return AutoConfig.from_pretrained(path)


def _eos_ids(config, generation: dict, tokenizer) -> set[int]:
    """Every id that ends a turn: the config's, generation_config.json's (where instruct models
    such as Qwen3's list the ids a chat turn can end with beside config.json's one) and the
    tokenizer's."""
    ids = set()
    for eos in (getattr(config, "eos_token_id", None), generation.get("eos_token_id")):
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
    files = sorted(path.glob("*.safetensors"))
    _check_weights(path, files, model, args)  # headers only: no tensor is read before all are known to fit
    state = {}
    for file in files:
        for key, value in load_file(file, device=str(device)).items():
            if name := _model_key(key, args):
                state[name] = value.to(dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(config)  # built on the meta device above
    return model


def _model_key(key: str, args: ModelArgs) -> str | None:
    """A checkpoint tensor's name in our Transformer; None for tensors it rebuilds itself (the
    rotary tables, a tied lm_head)."""
    if "rotary_emb" in key:
        return None
    key = key.removeprefix("model.")
    return None if args.tie_word_embeddings and key == "lm_head.weight" else key


def _check_weights(path: Path, files: list[Path], model: Transformer, args: ModelArgs) -> None:
    """Refuse, naming the file, weights that cannot load into a model built from config.json:
    none at all, a file cut short or not safetensors, a tensor missing, extra or of another
    shape. Only the files' headers are read."""
    if not files:
        raise ValueError(f"{path} holds no *.safetensors weights; bastion reads safetensors only.")
    expected = {k: list(v.shape) for k, v in model.state_dict().items() if _model_key(k, args)}
    found = {}
    for file in files:
        try:
            with safe_open(file, "pt") as weights:
                for key in weights.keys():
                    if name := _model_key(key, args):
                        found[name] = (file, weights.get_slice(key).get_shape())
        except SafetensorError as error:
            raise ValueError(f"{file} is not a readable safetensors file ({error}); it is probably cut short: "
                             f"download or convert it again.") from None
    missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"Weights in {path} do not match a {args.arch} model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}.")
    for key, (file, shape) in found.items():
        if shape != expected[key]:
            raise ValueError(f"{file} holds {key} of shape {shape} where {path / 'config.json'} implies "
                             f"{expected[key]}: the config and the weights come from different models.")
