"""`python train.py`: build (or resume) the self-distillation data, train, save the drafter."""

from __future__ import annotations

import json
import logging
import subprocess
import time
from pathlib import Path

import torch
from datasets import concatenate_datasets
from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf

from bastion.bench import wandb_logger
from bastion.compose import (
    build_target,
    command_line_overrides,
    replace_dict_overrides,
    resolve_bfloat16,
    resolve_device,
)
from bastion.drafters.checkpoint import save_checkpoint
from bastion.drafters.dflash import DFlashDrafter, evenly_spaced_layers, new_dflash_config
from bastion.drafters.eagle3 import Eagle3Drafter, feature_layers, new_eagle3_config
from bastion.drafters.flexdraft import FlexDraftDrafter
from bastion.files import atomic_write_text, read_json
from bastion.models.target import dtype_named
from bastion.train.data import build_selfdistill, build_times, check_mix, machine, source_counts, source_prompts
from bastion.train.dflash import most_frequent_tokens, train_dflash
from bastion.train.examples import split_examples, to_examples
from bastion.train.eagle3 import train_eagle3
from bastion.train.flexdraft import train_flexdraft
from bastion.train.loop import write_log

RECIPES = ("dflash", "eagle3", "flexdraft")

logger = logging.getLogger(__name__)  # Hydra's job logging: the console and the run dir's train.log


def train(cfg: DictConfig) -> None:
    replace_dict_overrides(cfg, command_line_overrides())
    settle(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    if cfg.drafter.name not in RECIPES:
        raise ValueError(f"train.py trains {', '.join(RECIPES)} drafters (got drafter={cfg.drafter.name}).")
    check_mix(cfg.data.mix, cfg.data.n_prompts, untrained_target=cfg.target.get("source") == "random")
    save_dtype = dtype_named(cfg.recipe.save_dtype)  # a bad name is refused now, not after training
    out = output_dir(cfg)
    # logger=wandb only; its files go beside the resumable training state
    wandb_run = wandb_logger.start(OmegaConf.to_container(cfg, resolve=True), Path(cfg.recipe.work_dir))

    def on_log(record: dict) -> None:  # held-out measures on the console and in train.log as they come, not at the end only
        if "val_loss" in record:
            logger.info("held out at step %d: %s", record["step"], json.dumps({k: v for k, v in record.items() if k.startswith("val_")}))
        wandb_logger.log_train_record(wandb_run, record)

    started = time.time()
    target = build_target(cfg)  # packed on CPU (training runs plain kernels)
    target.model.requires_grad_(False)
    layers, examples, val_examples = training_examples(cfg, target, features=cfg.drafter.name != "flexdraft")  # FlexDraft reads the target itself
    recipe, state = cfg.recipe, Path(cfg.recipe.work_dir) / "train_state.pt"
    optim = OmegaConf.to_container(recipe.optim)
    # What the run learns from; its length (steps) may grow on a resume, and where the drafter
    # goes (a finished run reruns in no time to save elsewhere) or its state lives may change
    # (another machine's cache, a moved work_dir).
    optim["run_key"] = {"data": OmegaConf.to_container(cfg.data), "recipe": OmegaConf.to_container(recipe),
                        "target": cfg.target.name, "seed": cfg.seed}
    optim["run_key"]["recipe"]["optim"].pop("steps")
    for key in ("output_dir", "overwrite", "work_dir"):
        optim["run_key"]["recipe"].pop(key, None)
    if cfg.drafter.name == "dflash":
        drafter = new_dflash_drafter(cfg, target, layers, examples, recipe.layers, recipe.block_size)
        log = train_dflash(drafter, examples, state, **optim, seed=cfg.seed, val_examples=val_examples, on_log=on_log)
    elif cfg.drafter.name == "eagle3":
        drafter, columns = new_eagle3_drafter(target, layers, examples, recipe.draft_vocab)
        log = train_eagle3(drafter, examples, state, **optim, columns=columns, seed=cfg.seed, val_examples=val_examples, on_log=on_log)
    else:
        drafter = FlexDraftDrafter(target, recipe.tuned_layers, recipe.group_size, recipe.calibration_hidden,
                                   mask_token_id=mask_token(cfg, target), draft_vocab_size=recipe.draft_vocab,
                                   bonus=recipe.bonus).to(target.device)
        with_draft_vocab(drafter, examples, recipe.draft_vocab)
        log = train_flexdraft(drafter, examples, state, **optim, seed=cfg.seed, val_examples=val_examples, on_log=on_log)
    save_checkpoint(drafter, out, save_dtype)
    atomic_write_text(out / "train_config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    write_log(out / "train_log.jsonl", log)
    times = time_summary(cfg, log)
    atomic_write_text(out / "train_time.json", json.dumps(times, indent=1))
    wandb_logger.finish(wandb_run)
    logger.info("saved %s (%.1f min this run); last log: %s", out, (time.time() - started) / 60, json.dumps(log[-1]))
    logger.info("time to make it: data %.1f min (%s), training %.1f min (%d steps), on %s", times["data_minutes"],
                ", ".join(f"{k} {v['minutes']}" for k, v in times["data"].items()), times["training_minutes"],
                log[-1]["step"], "; ".join(times["machines"]))


def time_summary(cfg: DictConfig, log: list[dict]) -> dict:
    """What making the drafter took, summed over every run that built its data or trained it
    (train_time.json beside it): minutes of decoding per data source (timed shards only: see
    data.build_times), minutes of training steps (validation excluded), and the machines."""
    data = {name: times for name, times in build_times(Path(cfg.data.dir)).items() if name in cfg.data.mix}
    steps = [0] + [r["step"] for r in log]
    training = sum(r["s_per_step"] * (steps[i + 1] - steps[i]) for i, r in enumerate(log)) / 60
    return {"data_minutes": round(sum(t["minutes"] for t in data.values()), 2), "training_minutes": round(training, 2),
            "machines": sorted({m for t in data.values() for m in t["machines"]} | {machine(cfg.device)}),
            "data": data, "untimed_shards": sum(t["shards"] - t["timed"] for t in data.values())}


def output_dir(cfg: DictConfig) -> Path:
    """Where the drafter goes: recipe.output_dir, a relative one taken from the directory
    train.py was started in. A folder holding files git tracks (the committed drafters) is
    refused before any work unless recipe.overwrite=true: a short experiment would replace them."""
    out = Path(to_absolute_path(cfg.recipe.output_dir))
    if not cfg.recipe.get("overwrite") and git_tracked(out):
        raise ValueError(f"{out} holds a checkpoint that git tracks; add recipe.overwrite=true to replace it, or choose another recipe.output_dir.")
    return out


def git_tracked(path: Path) -> bool:
    """Whether git tracks a file at or under `path` (False outside a repository or without git)."""
    folder = next(p for p in (path, *path.parents) if p.is_dir())
    try:
        listed = subprocess.run(["git", "-C", str(folder), "ls-files", "--", str(path)], capture_output=True, text=True)
    except FileNotFoundError:  # no git installed
        return False
    return listed.returncode == 0 and bool(listed.stdout.strip())


def settle(cfg: DictConfig) -> None:
    """Settle the `auto` choices in place (device, bfloat16 data decoding and training autocast),
    so that train_config.yaml and the data's meta record what ran."""
    OmegaConf.set_struct(cfg, False)
    cfg.device = resolve_device(cfg.device)
    cfg.data.bfloat16 = resolve_bfloat16(cfg.data.bfloat16, cfg.device)
    cfg.recipe.optim.autocast = resolve_bfloat16(cfg.recipe.optim.autocast, cfg.device)


def training_examples(cfg: DictConfig, target, features: bool = True) -> tuple[tuple[int, ...], list, list]:
    """The target feature layers recorded, and the self-distillation answers split into training
    and held-out examples (with the features unless `features` is False). With `data.bfloat16` a
    bfloat16 copy of the target decodes them."""
    layers = tuple(evenly_spaced_layers(target.args.n_layers, cfg.data.n_feature_layers))
    decoder = build_target(cfg, "bfloat16") if cfg.data.bfloat16 else target
    dataset = self_distillation(cfg, decoder, layers)
    examples, val_examples = split_examples(to_examples(dataset, features), cfg.data.val_fraction)
    return layers, examples, val_examples


def new_dflash_drafter(cfg: DictConfig, target, layers: tuple[int, ...], examples: list, n_layers: int, block_size: int) -> DFlashDrafter:
    """An untrained DFlash drafter for the target, its draft vocabulary (when the recipe has one)
    the most frequent answer tokens of `examples`."""
    draft_vocab = cfg.recipe.draft_vocab
    config = new_dflash_config(target, n_layers, block_size, list(layers), mask_token(cfg, target), draft_vocab)
    return with_draft_vocab(DFlashDrafter(config, target).to(target.device), examples, draft_vocab)


def with_draft_vocab(drafter, examples: list, size: int | None):
    """`drafter` with its draft vocabulary (when `size` asks for one): the most frequent answer
    tokens of `examples`."""
    if size:
        vocab, coverage = most_frequent_tokens(examples, size, drafter.target.args.vocab_size)
        drafter.set_draft_vocab(vocab)
        logger.info("draft vocabulary: %d tokens cover %.2f%% of the answer tokens", len(vocab), 100 * coverage)
    return drafter


def new_eagle3_drafter(target, layers: tuple[int, ...], examples: list, draft_vocab: int | None) -> tuple[Eagle3Drafter, torch.Tensor]:
    """An untrained EAGLE-3 drafter reading the three recorded layers nearest EAGLE-3's own
    (low, middle, high), and which feature columns of the recorded ones those are; its draft
    vocabulary the most frequent answer tokens of `examples`."""
    wanted = feature_layers({}, target.args.n_layers)
    chosen = [min(layers, key=lambda layer: (abs(layer - w), layer)) for w in wanted]
    config = new_eagle3_config(target, draft_vocab)
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [layer + 1 for layer in chosen]
    drafter = Eagle3Drafter(config, target).to(target.device)
    vocab, coverage = most_frequent_tokens(examples, draft_vocab or target.args.vocab_size, target.args.vocab_size)
    drafter.d2t.copy_(vocab - torch.arange(len(vocab)))
    drafter.t2d.zero_()[vocab] = True
    logger.info("EAGLE-3 reads target layers %s; draft vocabulary: %d tokens cover %.2f%% of the answer tokens",
                chosen, len(vocab), 100 * coverage)
    h = target.args.hidden_size
    columns = torch.cat([torch.arange(h) + layers.index(layer) * h for layer in chosen])
    return drafter, columns


def mask_token(cfg: DictConfig, target) -> int:
    """The target preset's mask token, else the tokenizer's own mask token."""
    chosen = OmegaConf.select(cfg, "target.mask_token_id")
    if chosen is None:
        chosen = getattr(target.tokenizer, "mask_token_id", None)
    if chosen is None:
        raise ValueError(f"Target {target.name} has no mask token: set target.mask_token_id to an unused special token id.")
    return int(chosen)


def self_distillation(cfg: DictConfig, target, layers: tuple[int, ...]):
    """Build or reuse the target's self-distillation data (features recorded at `layers`),
    one folder per source of `data.mix`."""
    d = cfg.data
    out = Path(d.dir)
    meta = {"target": target.name, "layers": list(layers), "max_new_tokens": d.max_new_tokens, "seed": cfg.seed}
    if d.top_k:  # (absent when 0, so data made before soft labels existed stays valid)
        meta["top_k"] = d.top_k
    if d.bfloat16:  # (likewise absent for data decoded in the target's own float32)
        meta["dtype"] = "bfloat16"
    meta_path = out / "meta.json"
    if meta_path.exists() and read_json(meta_path, f"delete {out} or set data.dir") != meta:
        raise ValueError(f"{out} holds self-distillation data made with other settings ({meta_path}); delete it or set data.dir.")
    atomic_write_text(meta_path, json.dumps(meta))
    parts = []
    for name, count in source_counts(dict(d.mix), d.n_prompts).items():
        prompts = source_prompts(target, name, count, out / name, cfg.seed)
        parts.append(build_selfdistill(target, out / name, prompts, layers, d.max_new_tokens, d.batch_size, d.top_k))
    return concatenate_datasets(parts)
