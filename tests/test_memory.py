"""The memory plan counts what a decode really allocates, and run.py prints it or refuses a run
that does not fit, before any weights load."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from bastion.budget.fixed import FixedBudget
from bastion.drafters.ngram import NgramDrafter
from bastion.engine import generate
from bastion.models.memory import check_fits, model_args, parameter_count, plan_memory
from bastion.models.transformer import Transformer
from bastion.tree.chain import chain
from tests.conftest import ROOT

PRESETS = sorted(p.stem for p in (ROOT / "conf" / "target").glob("*.yaml") if "shape" in OmegaConf.load(p))
PUBLISHED = {  # parameter counts of the Hub checkpoints (model cards, safetensors metadata)
    "llama31_8b": 8_030_261_248,
    "qwen25_coder_0p5b": 494_032_768,
    "qwen3_4b": 4_022_468_096,
    "qwen3_8b": 8_190_735_360,
    "smollm2_135m": 134_515_008,
}


def shape(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "target" / f"{name}.yaml").shape)


def test_every_hub_preset_has_a_shape():
    assert PRESETS == sorted(PUBLISHED)


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_shape_builds_its_model_and_counts_its_parameters(name):
    from transformers import AutoConfig

    config = AutoConfig.for_model(**shape(name))
    args = model_args(shape(name))
    with torch.device("meta"):
        model = Transformer(args, config)
    assert parameter_count(args) == sum(p.numel() for p in model.parameters()) == PUBLISHED[name]


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama"])
def test_weight_bytes_are_the_model_parameters(fixture, request):
    target = request.getfixturevalue(fixture)  # float64: untied with qk-norm, and tied
    plan = plan_memory(target.args, target.dtype, 1, 16, 8, 0, "sdpa")
    assert plan.target_weights == sum(p.numel() * p.element_size() for p in target.model.parameters())


@pytest.mark.slow
def test_smollm2_shape_and_weights_match_the_real_model(smollm2):
    args = model_args(shape("smollm2_135m"))
    assert dataclasses.replace(args, rms_norm_eps=smollm2.args.rms_norm_eps) == smollm2.args
    assert args.rms_norm_eps == pytest.approx(smollm2.args.rms_norm_eps)  # the GGUF stores it in float32
    plan = plan_memory(args, torch.float32, 1, 16, 8, 0, "sdpa")
    assert plan.target_weights == sum(p.numel() for p in smollm2.model.parameters()) * 4


def test_kv_bytes_are_what_the_engine_allocates(tiny_qwen3, monkeypatch):
    allocated = []
    new_cache = tiny_qwen3.new_cache

    def recording(batch, capacity):
        cache = new_cache(batch, capacity)
        allocated.append(cache.k.nbytes + cache.v.nbytes)
        return cache

    monkeypatch.setattr(tiny_qwen3, "new_cache", recording)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10, 11, 12, 9, 10, 11]]
    generate(tiny_qwen3, prompts, drafter=NgramDrafter(), policy=chain, budget=FixedBudget(5), max_new_tokens=6)
    plan = plan_memory(tiny_qwen3.args, tiny_qwen3.dtype, 2, 11, 6, 5, "sdpa")
    assert allocated == [plan.kv_cache]


class WideDrafter(NgramDrafter):
    def extra_tokens(self, max_nodes: int) -> int:
        return 3 * (max_nodes + 1)


@pytest.mark.parametrize("compiled", [False, True])
def test_kv_bytes_count_a_drafters_extra_tokens_and_compiled_buckets(tiny_qwen3, compiled, monkeypatch):
    target = dataclasses.replace(tiny_qwen3, compiled=object() if compiled else None)  # only its shapes are used

    def recording(batch, capacity):
        raise StopIteration(capacity)

    monkeypatch.setattr(target, "new_cache", recording)
    with pytest.raises(StopIteration) as allocated:
        generate(target, [[5, 6, 7] * 100], drafter=WideDrafter(), policy=chain, budget=FixedBudget(5), max_new_tokens=6)
    plan = plan_memory(target.args, target.dtype, 1, 300, 6, 5, "sdpa", extra_tokens=18, compiled=compiled)
    a = target.args
    assert 2 * a.n_layers * a.n_kv_heads * allocated.value.value * a.head_dim * 8 == plan.kv_cache
    assert allocated.value.value == (512 if compiled else 300 + 6 + 6 + 18)  # compiled: the prompt's bucket


def test_a_flexdraft_plan_counts_its_mask_groups():
    from hydra import compose, initialize_config_dir

    from bastion.bench.plan import drafter_checkpoints, memory_plan
    from bastion.compose import plan_methods

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["target=smollm2_135m", "drafter=flexdraft", "budget=fixed", "budget.nodes=16"])
    drafters, absent = drafter_checkpoints([p for p in plan_methods(cfg) if p.node is not None])
    assert [(name, path.resolve()) for name, path in drafters] == [("flexdraft", ROOT / "checkpoints" / "flexdraft_smollm2_135m")]
    assert absent == []
    plan, plain = memory_plan(cfg, 16, drafters, cuda=True), memory_plan(cfg, 16, [], cuda=True)
    fixed = cfg.plan_context + cfg.decode.max_new_tokens
    assert plan.kv_cache * (fixed + 17) == plain.kv_cache * (fixed + 17 + 17 * 8)  # 17 mask groups of 8 (its config.json)
    assert plan.drafter_weights > 0


@pytest.mark.parametrize("drafter,layers", [("dflash", 5), ("eagle3", 3)])
def test_a_plan_counts_the_target_features_a_drafter_reads(drafter, layers):
    """A prefill keeps the outputs of the layers a drafter reads for every prompt token (each
    layer's, their concatenation, the engine's buffer): more than the MLP's on Qwen3-8B."""
    from hydra import compose, initialize_config_dir

    from bastion.bench.plan import drafter_checkpoints, memory_plan
    from bastion.compose import plan_methods

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["target=smollm2_135m", f"drafter={drafter}", "budget=fixed", "budget.nodes=16"])
    drafters, _ = drafter_checkpoints([p for p in plan_methods(cfg) if p.node is not None])
    plan = memory_plan(cfg, 16, drafters, cuda=True)
    assert plan.transients["prefill features"] == 3 * layers * cfg.decode.batch_size * cfg.plan_context * 576 * 4
    assert memory_plan(cfg, 16, [], cuda=True).transients["prefill features"] == 0
    # and its own KV cache over the target's slots, as wide as its layers' keys and values (3 KV heads of 64, as the target's)
    drafter_layers = {"dflash": 2, "eagle3": 1}[drafter]
    assert plan.drafter_kv_cache * 30 == plan.kv_cache * drafter_layers  # SmolLM2: 30 layers


def test_a_plan_over_the_memory_names_its_largest_part():
    args = model_args(shape("llama31_8b"))
    plan = plan_memory(args, torch.float32, 1, 1024, 128, 16, "flex")
    check_fits(plan, 80 * 10**9, "a100")
    with pytest.raises(ValueError, match=r"largest part is the target weights \(32.1 GB\): use a smaller target.dtype"):
        check_fits(plan, 24 * 10**9, "test GPU")
    sdpa = plan_memory(args, torch.bfloat16, 16, 4096, 128, 256, "sdpa")
    # the math backend's float32 scores and softmax, K and V upcast to float32 (8 heads) and repeated to 32 heads
    keys = 4096 + 128 + 257
    assert sdpa.transients["verify attention scores"] == 2 * 16 * 32 * 257 * keys * 4 + 2 * 16 * (8 + 32) * keys * 128 * 4
    assert sdpa.total == sdpa.target_weights + sdpa.kv_cache + sdpa.transients["verify attention scores"]
    assert plan_memory(args, torch.float32, 16, 4096, 128, 256, "sdpa").transients["verify attention scores"] == \
        2 * 16 * 32 * 257 * keys * 4 + 2 * 16 * 32 * keys * 128 * 4  # float32: nothing to upcast
    # flex builds no score matrix; its block mask is two int32 index tables per (query block, key block) and the tree
    flex = plan_memory(args, torch.bfloat16, 16, 4096, 128, 1024, "flex").transients
    assert flex["verify attention scores"] == 0 and flex["verify block mask"] == 16 * (9 * 42 * 8 + 1025**2)
    # greedy verification takes the argmax 32 tokens at a time (2^26 logits), and so do keyed scores at T > 0 (with
    # float32 logits and float64 temporaries); sampled children make one row's logits at a time, a level of the descent
    assert sdpa.transients["verify logits"] == 16 * 32 * 128256 * 2
    ranked = plan_memory(args, torch.bfloat16, 16, 4096, 128, 256, "sdpa", sampled=True)
    assert ranked.transients["verify logits"] == 16 * 32 * 128256 * (2 + 4 + 32)
    sampled = plan_memory(args, torch.bfloat16, 16, 4096, 128, 256, "sdpa", sampled=True, ranked=False)
    assert sampled.transients["verify logits"] == 16 * 128256 * (2 + 4 + 64)


def run_py(tmp_path, *overrides):
    """run.py offline, with empty caches: anything it tried to download or load would fail."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    return subprocess.run([sys.executable, "run.py", *overrides, f"hydra.run.dir={tmp_path / 'run'}",
                           f"cache_dir={tmp_path / 'cache'}"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)


def test_plan_prints_the_table_without_loading_anything(tmp_path):
    result = run_py(tmp_path, "target=qwen3_8b", "gpu=h100", "decode.batch_size=16", "plan=true")
    assert result.returncode == 0, result.stderr
    assert "target weights             16.38 GB  8,190,735,360 parameters x 2 B" in result.stdout
    assert "KV cache                   10.57 GB  2 x 36 layers x 16 rows x 8 heads x 4481 slots" in result.stdout
    assert "peak                       31.79 GB" in result.stdout
    assert "not counted: the drafter z-lab/Qwen3-8B-DFlash-b16" in result.stdout and "Fits:" in result.stdout
    assert not (tmp_path / "cache").exists() and not (tmp_path / "hf").exists()


def test_a_run_too_big_for_the_gpu_is_refused_before_any_download(tmp_path):
    result = run_py(tmp_path, "target=qwen3_8b", "gpu=a100", "decode.batch_size=16", "plan_context=16384")
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "largest part is the KV cache" in result.stderr and "lower decode.batch_size, budget.max_nodes" in result.stderr


def test_a_target_without_a_shape_cannot_be_planned():
    from hydra import compose, initialize_config_dir

    from bastion.bench.cli import run

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["target=qwen3_8b", "~target.shape", "gpu=h100", "plan=true"])
    with pytest.raises(ValueError, match=r"Target qwen3_8b has no shape to plan from: add a `shape:` block"):
        run(cfg)
