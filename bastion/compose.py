"""Turn a composed Hydra config into objects: target, methods, prompts."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from bastion.bench.runner import Method
from bastion.budget.fixed import FixedBudget
from bastion.budget.hardware import HardwareProfile, profile_from_config
from bastion.models.packed_linear import prepack_linears

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


LABELS = ("name", "drafters")  # keys that describe a choice rather than configure its constructor


def build(node: DictConfig | None, **kwargs):
    """Call one config-group entry's `_target_` with its other keys (LABELS left out) and
    `kwargs` (the live objects it needs, e.g. the target); `_partial_: true` returns a partial.
    Entries without `_target_` (drafter=none) build to None."""
    if node is None or "_target_" not in node:
        return None
    spec = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k not in LABELS}
    factory = get_object(spec.pop("_target_"))
    if spec.pop("_partial_", False):
        return partial(factory, **spec, **kwargs)
    return factory(**spec, **kwargs)


def build_target(cfg: DictConfig, dtype: str | None = None):
    """The run's target (in `dtype` instead of target.dtype when given), its linear weights
    prepacked for CPU inference when `packed_weights` is on (see models/packed_linear.py; a
    no-op on GPU)."""
    node = cfg.target if dtype is None else OmegaConf.merge(cfg.target, {"dtype": dtype})
    return packed(cfg, build(node, name=cfg.target.name))


def packed(cfg: DictConfig, target_or_drafter):
    if cfg.get("packed_weights") and target_or_drafter is not None:
        prepack_linears(getattr(target_or_drafter, "model", target_or_drafter))
    return target_or_drafter


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device} was asked for but torch sees no CUDA device; use device=cpu.")
    return device


def fast_bfloat16(device: str) -> bool:
    """Whether bfloat16 matmuls beat float32 ones on `device`: on CUDA, and on CPUs with AMX
    tiles (a 2-core Xeon: 2.0-2.4 TFLOP/s against 0.3 in float32). On CPUs without AMX
    oneDNN's bfloat16 path is slower than float32 (SmolLM2 decoding 2x slower on a 2-core EPYC)."""
    if device.startswith("cuda"):
        return torch.cuda.is_bf16_supported()
    return torch.backends.mkldnn.is_available() and torch.cpu._is_amx_tile_supported()


def resolve_bfloat16(choice, device: str) -> bool:
    """`auto` -> fast_bfloat16(device); true / false as given."""
    return fast_bfloat16(device) if choice == "auto" else bool(choice)


def hardware(cfg: DictConfig) -> HardwareProfile:
    known = [OmegaConf.to_container(OmegaConf.load(p)) for p in sorted(CONF_DIR.glob("gpu/*.yaml"))]
    return profile_from_config(OmegaConf.to_container(cfg.gpu, resolve=True), cfg.device, [k for k in known if k["name"] != "auto"])


def build_methods(cfg: DictConfig, target) -> list[Method]:
    """AR plus the composed method, or AR plus every entry of `methods` (an experiment's list);
    `budget=oracle` expands into one fixed budget per size of its sweep. Methods sharing a
    drafter configuration share one drafter instance."""
    specs = OmegaConf.to_container(cfg.methods) if cfg.get("methods") else [{}]
    profile, drafters, methods = None, {}, [Method("ar")]
    for spec in specs:
        node = method_config(cfg, spec)
        if "_target_" not in node.drafter:
            continue
        key = json.dumps(OmegaConf.to_container(node.drafter, resolve=True), sort_keys=True)
        if key not in drafters:
            drafters[key] = packed(cfg, build(node.drafter, target=target))
        policy = build(node.tree)
        if node.budget.name == "oracle":
            budgets = [(f"fixed{n}", FixedBudget(n)) for n in node.budget.sweep]
        else:
            budgets = [(node.budget.name, build(node.budget))]
        profile = profile or hardware(cfg)
        prefix = f"{node.drafter.name}+{node.tree.name}"
        oracle = spec.get("name", f"{prefix}+oracle") if node.budget.name == "oracle" else None
        for budget_name, budget in budgets:
            budget.start(target, profile, Path(cfg.cache_dir))
            name = spec.get("name") if not oracle and spec.get("name") else f"{prefix}+{budget_name}"
            methods.append(Method(name, drafters[key], policy, budget, oracle))
    return methods


def method_config(cfg: DictConfig, spec: dict) -> DictConfig:
    """The run's config with one method's choices swapped in: spec = {drafter: <choice>,
    tree: <choice>, budget: <choice>, overrides: {dotted.key: value}} (all optional)."""
    node = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for group in ("drafter", "tree", "budget"):
        if group in spec:
            path = CONF_DIR / group / f"{spec[group]}.yaml"
            if not path.exists():
                raise ValueError(f"Unknown {group} '{spec[group]}' in methods; choose one of {', '.join(p.stem for p in path.parent.glob('*.yaml'))}.")
            node[group] = OmegaConf.load(path)
    for key, value in (spec.get("overrides") or {}).items():
        OmegaConf.update(node, key, value, force_add=True)
    return node
