"""Turn a composed Hydra config into objects: target, methods, prompts."""

from __future__ import annotations

from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from bastion.bench.runner import Method
from bastion.budget.fixed import FixedBudget
from bastion.budget.hardware import HardwareProfile, profile_from_config

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


LABELS = ("name", "drafters")  # keys that describe a choice rather than configure its constructor


def build(node: DictConfig | None, **kwargs):
    """Instantiate one config-group entry, leaving out its LABELS. Entries without `_target_`
    (drafter=none) build to None."""
    if node is None or "_target_" not in node:
        return None
    spec = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k not in LABELS}
    return instantiate(spec, _convert_="all", **kwargs)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device} was asked for but torch sees no CUDA device; use device=cpu.")
    return device


def hardware(cfg: DictConfig) -> HardwareProfile:
    known = [OmegaConf.to_container(OmegaConf.load(p)) for p in sorted(CONF_DIR.glob("gpu/*.yaml"))]
    return profile_from_config(OmegaConf.to_container(cfg.gpu, resolve=True), cfg.device, [k for k in known if k["name"] != "auto"])


def build_methods(cfg: DictConfig, target) -> list[Method]:
    """AR plus the composed method (when a drafter is chosen); `budget=oracle` expands into one
    fixed budget per size of its sweep."""
    methods = [Method("ar")]
    if "_target_" not in cfg.drafter:
        return methods
    drafter, policy = build(cfg.drafter, target=target), build(cfg.tree)
    if cfg.budget.name == "oracle":
        budgets = [(f"fixed{n}", FixedBudget(n)) for n in cfg.budget.sweep]
    else:
        budgets = [(cfg.budget.name, build(cfg.budget))]
    profile = hardware(cfg)
    for name, budget in budgets:
        budget.start(target, profile, Path(cfg.cache_dir))
        methods.append(Method(f"{cfg.drafter.name}+{cfg.tree.name}+{name}", drafter, policy, budget))
    return methods
