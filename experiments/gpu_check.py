"""Everything a GPU can prove in one short run (issue #24): at paper scale, with no downloads.

    python experiments/gpu_check.py out.json                 # one H100/H200, a few minutes
    python experiments/gpu_check.py out.json --smoke         # every section on the CPU, a tiny shape
    PYTHONPATH=. python3 experiments/gpu_check.py out.json   # from the checkout, bastion not installed

It needs PyTorch, transformers, safetensors, numpy, scipy, PyYAML and tqdm, not the config stack
(hydra, omegaconf): a GPU machine's stock image runs it as it is.

A random-weight target shaped like Qwen3-8B (bf16) and a random drafter shaped like
z-lab/Qwen3-8B-DFlash-b16 stand in for the real models: none of the checks below needs trained
weights, and none of them may wait for a 16 GB download. Sections, each timed and each
recorded in the JSON even when another fails (its traceback in place of its figures):

- target: the random target, built on the device (`load_target(source="random")` draws every
  weight on the CPU first: 33 GB and minutes for 8B parameters);
- logits: our logits next to transformers' Qwen3ForCausalLM holding the same weight tensors;
- attention: flex and triton against SDPA's dense-mask path at paper scale (B=16, N=257 tree
  tokens after ~4k ragged prefixes), the fused-SDPA backend PyTorch picks for that mask, times;
  and single rows of a few N, where flex may take inductor's decoding kernel;
- forward: the target's forward by kernel at a few (B, N), and the profiler's busiest host ops
  of one: what the host spends per forward when the weights stream in ~3 ms;
- verify_latency: measured verify forwards, N x B, against the latency model's profile prior and
  its probe-calibrated fit (budget/latency.py);
- lossless: AR against best-first trees (a fixed budget and BASTION's) with the random drafter:
  exact equality, and `lossless_ties` (bench/divergence.py) where bf16 rounding can flip a near-tie;
- memory: the measured peak of a decode against models/memory.py's plan;
- host_step: the host's share of a decode step (experiments/host_step.py) on the big target;
- compiled_forward: decode.compile's forward, seconds to compile a shape and its time per forward;
- graphed_forward: the forward captured once as a CUDA graph and replayed, by kernel, next to the
  same forward eager: what removing the host's launches is worth, and whether the forward captures;
- graphed_decode: decode.compile in the engine (CUDA graphs replayed by torch.compile over the KV
  cache), AR and best-first decoding against eager AR: tokens, step times, graphs skipped.

The JSON is rewritten after every section, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from importlib import metadata
from pathlib import Path
from statistics import median

import numpy as np
import torch
import yaml

from bastion.bench.divergence import first_difference, gap_after, is_tie
from bastion.budget.controller import BastionBudget
from bastion.budget.fixed import FixedBudget
from bastion.budget.hardware import device_name, known_profiles, profile_from_config
from bastion.budget.latency import PROBE_SIZES, LatencyModel, probe
from bastion.drafters.dflash import DFlashDrafter, evenly_spaced_layers, new_dflash_config
from bastion.drafters.eagle3 import Eagle3Drafter, new_eagle3_config
from bastion.engine import generate
from bastion.files import atomic_write_text
from bastion.models.attention import Layout, attend, choose_kernel
from bastion.models.memory import GB, model_args, plan_memory
from bastion.models.target import Target, compile_forward
from bastion.models.timer import Clock
from bastion.models.transformer import ModelArgs, Transformer
from bastion.tree.best_first import best_first
from bastion.tree.draft_tree import DraftTree, pack
from host_step import step_split

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Scale:
    """The shapes and sizes of one run: the paper's on a GPU, or a tiny smoke run on the CPU."""

    target: str  # conf/target/<target>.yaml, whose `shape` (or random `hf_config`) the random target takes
    dtype: torch.dtype
    device: str
    kernels: tuple[str, ...]  # attention kernels compared with sdpa
    drafter_layers: int  # the random DFlash drafter: 5 layers, blocks of 16, 5 target layers as z-lab's
    block_size: int
    feature_layers: int
    mask_token_id: int
    logit_tokens: int  # the input logits are compared on
    attention_batch: int
    attention_nodes: int
    attention_prefix: tuple[int, int]  # verified tokens per row, drawn from this range
    decode_nodes: tuple[int, ...]  # N of single-row verifies, where inductor may pick flex's decoding kernel
    forward_shapes: tuple[tuple[int, int], ...]  # (B, N) of forwards timed by kernel, eager
    compiled_shapes: tuple[tuple[int, int], ...]  # (B, N) of forwards compiled (decode.compile)
    graph_shapes: tuple[tuple[int, int], ...]  # (B, N) of forwards captured as CUDA graphs
    grid_batches: tuple[int, ...]
    grid_nodes: tuple[int, ...]
    grid_context: int
    probe_sizes: tuple[int, ...]  # the start-up probe's forward sizes (budget/latency.py)
    repeats: int  # timed forwards per measurement (after one untimed)
    lossless_batch: int
    prompt_tokens: tuple[int, int]  # prompt lengths, drawn from this range
    lossless_tokens: int  # new tokens per prompt
    fixed_nodes: int
    memory_batch: int
    memory_context: int
    memory_tokens: int
    memory_nodes: int
    host_batches: tuple[int, ...]
    host_nodes: tuple[int, ...]
    host_tokens: int
    graphed_prompts: int  # prompts decoded one at a time by graphed_decode
    graphed_tokens: int
    graphed_nodes: int


PAPER = Scale(
    target="qwen3_8b", dtype=torch.bfloat16, device="cuda", kernels=("sdpa", "flex", "triton"),
    drafter_layers=5, block_size=16, feature_layers=5, mask_token_id=151669,  # z-lab Qwen3 drafters' mask token
    logit_tokens=32, attention_batch=16, attention_nodes=257, attention_prefix=(3584, 4096),
    decode_nodes=(1, 4, 16, 33, 64), forward_shapes=((1, 1), (1, 16), (1, 32), (16, 256)), compiled_shapes=((1, 1), (1, 16)),
    graph_shapes=((1, 1), (1, 16), (4, 64)),
    grid_batches=(1, 4, 16), grid_nodes=(1, 4, 16, 64, 256, 1024), grid_context=1024, probe_sizes=PROBE_SIZES,
    repeats=5,
    lossless_batch=4, prompt_tokens=(96, 160), lossless_tokens=128, fixed_nodes=64,
    memory_batch=16, memory_context=1024, memory_tokens=32, memory_nodes=256,
    host_batches=(1, 16), host_nodes=(16, 256), host_tokens=24,
    graphed_prompts=2, graphed_tokens=64, graphed_nodes=15,  # trees of 16 tokens: compiled_shapes' (1, 16)
)
SMOKE = Scale(
    target="tiny_qwen3", dtype=torch.float32, device="cpu",
    # Triton runs on a CPU only under its interpreter, chosen before triton is first imported.
    kernels=("sdpa", "flex") + (("triton",) if os.environ.get("TRITON_INTERPRET") == "1" else ()),
    drafter_layers=1, block_size=16, feature_layers=2, mask_token_id=16,
    logit_tokens=16, attention_batch=3, attention_nodes=17, attention_prefix=(8, 40),
    decode_nodes=(4,), forward_shapes=((1, 1), (2, 8)), compiled_shapes=((1, 4),), graph_shapes=((1, 4),),
    grid_batches=(1, 2), grid_nodes=(1, 4, 16), grid_context=32, probe_sizes=(1, 2, 4, 8, 16), repeats=2,
    lossless_batch=2, prompt_tokens=(8, 24), lossless_tokens=16, fixed_nodes=8,
    memory_batch=2, memory_context=32, memory_tokens=8, memory_nodes=16,
    host_batches=(1, 2), host_nodes=(4, 16), host_tokens=8,
    graphed_prompts=1, graphed_tokens=8, graphed_nodes=3,  # trees of 4 tokens: compiled_shapes' (1, 4)
)


def target_fields(name: str) -> dict:
    """A target preset's transformers config fields: a Hub model's `shape`, a random one's
    `hf_config`; an initializer_range where the preset has none (Qwen3's own, 0.02)."""
    entry = yaml.safe_load((ROOT / "conf" / "target" / f"{name}.yaml").read_text())
    return {"initializer_range": 0.02, **(entry.get("shape") or entry["hf_config"])}


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def randomize(module: torch.nn.Module, std: float, generator: torch.Generator) -> None:
    """_random_model's weights (models/target.py): norms 1 + 0.1 N(0, 1), the rest std N(0, 1),
    drawn where the parameters live."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1, generator=generator)
            else:
                p.normal_(0.0, std, generator=generator)


def random_target(name: str, fields: dict, dtype: torch.dtype, device: str, attention: str, seed: int = 0) -> Target:
    """load_target(source="random") built in place: the modules are created on `device` in
    `dtype` and drawn there, so 8B parameters take seconds and no host copy. No EOS: every row
    decodes all its tokens, so methods compare over the same lengths."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**fields)
    with torch.device(device), default_dtype(dtype):
        model = Transformer(ModelArgs.from_hf_config(config), config)
    randomize(model, config.initializer_range, torch.Generator(device).manual_seed(seed))
    return Target(model.eval(), None, f"{name}-random", config, attention=choose_kernel(attention, device))


class Run:
    """What the sections share, built when first asked for (a section that fails to build it
    records why, and the next one tries again)."""

    def __init__(self, scale: Scale, attention: str, cache_dir: Path):
        self.scale, self.attention, self.cache_dir = scale, attention, cache_dir
        self.cells: list[dict] = []  # the running section's cells so far (partial)

    def partial(self) -> list[dict]:
        """A list for the running section's cells, which run_section reports as they are if the
        section fails or runs out of time midway: a compile that takes the rest of its time
        limit keeps the shapes measured before it."""
        self.cells = []
        return self.cells

    @cached_property
    def target(self) -> Target:
        s = self.scale
        return random_target(s.target, target_fields(s.target), s.dtype, s.device, self.attention)

    @cached_property
    def drafter(self) -> DFlashDrafter:
        """A random DFlash drafter shaped like z-lab/Qwen3-8B-DFlash-b16: it accepts little, which
        the checks do not mind (losslessness holds for any drafter)."""
        s, target = self.scale, self.target
        layers = evenly_spaced_layers(target.args.n_layers, s.feature_layers)
        config = new_dflash_config(target, s.drafter_layers, s.block_size, layers, s.mask_token_id)
        top_k = yaml.safe_load((ROOT / "conf" / "drafter" / "dflash.yaml").read_text())["top_k"]
        with torch.device(s.device), default_dtype(s.dtype):
            drafter = DFlashDrafter(config, target, top_k=top_k)
        randomize(drafter, target.config.initializer_range, torch.Generator(s.device).manual_seed(1))
        return drafter.eval()

    @cached_property
    def eagle3(self) -> Eagle3Drafter:
        """A random EAGLE-3 drafter shaped like the target's released one (one layer as wide as
        the target, a 32000-token draft vocabulary as AngelSlim/Qwen3-8B_eagle3's), growing
        trees at EAGLE-3's paper settings (depth 7, top-k 10)."""
        s, target = self.scale, self.target
        vocab = min(32000, target.args.vocab_size)
        with torch.device(s.device), default_dtype(s.dtype):
            drafter = Eagle3Drafter(new_eagle3_config(target, vocab), target, top_k=10, depth=7)
        randomize(drafter, target.config.initializer_range, torch.Generator(s.device).manual_seed(2))
        drafter.d2t.zero_()  # drafts from the first `vocab` target tokens
        return drafter.eval()

    @cached_property
    def compiled(self) -> Target:
        """decode.compile's target (models/target.py compile_forward), shared by the sections that
        use it so that a shape one compiled (and on CUDA recorded) is not compiled again."""
        return compile_forward(self.target)

    @cached_property
    def hardware(self):
        """The profile run.py's gpu=auto picks: conf/gpu/<name>.yaml matched by the device's name."""
        return profile_from_config({"name": "auto"}, self.scale.device, known_profiles(ROOT / "conf" / "gpu"))


def random_prompts(n: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def random_trees(batch: int, nodes: int, vocab: int, seed: int) -> list[DraftTree]:
    """Trees of `nodes` tokens (root included) whose node i hangs below a random earlier node."""
    rng = random.Random(seed)
    trees = []
    for _ in range(batch):
        parents = [-1] + [rng.randrange(i) for i in range(1, nodes)]
        trees.append(DraftTree(tuple(rng.randrange(vocab) for _ in range(nodes)), tuple(parents), (0.0,) * nodes))
    return trees


def median_seconds(fn, device: str, repeats: int) -> float:
    """Median of `repeats` timed calls after an untimed one (compiles, caches), on the device's
    own clock (CUDA events)."""
    clock = Clock(torch.device(device))
    fn()
    times = []
    for _ in range(repeats):
        start = clock.mark()
        fn()
        times.append(clock.seconds(start, clock.mark()))
    return median(times)


# ---- sections ---------------------------------------------------------------------------------
def section_target(run: Run) -> dict:
    target = run.target
    out = {"name": target.name, "parameters": sum(p.numel() for p in target.model.parameters()),
           "dtype": str(target.dtype), "attention": target.attention, "shape": asdict(target.args)}
    if run.scale.device == "cuda":
        out["allocated_gb"] = torch.cuda.memory_allocated() / GB
    return out


def section_logits(run: Run) -> dict:
    """transformers' Qwen3ForCausalLM is built on the meta device and handed our weight tensors
    (the Hub's names, `model.` added), so the whole model is compared at no memory cost."""
    from transformers import AutoModelForCausalLM

    target = run.target
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(target.config, attn_implementation="sdpa")
    state = {(k if k == "lm_head.weight" else f"model.{k}"): v for k, v in target.model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"transformers' model does not take our weights: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    with torch.device(target.device):
        hf.model.rotary_emb = type(hf.model.rotary_emb)(target.config)  # its tables are buffers, not weights
    tokens = random_prompts(1, (run.scale.logit_tokens,) * 2, target.args.vocab_size, seed=3)[0]
    with torch.inference_mode():
        expected = hf.eval()(torch.tensor([tokens], device=target.device)).logits[0].float()  # [T, V]
    out = {"reference": "transformers AutoModelForCausalLM (sdpa), the same weight tensors",
           "layers": target.args.n_layers, "tokens": len(tokens), "max_abs_logit": float(expected.abs().max())}
    half = len(tokens) // 2
    out["kernel_from"] = half  # logits from here on came through the kernel
    for kernel in run.scale.kernels:
        ours = continued_logits(replace(target, attention=kernel), tokens, half).float()
        out[kernel] = {"max_abs_diff": float((ours - expected).abs().max()),
                       "max_abs_diff_through_kernel": float((ours[half:] - expected[half:]).abs().max()),
                       "argmax_agreement": float((ours.argmax(-1) == expected.argmax(-1)).float().mean())}
    return out


def continued_logits(target: Target, tokens: list[int], split: int) -> torch.Tensor:
    """Logits [T, V] of `tokens` by two forwards: tokens[:split] as a prompt, then the rest after
    its cached keys. A prompt's first chunk is plain causal attention, which every kernel hands
    to sdpa (models/attention.py); the second forward's layout goes through the kernel."""
    cache, out = target.new_cache(1, target.padded(len(tokens))), []
    for part in (tokens[:split], tokens[split:]):
        depths = torch.arange(len(part), device=target.device)[None]
        hidden, _ = target.forward(torch.tensor([part], device=target.device), depths, None, cache)
        cache.commit([list(range(len(part)))])
        out.append(target.logits(hidden[0]))
    return torch.cat(out)


@torch.inference_mode()  # as the engine's forwards run: compiled flex would otherwise compile again for grad mode
def section_attention(run: Run) -> dict:
    """Each kernel on one paper-scale verify: q/k/v drawn in the model's dtype, a random tree per
    row after a ragged verified prefix. Errors against sdpa (the library's dense-mask path) and
    against the same in float32; flex's block mask is built once, as a forward shares it."""
    s = run.scale
    q, k, v, layout = attention_inputs(s, s.attention_batch, s.attention_nodes, seed=0)
    exact = attend(q.float(), k.float(), v.float(), layout)
    sdpa = attend(q, k, v, layout)
    out = {"shape": {"B": q.shape[0], "H": q.shape[1], "Hkv": k.shape[1], "D": q.shape[3], "N": layout.n_new,
                     "prefix": layout.prefix.tolist(), "dtype": str(s.dtype)},
           "sdpa_backend": torch.nn.attention.SDPBackend(
               torch._fused_sdp_choice(q, k, v, attn_mask=layout.dense(), enable_gqa=q.shape[1] != k.shape[1])).name}
    for kernel in s.kernels:
        kernel_layout = replace(layout, kernel=kernel)
        got = attend(q, k, v, kernel_layout)
        out[kernel] = {"max_abs_err_vs_sdpa": float((got.float() - sdpa.float()).abs().max()),
                       "max_abs_err_vs_float32": float((got.float() - exact).abs().max()),
                       "median_ms": 1e3 * median_seconds(lambda: attend(q, k, v, kernel_layout), s.device, s.repeats)}
    if "flex" in s.kernels:
        flex_layout = lambda: replace(layout, kernel="flex")  # noqa: E731 (made with its block mask)
        out["flex"]["block_mask_ms"] = 1e3 * median_seconds(flex_layout, s.device, s.repeats)
    out["batch1"] = []  # one row: where flex may take inductor's decoding kernel (models/attention.py)
    for N in s.decode_nodes:
        out["batch1"].append({"N": N, **errors_vs_sdpa(s, *attention_inputs(s, 1, N, seed=N))})
    out["causal"] = []  # no tree: AR steps and later prompt chunks, after a verified prefix
    for N in (1, s.attention_nodes):
        out["causal"].append({"N": N, **errors_vs_sdpa(s, *attention_inputs(s, s.attention_batch, N, seed=N, tree=False))})
    return out


def errors_vs_sdpa(s: Scale, q, k, v, layout) -> dict:
    """Each kernel's largest difference from sdpa on one layout."""
    sdpa = attend(q, k, v, layout).float()
    return {f"{kernel}_max_abs_err_vs_sdpa": float((attend(q, k, v, replace(layout, kernel=kernel)).float() - sdpa).abs().max())
            for kernel in s.kernels}


def attention_inputs(s: Scale, B: int, N: int, seed: int, tree: bool = True):
    """q/k/v of one verify in the target's shape and dtype, and its Layout (sdpa): a random tree
    of N tokens per row (else N tokens in a causal run) after a verified prefix drawn from
    `attention_prefix`."""
    args = model_args(target_fields(s.target))
    g = torch.Generator(s.device).manual_seed(seed)
    prefix = torch.randint(s.attention_prefix[0], s.attention_prefix[1] + 1, (B,), generator=g, device=s.device)
    S = int(prefix.max()) + N
    q = torch.randn(B, args.n_heads, N, args.head_dim, generator=g, device=s.device).to(s.dtype)
    k, v = (torch.randn(B, args.n_kv_heads, S, args.head_dim, generator=g, device=s.device).to(s.dtype)
            for _ in range(2))
    mask = pack(random_trees(B, N, vocab=1, seed=seed), s.device)[2] if tree else None  # [B, N, N]
    return q, k, v, Layout(prefix, mask, N, S, "sdpa")


def verify_inputs(target: Target, B: int, N: int, context: int):
    """A cache of B rows holding `context` tokens each (forwards write past them and commit
    nothing) and a random tree of N tokens per row: forward's arguments."""
    cache = target.new_cache(B, context + N)
    cache.lengths = [context] * B
    tokens, depths, mask, *_ = pack(random_trees(B, N, target.args.vocab_size, seed=N), target.device)
    return tokens, depths, mask, cache


@torch.inference_mode()
def section_forward(run: Run) -> dict:
    """The target's forward by kernel at a few (B, N) after `grid_context` cached tokens, eager as
    a decode runs it, and where one eager forward's host time goes (the profiler's busiest host
    ops): at small N an 8B forward's weights stream in ~3 ms, so launches and guards can rule."""
    from torch.profiler import ProfilerActivity, profile

    s, target = run.scale, run.target
    cells = run.partial()
    for B, N in s.forward_shapes:
        cell = {"B": B, "N": N}
        for kernel in s.kernels:  # the kernel is the cache's (KVCache.prepare's layout): inputs made by each kernel's target
            kernel_target = replace(target, attention=kernel)
            inputs = verify_inputs(kernel_target, B, N, s.grid_context)
            cell[f"{kernel}_ms"] = 1e3 * median_seconds(lambda: kernel_target.forward(*inputs), s.device, s.repeats)
        cells.append(cell)
    B, N = s.forward_shapes[1]
    inputs = verify_inputs(target, B, N, s.grid_context)
    target.forward(*inputs)  # compiled for this shape before the profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device == "cuda" else [])
    with profile(activities=activities) as prof:
        target.forward(*inputs)
        if s.device == "cuda":
            torch.cuda.synchronize()
    ops = prof.key_averages()
    busiest = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:20]
    return {"context": s.grid_context, "cells": cells, "profile": {
        "B": B, "N": N, "kernel": target.attention,
        "aten_calls": sum(e.count for e in ops if e.key.startswith("aten::")),
        "self_cpu_ms": sum(e.self_cpu_time_total for e in ops) / 1e3,
        "self_device_ms": sum(e.self_device_time_total for e in ops) / 1e3,
        "busiest": [{"op": e.key, "count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                     "self_device_ms": e.self_device_time_total / 1e3} for e in busiest]}}


@torch.inference_mode()  # as the engine's forwards run (graphed_decode's too): a graph guards on its inputs' inference mode
def section_compiled_forward(run: Run) -> dict:
    """decode.compile's forward (models/target.py compile_forward: inductor, bucketed shapes): the
    seconds each shape takes to compile, then its time per forward next to the eager one's."""
    s, target = run.scale, run.compiled
    cells = run.partial()
    for B, N in s.compiled_shapes:
        # as graphed_decode's decodes will run them, so that it compiles nothing: AR steps without
        # features, trees with the drafter's (what a forward captures is part of its graph)
        capture = tuple(run.drafter.feature_layers) if N > 1 else ()
        inputs = verify_inputs(target, B, N, s.grid_context)
        started = time.perf_counter()
        target.forward(*inputs, capture=capture)
        if s.device == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - started
        eager = verify_inputs(run.target, B, N, s.grid_context)
        cells.append({"B": B, "N": N, "capture": list(capture), "compile_s": compile_s,
                      "compiled_ms": 1e3 * median_seconds(lambda: target.forward(*inputs, capture=capture), s.device, s.repeats),
                      "eager_ms": 1e3 * median_seconds(lambda: run.target.forward(*eager, capture=capture), s.device, s.repeats)})
    return {"context": s.grid_context, "kernel": target.attention, "cells": cells}


def graphed(fn, device: str):
    """`fn` captured as one CUDA graph, and a function that replays it and returns the outputs of
    the capture (static buffers, rewritten by every replay); on a CPU, which has no graphs, `fn`."""
    if device != "cuda":
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # lazy initialisation, workspaces and autotuning happen outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out

    return replay


@torch.inference_mode()
def section_graphed_forward(run: Run) -> dict:
    """The target's forward (inputs and cache as a decode step has them, the KV written in place)
    captured once as a CUDA graph and replayed, next to the same forward eager, by kernel: what a
    forward costs without the host's launches, which decode.compile does not remove yet, and
    whether each kernel's forward captures at all. A failed capture can leave the allocator
    inside it, spoiling every later CUDA call, so after one the remaining cells are not tried
    (each failure's traceback is recorded, the chained cause included)."""
    s = run.scale
    cells, failed = run.partial(), None
    for B, N in s.graph_shapes:
        cell = {"B": B, "N": N}
        for kernel in s.kernels:
            target = replace(run.target, attention=kernel)
            if failed:
                cell[kernel] = {"error": f"not tried: the capture of {failed} failed before"}
                continue
            stage = "eager"
            try:
                tokens, depths, mask, cache = verify_inputs(target, B, N, s.grid_context)
                write_pos, layout = cache.prepare(N, mask)
                positions = layout.prefix[:, None] + depths

                def forward():
                    return target.model(tokens, positions, layout, cache, write_pos)[0]  # [B, N, h]

                eager = forward().clone()
                stage = "capture"
                replay = graphed(forward, s.device)
                cell[kernel] = {"eager_ms": 1e3 * median_seconds(forward, s.device, s.repeats),
                                "graph_ms": 1e3 * median_seconds(replay, s.device, s.repeats),
                                "max_abs_diff": float((replay().float() - eager.float()).abs().max())}
                del replay
            except Exception as error:  # noqa: BLE001 (recorded in place of the cell's figures)
                cell[kernel] = {"error": f"{stage}: {type(error).__name__}: {error}".splitlines()[0],
                                "traceback": traceback.format_exc()}
                if stage == "capture":
                    failed = f"{kernel} at B={B}, N={N}"
        cells.append(cell)
    return {"context": s.grid_context, "graphs": s.device == "cuda", "cells": cells}


def section_verify_latency(run: Run) -> dict:
    """Verify forwards (the target's forward and the argmax greedy verification reads) of N tree
    tokens in each of B rows after `grid_context` cached ones, against the latency model: the
    hardware profile's prior, and its fit to the start-up probe (budget/latency.py)."""
    s, target = run.scale, run.target
    models = {name: LatencyModel.from_profile(target.args, target.dtype, run.hardware)
              for name in ("prior", "calibrated")}
    out = {"profile": asdict(run.hardware), "context": s.grid_context, "repeats": s.repeats}
    try:
        probe(target, models["calibrated"], sizes=s.probe_sizes)  # what calibrated() fits, without its cache file
    except ValueError as error:  # the probe refuses timings a busy machine disturbed
        out["calibrated_error"] = str(error)
        del models["calibrated"]
    cells = run.partial()
    for B in s.grid_batches:
        for N in s.grid_nodes:
            inputs = verify_inputs(target, B, N, s.grid_context)
            seconds = median_seconds(lambda: target.argmax(target.forward(*inputs)[0]), s.device, s.repeats)
            cell = {"B": B, "N": N, "measured_ms": 1e3 * seconds}
            for name, model in models.items():
                predicted = float(model.predict(np.full(B, N), np.full(B, s.grid_context)))
                cell[f"{name}_ms"], cell[f"{name}_error"] = 1e3 * predicted, predicted / seconds - 1
            cells.append(cell)
    for name in models:
        out[f"{name}_median_abs_error"] = float(np.median([abs(c[f"{name}_error"]) for c in cells]))
    return {**out, "cells": cells}


def divergence(target: Target, prompt: list[int], ar: list[int], ours: list[int]) -> dict | None:
    """bench/divergence.py's record of where `ours` first leaves AR's output, for token prompts
    (its `divergence` builds chat prompts from text): AR's logit gap between the two tokens
    under AR's context, and the gap a tie allows. Outputs here have no EOS, so equal lengths."""
    at = first_difference(ours, ar)
    return None if at is None else {"position": at, **gap_after(target, prompt + ar[:at], ar[at], ours[at])}


def section_lossless(run: Run) -> dict:
    s, target = run.scale, run.target
    prompts = random_prompts(s.lossless_batch, s.prompt_tokens, target.args.vocab_size, seed=4)
    ar = generate(target, prompts, max_new_tokens=s.lossless_tokens)
    bastion = BastionBudget(probe=False)  # the profile's prior: sizing does not change what is accepted
    bastion.start(target, run.hardware, run.cache_dir)
    out = {"prompts": [len(p) for p in prompts], "new_tokens": s.lossless_tokens, "ar_s": ar.wall_s}
    methods = {f"best_first+fixed{s.fixed_nodes}": (run.drafter, FixedBudget(s.fixed_nodes)),
               "best_first+bastion": (run.drafter, bastion),
               "eagle3+best_first+fixed59": (run.eagle3, FixedBudget(59))}  # EAGLE-3's 60 verified tokens
    for name, (drafter, budget) in methods.items():
        decoding = generate(target, prompts, drafter=drafter, policy=best_first, budget=budget,
                            max_new_tokens=s.lossless_tokens)
        found = [divergence(target, prompt, a.tokens, d.tokens)
                 for prompt, a, d in zip(prompts, ar.generations, decoding.generations)]
        produced, rows = (sum(sum(st.produced) for st in decoding.steps), sum(len(st.rows) for st in decoding.steps))
        out[name] = {"exact": all(f is None for f in found), "lossless_ties": all(map(is_tie, found)),
                     "divergences": [f for f in found if f is not None], "seconds": decoding.wall_s,
                     "tokens_per_step": produced / max(1, rows)}
    return out


def section_memory(run: Run) -> dict:
    """The peak a drafted decode allocates, weights included, against models/memory.py's plan
    for the same settings (on a CPU, the plan alone: no allocator to ask)."""
    s, target, drafter = run.scale, run.target, run.drafter
    B, context, new, nodes = s.memory_batch, s.memory_context, s.memory_tokens, s.memory_nodes
    plan = plan_memory(target.args, target.dtype, batch=B, context=context, max_new_tokens=new, max_nodes=nodes,
                       kernel=target.attention, drafter_params=sum(p.numel() for p in drafter.parameters()),
                       extra_tokens=drafter.extra_tokens(nodes), captured_layers=len(drafter.feature_layers),
                       drafter_kv_width=2 * drafter.args.n_layers * drafter.args.n_kv_heads * drafter.args.head_dim,
                       cuda=s.device == "cuda")
    out = {"batch": B, "context": context, "new_tokens": new, "nodes": nodes, "kernel": target.attention,
           "plan_gb": {part: n / GB for part, n in {**plan.resident, **plan.transients}.items()},
           "plan_peak_gb": plan.total / GB, "plan_largest_transient": plan.largest_transient, "measured_peak_gb": None}
    prompts = random_prompts(B, (context, context), target.args.vocab_size, seed=5)
    run.__dict__.pop("eagle3", None)  # the lossless section's EAGLE-3 drafter (~0.8 GB): not in this decode nor its plan
    if s.device == "cuda":
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
        out["allocated_before_gb"] = torch.cuda.memory_allocated() / GB
    generate(target, prompts, drafter=drafter, policy=best_first, budget=FixedBudget(nodes), max_new_tokens=new)
    if s.device == "cuda":
        out["measured_peak_gb"] = torch.cuda.max_memory_allocated() / GB
        out["measured_reserved_gb"] = torch.cuda.max_memory_reserved() / GB  # the allocator's, what an OOM counts
        out["plan_over_measured"] = out["plan_peak_gb"] / out["measured_peak_gb"]
    return out


def section_host_step(run: Run) -> dict:
    """experiments/host_step.py's split of a step (random candidates, no draft cost, a fixed
    budget) on this run's target: what the host adds to each verify forward."""
    s, cells = run.scale, run.partial()
    for B in s.host_batches:
        for N in s.host_nodes:
            total, forward, host = step_split(run.target, best_first, FixedBudget(N), B, s.host_tokens)
            cells.append({"B": B, "N": N, "step_ms": 1e3 * total, "forward_ms": 1e3 * forward, "host_ms": 1e3 * host})
    return {"new_tokens": s.host_tokens, "cells": cells}


def section_graphed_decode(run: Run) -> dict:
    """decode.compile as the engine runs it (models/target.py Compiled: on CUDA, torch.compile's
    CUDA graphs replayed over the KV buffers every cache views), AR and best-first with a fixed
    budget (the random drafter), one prompt at a time, against eager AR, at the shapes
    compiled_forward compiled (run after it, nothing compiles again): each one's tokens
    (compiled kernels round unlike eager ones: `lossless_ties`), its median step after the steps
    that compiled or recorded, and what inductor counted: graphs recorded and graphs skipped
    (a skip names a forward that runs without graphs, eagerly launched)."""
    from torch._dynamo.utils import counters

    s, target, graphed = run.scale, run.target, run.compiled
    # prompts of grid_context tokens, trees of a compiled shape's N: the shapes compiled_forward compiled
    prompts = random_prompts(s.graphed_prompts, (s.grid_context, s.grid_context), target.args.vocab_size, seed=6)
    before = {key: counters["inductor"][key] for key in ("cudagraph_skips", "cudagraph_recorded_non_static_inputs")}
    out = {"execution": graphed.execution, "kernel": target.attention, "new_tokens": s.graphed_tokens, "wall_s": {}}
    eager_tokens = []
    for name, decoder, drafter in (("eager_ar", target, None), ("graphed_ar", graphed, None),
                                   (f"graphed_best_first{s.graphed_nodes}", graphed, run.drafter)):
        steps, found, compile_s, started = [], [], 0.0, time.perf_counter()
        for prompt in prompts:
            decoding = generate(decoder, [prompt], drafter=drafter, policy=best_first, budget=FixedBudget(s.graphed_nodes),
                                max_new_tokens=s.graphed_tokens)
            if name == "eager_ar":
                eager_tokens.append(decoding.generations[0].tokens)
            else:
                found.append(divergence(target, prompt, eager_tokens[len(found)], decoding.generations[0].tokens))
            compile_s += sum(st.draft_s + st.verify_s + st.other_s for st in decoding.steps if st.compiled)
            steps += [st for st in decoding.steps if not st.compiled]
        out["wall_s"][name] = time.perf_counter() - started
        out[name] = {"step_ms": 1e3 * median(st.draft_s + st.verify_s + st.other_s for st in steps) if steps else None,
                     "verify_ms": 1e3 * median(st.verify_s for st in steps) if steps else None,
                     "tokens_per_step": sum(sum(st.produced) for st in steps) / max(1, len(steps)),
                     "compile_or_record_s": compile_s}
        if found:
            out[name].update(exact=all(f is None for f in found), lossless_ties=all(map(is_tie, found)),
                             divergences=[f for f in found if f is not None])
    out["recorded_graphs_inputs"] = counters["inductor"]["cudagraph_recorded_non_static_inputs"] - before["cudagraph_recorded_non_static_inputs"]
    out["skipped_graphs"] = counters["inductor"]["cudagraph_skips"] - before["cudagraph_skips"]
    return out


SECTIONS = {"target": section_target, "logits": section_logits, "attention": section_attention,
            "forward": section_forward, "verify_latency": section_verify_latency, "lossless": section_lossless,
            "memory": section_memory, "host_step": section_host_step, "compiled_forward": section_compiled_forward,
            "graphed_forward": section_graphed_forward, "graphed_decode": section_graphed_decode}


def plain(value):
    """A figure JSON cannot hold as it is: a numpy or torch scalar's number, anything else's text."""
    return value.item() if hasattr(value, "item") else str(value)


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


ALARM_REPEAT = 0.25  # seconds between a late section's alarms after the first (an import that fails may be retried, swallowing one)


class SectionTimeout(BaseException):
    """A section past --section-limit: a BaseException, so that no `except Exception` on the way
    (dynamo's and inductor's wrap or swallow what they catch) turns it into another error."""


def out_of_time(signum, frame):
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return  # never inside a CUDA graph capture, which would stay open: the alarm repeats
    raise SectionTimeout("past its time limit (--section-limit)")


def run_section(run: Run, section, limit: float) -> dict:
    """One section's figures, or its traceback; its seconds, and on CUDA its peak allocation. A
    section still running after `limit` seconds (0: none) is stopped by an alarm, so one that
    hangs (a compile that never ends) costs its limit and not the sections after it."""
    cuda = run.scale.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started, run.cells = time.perf_counter(), []
    signal.signal(signal.SIGALRM, out_of_time)
    signal.setitimer(signal.ITIMER_REAL, limit, ALARM_REPEAT if limit else 0)  # again and again: library code may swallow one
    try:
        result = {"ok": True, **section(run)}
        if cuda:
            torch.cuda.synchronize()  # its queued work counts in its time, and its errors here
    except (Exception, SectionTimeout) as error:  # every section runs and reports, whatever another one raised
        signal.setitimer(signal.ITIMER_REAL, 0)
        summary = f"{type(error).__name__}: {error}".splitlines()[0]
        result = {"ok": False, "error": summary, "traceback": traceback.format_exc(), "partial_cells": run.cells}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    result["seconds"] = time.perf_counter() - started
    if cuda:
        result["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / GB
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Paper-scale checks on one GPU, one JSON out (module docstring).")
    parser.add_argument("out", nargs="?", default=str(Path(os.environ.get("OUT", ".")) / "gpu_check.json"))
    parser.add_argument("--smoke", action="store_true", help="every section on the CPU with a tiny shape (~1 min)")
    parser.add_argument("--attention", default="auto", help="the target's kernel: auto, sdpa, flex, triton")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"some of {', '.join(SECTIONS)}, comma-separated, run in that order")
    parser.add_argument("--deadline", type=float, default=0.0,
                        help="seconds after which the sections not yet started are skipped (0: none): a run killed at "
                             "a time limit loses the section it was in, a deadline below the limit loses none")
    parser.add_argument("--section-limit", type=float, default=0.0,
                        help="seconds after which a running section is stopped and recorded as failed (0: none)")
    args = parser.parse_args(argv)
    scale = SMOKE if args.smoke else PAPER
    if scale.device == "cuda" and not torch.cuda.is_available():
        print("torch sees no CUDA device: run this on a GPU machine, or with --smoke to check it on the CPU.",
              file=sys.stderr)
        return 2
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        print(f"Unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}.", file=sys.stderr)
        return 2
    report = {"device": device_name(scale.device), "torch": torch.__version__,
              "cuda": torch.version.cuda, "triton": version("triton"), "transformers": version("transformers"),
              "smoke": args.smoke, "target": scale.target, "dtype": str(scale.dtype), "sections": {}}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache_dir:  # budgets start with one; nothing is left behind
        run = Run(scale, args.attention, Path(cache_dir))
        for name in dict.fromkeys(args.only.split(",")):  # in the order asked for: what matters most first, within the deadline
            section = SECTIONS[name]
            if args.deadline and time.perf_counter() - started > args.deadline:
                skipped = f"skipped: past the {args.deadline:g} s deadline"
                result = report["sections"][name] = {"ok": False, "error": skipped, "seconds": 0.0}
            else:
                result = report["sections"][name] = run_section(run, section, args.section_limit)
            report["wall_s"] = time.perf_counter() - started
            atomic_write_text(args.out, json.dumps(report, indent=1, default=plain))
            last = "" if result["ok"] else ": " + result["error"]
            print(f"{name:<15} {'ok' if result['ok'] else 'FAILED'} in {result['seconds']:.1f} s{last}", flush=True)
    print(f"{args.out}: {report['wall_s']:.0f} s on {report['device']}")
    return 0 if all(r["ok"] for r in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
