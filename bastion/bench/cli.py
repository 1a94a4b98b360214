"""`python run.py`: compose, validate cheaply, then decode and report."""

from __future__ import annotations

from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from bastion.bench.datasets import load_prompts
from bastion.bench.metrics import with_oracle
from bastion.bench.runner import run_methods
from bastion.compose import build, build_methods, resolve_device
from bastion.sampling import Sampling


def run(cfg: DictConfig) -> None:
    OmegaConf.set_struct(cfg, False)
    cfg.device = resolve_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    Sampling(cfg.decode.temperature, cfg.decode.top_k, cfg.decode.top_p, cfg.decode.tree_mode)  # validate early
    if cfg.decode.max_new_tokens < 1:
        raise ValueError(f"decode.max_new_tokens must be at least 1 (got {cfg.decode.max_new_tokens}).")
    if cfg.decode.batch_size < 1:
        raise ValueError(f"decode.batch_size must be at least 1 (got {cfg.decode.batch_size}).")
    if cfg.budget.name != "oracle":
        build(cfg.budget)  # an impossible budget fails here, before any model loads
    b = cfg.bench
    prompts = load_prompts(b.name, b.get("limit"), b.get("data_dir"), b.get("shuffle", False), b.get("seed", 0), b.get("path"), b.get("field"))
    target = build(cfg.target, name=cfg.target.name)
    methods = build_methods(cfg, target)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    d = cfg.decode
    sampling = Sampling(d.temperature, d.top_k, d.top_p, d.tree_mode)
    summary = run_methods(target, methods, prompts, b.name, out_dir, d.max_new_tokens, d.batch_size, cfg.warmup, sampling, cfg.seed)
    if cfg.budget.name == "oracle":
        swept = [m.name for m in methods[1:]]
        summary = with_oracle(summary, swept, f"{cfg.drafter.name}+{cfg.tree.name}+oracle")
        summary.to_csv(out_dir / "summary.csv", index=False)
    print(summary.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"records: {out_dir / 'results.jsonl'}\nsummary: {out_dir / 'summary.csv'}")
