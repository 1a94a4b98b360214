"""The memory plan of a run from its config alone (models/memory.py does the counting): printed
by plan=true, and checked before a GPU run downloads or loads anything."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from bastion.compose import MethodPlan, local_dir
from bastion.drafters.dflash import target_layer_ids
from bastion.drafters.eagle3 import feature_layers
from bastion.drafters.flexdraft import mask_slots
from bastion.files import read_json
from bastion.models.attention import choose_kernel
from bastion.models.memory import GB, HEADROOM, MemoryPlan, check_fits, checkpoint_parameters, model_args, plan_memory
from bastion.models.target import dtype_named

logger = logging.getLogger(__name__)


def print_plan(cfg: DictConfig, drafting: list[MethodPlan], max_nodes: int) -> None:
    """plan=true: the run's memory plan, then whether it fits the GPU; nothing loads."""
    memory, device = device_memory(cfg)
    on_disk, absent = drafter_checkpoints(drafting)
    plan = memory_plan(cfg, max_nodes, on_disk, cuda=memory is not None)
    if plan is None:
        raise ValueError(f"Target {cfg.target.name} has no shape to plan from: add a `shape:` block (its config.json fields) "
                         f"to conf/target/{cfg.target.name}.yaml, or set target.source to a local model directory.")
    d = cfg.decode
    logger.info("Memory plan of %s (%s) on the %s: batch %d, %d prompt tokens per row (plan_context) + %d new, trees of "
                "up to %d draft nodes (GB = 1e9 bytes)", cfg.target.name, cfg.target.dtype, device, d.batch_size,
                cfg.plan_context, d.max_new_tokens, max_nodes)
    logger.info("%s", plan)
    for checkpoint in absent:
        logger.info("  not counted: the drafter %s, not downloaded yet", checkpoint)
    if memory is not None:
        check_fits(plan, memory, device)
        logger.info("Fits: %.1f GB of the %.1f GB a plan may use (%.0f%% of the %s's %.0f GB).", plan.total / GB,
                    HEADROOM * memory / GB, 100 * HEADROOM, device, memory / GB)


def check_memory(cfg: DictConfig, drafting: list[MethodPlan], max_nodes: int) -> None:
    """Refuse in one sentence a run whose memory plan does not fit its GPU. A run on a CPU, or
    whose target's shape is not known before its weights download, is not checked."""
    memory, device = device_memory(cfg)
    if memory is not None and (plan := memory_plan(cfg, max_nodes, drafter_checkpoints(drafting)[0], cuda=True)):
        check_fits(plan, memory, device)


def device_memory(cfg: DictConfig) -> tuple[int | None, str]:
    """The bytes the run must fit in and whose they are: the CUDA device's own, else the gpu
    profile's capacity_gb (a plan for a GPU made on another machine); None on a CPU."""
    if cfg.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(cfg.device))
        return props.total_memory, props.name
    gb = cfg.gpu.get("capacity_gb")
    return (int(gb * GB), cfg.gpu.name) if gb else (None, cfg.device)


def memory_plan(cfg: DictConfig, max_nodes: int, drafters: list[tuple[str, Path]], cuda: bool) -> MemoryPlan | None:
    """The run's memory plan (models/memory.py) from its config and the drafter checkpoints on
    disk ((drafter name, directory) each) alone; None when the target's shape is not known
    before its weights download."""
    target = cfg.target
    dtype = dtype_named(target.dtype)
    local = Path(target.source).expanduser() / "config.json"
    if target.source == "random":
        shape = OmegaConf.to_container(target.hf_config, resolve=True)
    elif local.is_file():
        shape = read_json(local, "restore it from the model's source")
    elif target.get("shape"):
        shape = OmegaConf.to_container(target.shape, resolve=True)
    else:
        return None
    kernel = choose_kernel(cfg.get("attention", "auto"), "cuda" if cuda else "cpu")
    d, args = cfg.decode, model_args(shape)
    return plan_memory(args, dtype, d.batch_size, cfg.plan_context, d.max_new_tokens, max_nodes, kernel,
                       sum(checkpoint_parameters(path) for _, path in drafters), extra_tokens(drafters, max_nodes),
                       captured_layers(drafters, args.n_layers), drafter_kv_width(drafters), cuda=cuda, sampled=d.temperature > 0,
                       compiled=d.get("compile", False), ranked=d.tree_mode == "ranked")


def drafter_checkpoints(drafting: list[MethodPlan]) -> tuple[list[tuple[str, Path]], list[str]]:
    """The run's drafter checkpoints that are on disk, as (drafter name, directory), and those
    that are not yet (Hub ids, counted once downloaded)."""
    on_disk, absent = {}, []
    for drafter in (p.node.drafter for p in drafting if p.node.drafter.get("checkpoint")):
        path = local_dir(drafter.checkpoint)
        if path is None or not (path / "config.json").is_file():
            absent.append(drafter.checkpoint)
        else:
            on_disk[path] = drafter.name
    return [(name, path) for path, name in on_disk.items()], list(dict.fromkeys(absent))


def extra_tokens(drafters: list[tuple[str, Path]], max_nodes: int) -> int:
    """Cache slots a verification forward may use beyond its tree (Drafter.extra_tokens), read
    from the checkpoints' configs: FlexDraft's mask groups."""
    return max((mask_slots(read_json(path / "config.json", "train or download it again")["group_size"], max_nodes)
                for name, path in drafters if name == "flexdraft"), default=0)


def captured_layers(drafters: list[tuple[str, Path]], n_target_layers: int) -> int:
    """The most target layers a drafter reads the outputs of (DFlash's target_layer_ids, EAGLE-3's
    three), from the checkpoints' configs: a prefill keeps them for every prompt token."""
    readers = {"dflash": target_layer_ids, "eagle3": lambda config: feature_layers(config, n_target_layers)}
    return max((len(readers[name](read_json(path / "config.json", "train or download it again")))
                for name, path in drafters if name in readers), default=0)


def drafter_kv_width(drafters: list[tuple[str, Path]]) -> int:
    """The keys and values per row and slot the widest drafter's own KV cache holds (DFlash's
    layers, EAGLE-3's one), from the checkpoints' configs."""
    widths = []
    for name, path in drafters:
        if name in ("dflash", "eagle3"):
            args = model_args({"model_type": "qwen3", **read_json(path / "config.json", "train or download it again")})
            widths.append(2 * (args.n_layers if name == "dflash" else 1) * args.n_kv_heads * args.head_dim)
    return max(widths, default=0)
