"""`python run.py`: compose, validate cheaply, then decode and report."""

from __future__ import annotations

import logging
import math
import os
from datetime import timedelta
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from bastion.bench import wandb_logger
from bastion.bench.datasets import check_prompt_lengths, load_prompts
from bastion.bench.metrics import with_oracle
from bastion.bench.plan import check_memory, print_plan
from bastion.bench.provenance import SUMMARY_FIELDS, write_machine, write_summary
from bastion.bench.report import load, write_report
from bastion.bench.rundir import check_run_dir, locked
from bastion.bench.runner import run_methods, summarize_run
from bastion.compose import (
    build,
    build_methods,
    build_target,
    command_line_overrides,
    method_settings,
    plan_methods,
    replace_dict_overrides,
    resolve_device,
)
from bastion.drafters.checkpoint import resolve_checkpoint
from bastion.files import atomic_write_text
from bastion.models.attention import choose_kernel
from bastion.models.target import check_compilable
from bastion.sampling import Sampling

logger = logging.getLogger(__name__)  # Hydra's job logging: the console and the run dir's run.log


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# What each run setting must hold. Hydra passes a mistyped value through as it is
# (`decode.max_new_tokens=abc` is the string 'abc'), which would fail only deep inside decoding.
# The ranges of temperature, top_k and top_p are Sampling's to check.
SETTINGS = {
    "seed": ("a whole number", _whole),
    "threads": ("null or a whole number >= 1", lambda v: v is None or _whole(v) and v >= 1),
    "warmup": ("true or false", lambda v: isinstance(v, bool)),
    "fresh": ("true or false", lambda v: isinstance(v, bool)),
    "plan": ("true or false", lambda v: isinstance(v, bool)),
    "plan_context": ("a whole number >= 1", lambda v: _whole(v) and v >= 1),
    "decode.max_new_tokens": ("a whole number >= 1", lambda v: _whole(v) and v >= 1),
    "decode.compile": ("true or false", lambda v: isinstance(v, bool)),
    "decode.batch_size": ("a whole number from 1 to 16 (the engine's ragged rows are tested up to 16)",
                          lambda v: _whole(v) and 1 <= v <= 16),
    "decode.temperature": ("a number", _number),
    "decode.top_k": ("a whole number", _whole),
    "decode.top_p": ("a number", _number),
    "decode.stop": ("a list of strings (decode.stop=[A,B])",
                    lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "bench.limit": ("null or a whole number >= 1", lambda v: v is None or _whole(v) and v >= 1),
    "bench.shuffle": ("true or false", lambda v: isinstance(v, bool)),
}


def check_settings(cfg: DictConfig) -> None:
    """Refuse a mistyped or out-of-range run setting in one sentence, before any model loads."""
    for key, (expected, valid) in SETTINGS.items():
        value = OmegaConf.select(cfg, key)
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        if not valid(value):
            raise ValueError(f"{key} must be {expected} (got {value!r}).")


def run(cfg: DictConfig) -> None:
    OmegaConf.set_struct(cfg, False)
    replace_dict_overrides(cfg, command_line_overrides())
    check_settings(cfg)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and cfg.device in ("auto", "cuda") and torch.cuda.is_available():
        cfg.device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}"  # torchrun: one GPU per process
        torch.cuda.set_device(cfg.device)  # and its streams, events and context there, not on GPU 0
    cfg.device = resolve_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    d = cfg.decode
    if d.get("compile"):
        check_compilable(choose_kernel(cfg.get("attention", "auto"), cfg.device), cfg.device)
    sampling = Sampling(d.temperature, d.top_k, d.top_p, d.tree_mode)
    plans = plan_methods(cfg)  # an unknown choice, impossible budget or missing drafter checkpoint fails here, before any model loads
    drafting = [p for p in plans if p.node is not None]
    max_nodes = max((build(p.budget).max_nodes for p in drafting), default=0)
    if cfg.plan:
        print_plan(cfg, drafting, max_nodes)
        return
    check_memory(cfg, drafting, max_nodes)  # before a drafter or the target downloads
    for plan in drafting:
        if plan.node.drafter.get("checkpoint"):
            resolve_checkpoint(plan.node.drafter.checkpoint)
    b = cfg.bench
    names = list(b.names) if b.name == "all" else [b.name]
    prompts = {n: load_prompts(n, b.get("limit"), b.get("data_dir"), b.get("shuffle", False), b.get("seed", 0), b.get("path"), b.get("field")) for n in names}
    if world > 1 and "hydra.run.dir" not in " ".join(HydraConfig.get().overrides.hydra):
        raise ValueError("Under torchrun every process must write to the same run dir: add hydra.run.dir=outputs/NAME.")
    if world > 1 and cfg.fresh:
        raise ValueError("fresh=true sets a run dir's results aside in one process: run it without torchrun, or choose a new hydra.run.dir.")
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    shard = f".rank{rank}" if world > 1 else ""
    with locked(out_dir, shard):  # from the settings check to the last record: no other run changes the dir meanwhile
        settings = {plan.name: method_settings(cfg, plan) for plan in plans}
        check_run_dir(out_dir, settings, cfg.fresh)
        if rank == 0:
            write_config(cfg, out_dir)
            write_machine(cfg, out_dir)
        wandb_run = wandb_logger.start(OmegaConf.to_container(cfg, resolve=True), out_dir) if rank == 0 else None  # logger=wandb only
        target = build_target(cfg)
        check_prompt_lengths(target, prompts, d.max_new_tokens)
        methods = build_methods(cfg, target, plans, settings)
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
    write_summary(summary, out_dir / "summary.csv")
    if wandb_run is not None:
        wandb_logger.log_steps(wandb_run, load([out_dir])[1])
        wandb_logger.log_summary(wandb_run, summary, write_report([out_dir]))
        wandb_logger.finish(wandb_run)
    machine = summary[list(SUMMARY_FIELDS)].iloc[0]
    logger.info("%s", summary.drop(columns=["note", *SUMMARY_FIELDS]).to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    logger.info("measured on %s", ", ".join(f"{key} {machine[key]}" for key in SUMMARY_FIELDS))
    for row in summary[summary.note.fillna("") != ""].itertuples():
        logger.info("note: %s on %s: %s", row.method, row.bench, row.note)
    records = sorted(out_dir.glob("results*.jsonl"))  # what the summary read: torchrun's ranks write results.rankN.jsonl
    logger.info("records: %s\nsummary: %s", ", ".join(map(str, records)), out_dir / "summary.csv")


def write_config(cfg: DictConfig, out_dir: Path) -> None:
    """The run's config and command-line overrides, written (in place of Hydra's .hydra/) only
    once the run dir accepted these settings, so they always describe its records."""
    atomic_write_text(out_dir / "config.yaml", OmegaConf.to_yaml(cfg))
    atomic_write_text(out_dir / "overrides.yaml", OmegaConf.to_yaml(list(HydraConfig.get().overrides.task)))


def wait_for_all_ranks() -> None:
    """torchrun: every process has written its records before rank 0 merges them."""
    import torch.distributed as dist

    if not dist.is_initialized():  # joined only now, so a slow rank's decoding is not bound by a timeout
        dist.init_process_group("gloo", timeout=timedelta(days=1))
    dist.barrier()
    dist.destroy_process_group()
