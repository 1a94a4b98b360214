"""`python run.py`: compose, validate cheaply, then decode and report."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from bastion.bench import wandb_logger
from bastion.bench.datasets import load_prompts
from bastion.bench.metrics import with_oracle
from bastion.bench.runner import run_methods, summarize_run
from bastion.compose import build, build_methods, build_target, method_config, resolve_device
from bastion.report import load, write_report
from bastion.sampling import Sampling


def run(cfg: DictConfig) -> None:
    OmegaConf.set_struct(cfg, False)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and cfg.device in ("auto", "cuda") and torch.cuda.is_available():
        cfg.device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}"  # torchrun: one GPU per process
    cfg.device = resolve_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    d = cfg.decode
    sampling = Sampling(d.temperature, d.top_k, d.top_p, d.tree_mode)
    if cfg.decode.max_new_tokens < 1:
        raise ValueError(f"decode.max_new_tokens must be at least 1 (got {cfg.decode.max_new_tokens}).")
    if cfg.decode.batch_size < 1:
        raise ValueError(f"decode.batch_size must be at least 1 (got {cfg.decode.batch_size}).")
    for spec in OmegaConf.to_container(cfg.methods) if cfg.get("methods") else [{}]:
        node = method_config(cfg, spec)  # an unknown choice or impossible budget fails here, before any model loads
        if node.budget.name != "oracle":
            build(node.budget)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    logger = wandb_logger.start(OmegaConf.to_container(cfg, resolve=True), out_dir) if rank == 0 else None  # logger=wandb only
    b = cfg.bench
    names = list(b.names) if b.name == "all" else [b.name]
    prompts = {n: load_prompts(n, b.get("limit"), b.get("data_dir"), b.get("shuffle", False), b.get("seed", 0), b.get("path"), b.get("field")) for n in names}
    if world > 1 and "hydra.run.dir" not in " ".join(HydraConfig.get().overrides.hydra):
        raise ValueError("Under torchrun every process must write to the same run dir: add hydra.run.dir=outputs/NAME.")
    target = build_target(cfg)
    methods = build_methods(cfg, target)
    shard = f".rank{rank}" if world > 1 else ""
    for name in names:  # under torchrun each process decodes every world-th prompt
        run_methods(target, methods, prompts[name][rank::world], name, out_dir, d.max_new_tokens, d.batch_size, cfg.warmup,
                    sampling, cfg.seed, shard, tuple(d.stop))
    if world > 1:
        wait_for_all_ranks()
        if rank:
            return
    summary = summarize_run(out_dir, prompts)
    for oracle in dict.fromkeys(m.oracle for m in methods if m.oracle):
        summary = with_oracle(summary, [m.name for m in methods if m.oracle == oracle], oracle)
    summary.to_csv(out_dir / "summary.csv", index=False)
    if logger is not None:
        wandb_logger.log_steps(logger, load([out_dir])[1])
        wandb_logger.log_summary(logger, summary, write_report([out_dir]))
        wandb_logger.finish(logger)
    print(summary.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"records: {out_dir / 'results.jsonl'}\nsummary: {out_dir / 'summary.csv'}")


def wait_for_all_ranks() -> None:
    """torchrun: every process has written its records before rank 0 merges them."""
    import torch.distributed as dist

    if not dist.is_initialized():  # joined only now, so a slow rank's decoding is not bound by a timeout
        dist.init_process_group("gloo", timeout=timedelta(days=1))
    dist.barrier()
    dist.destroy_process_group()
