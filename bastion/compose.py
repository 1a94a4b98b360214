"""Turn a composed Hydra config into objects: target, methods, prompts."""

from __future__ import annotations

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from bastion.bench.runner import Method


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


def method_name(cfg: DictConfig) -> str:
    return f"{cfg.drafter.name}+{cfg.tree.name}+{cfg.budget.name}"


def build_methods(cfg: DictConfig, target) -> list[Method]:
    """AR plus the composed method (when a drafter is chosen)."""
    methods = [Method("ar")]
    if "_target_" in cfg.drafter:
        budget, policy = build(cfg.budget), build(cfg.tree)
        methods.append(Method(method_name(cfg), build(cfg.drafter, target=target), policy, budget))
    return methods
