"""Turn a composed Hydra config into objects: target, methods, prompts."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Sequence

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf, open_dict

from bastion.budget.hardware import HardwareProfile, device_name, known_profiles, profile_from_config
from bastion.engine import generate
from bastion.models.packed_linear import prepack_linears
from bastion.models.target import compile_forward, drafter_dtype, dtype_named, fast_bfloat16
from bastion.sampling import GREEDY, Sampling

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


LABELS = ("name", "drafters", "mask_token_id", "shape")  # keys that describe a choice rather than configure its constructor


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


def command_line_overrides() -> list[str]:
    """The overrides Hydra composed this run from; none when Hydra did not start it (tests
    calling an entry point's function directly)."""
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def replace_dict_overrides(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """Make each override `key={...}` set `key` to exactly that dict: Hydra merges it into the
    config's dict, so `data.mix={gsm8k: 1.0}` would silently keep the other sources. Overrides
    inside that key that come after it (`key.sub=v`, `~key.sub`) apply again on top, as they
    did on Hydra's merge. Returns `cfg`, changed in place."""
    replaced = []
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        if override.is_hydra_override() or override.is_sweep_override():
            continue
        if override.type != OverrideType.DEL and isinstance(override.value(), dict):
            OmegaConf.update(cfg, key, override.value(), merge=False, force_add=True)
            replaced.append(key)
        elif any(key.startswith(f"{r}.") for r in replaced):
            reapply(cfg, override)
    return cfg


def reapply(cfg: DictConfig, override) -> None:
    if override.type != OverrideType.DEL:
        OmegaConf.update(cfg, override.key_or_group, override.value(), merge=False, force_add=True)
        return
    parent, _, leaf = override.key_or_group.rpartition(".")
    node = OmegaConf.select(cfg, parent)
    with open_dict(node):
        node.pop(leaf, None)


def build_target(cfg: DictConfig, dtype: str | None = None):
    """The run's target (in `dtype` instead of target.dtype when given), its linear weights
    prepacked for CPU inference when `packed_weights` is on (see models/packed_linear.py; a
    no-op on GPU), or its forward compiled with decode.compile. A packaged model is converted
    under the run's cache_dir."""
    node = cfg.target if dtype is None else OmegaConf.merge(cfg.target, {"dtype": dtype})
    target = build(node, name=cfg.target.name, cache_dir=cfg.cache_dir, attention=cfg.get("attention", "auto"))
    if OmegaConf.select(cfg, "decode.compile", default=False):
        return compile_forward(target)  # unpacked: inductor lays weights out its own way, prepacked ones do not lower
    return packed(cfg, target)


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


def resolve_bfloat16(choice, device: str) -> bool:
    """`auto` -> fast_bfloat16(device); true / false as given."""
    return fast_bfloat16(device) if choice == "auto" else bool(choice)


def hardware(cfg: DictConfig) -> HardwareProfile:
    return profile_from_config(OmegaConf.to_container(cfg.gpu, resolve=True), cfg.device, known_profiles(CONF_DIR / "gpu"))


@dataclass
class Method:
    """One decoding method: AR is the one without a drafter. `settings` is everything in the
    config that shapes its outputs and timings (see `method_settings`)."""

    name: str
    drafter: object | None = None
    policy: object | None = None
    budget: object | None = None
    oracle: str | None = None  # an oracle sweep's fixed budgets share the name their best is reported under
    settings: dict = field(default_factory=dict)

    def generate(self, target, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = GREEDY,
                 seed: int = 0, stop: tuple[str, ...] = (), keys: list[int] | None = None):
        return generate(target, prompts, drafter=self.drafter, policy=self.policy, budget=self.budget,
                        max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, keys=keys, stop_strings=stop)


@dataclass(frozen=True)
class MethodPlan:
    """A method as configured, before any model loads: enough to validate and fingerprint it."""

    name: str
    node: DictConfig | None  # the run's config with this method's choices swapped in; None for AR
    budget: DictConfig | None  # its budget entry (one fixed size of an oracle sweep each)
    oracle: str | None = None


CONTROL = "ar_control"  # the A/A control's method name


def plan_methods(cfg: DictConfig) -> list[MethodPlan]:
    """AR plus the composed method, or AR plus every entry of `methods` (an experiment's list);
    `budget=oracle` expands into one fixed budget per size of its sweep. With `control` on,
    AR again last (CONTROL): decoded after the other methods in every batch, the same work as
    AR, so its speedup over AR is the run's own noise floor and shows any cost that comes with
    a method's place in the batch order."""
    if not isinstance(cfg.get("control", False), bool):
        raise ValueError(f"control must be true or false (got {cfg.control!r}).")
    specs = OmegaConf.to_container(cfg.methods) if cfg.get("methods") else [{}]
    plans = [MethodPlan("ar", None, None)]
    for spec in specs:
        node = method_config(cfg, spec)
        if "_target_" not in node.drafter:
            continue
        prefix = f"{node.drafter.name}+{node.tree.name}"
        if node.budget.get("sweep") is not None:  # an evaluation sweep (budget=oracle), not a controller
            oracle = spec.get("name") or f"{prefix}+oracle"
            for n in node.budget.sweep:
                fixed = OmegaConf.merge(OmegaConf.load(CONF_DIR / "budget" / "fixed.yaml"), {"nodes": n})
                plans.append(MethodPlan(f"{prefix}+fixed{n}", node, fixed, oracle))
        else:
            plans.append(MethodPlan(spec.get("name") or f"{prefix}+{node.budget.name}", node, node.budget))
    if cfg.get("control"):
        plans.append(MethodPlan(CONTROL, None, None))
    names = [plan.name for plan in plans]
    if clash := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError(f"Two methods would both be named {clash[0]!r}: give each entry of `methods` a name of its own "
                         f"(not ar or {CONTROL}; a budget=oracle entry's rows are named <drafter>+<tree>+fixed<N>).")
    return plans


def method_settings(cfg: DictConfig, plan: MethodPlan) -> dict:
    """What shapes a method's records: the target, decoding, seed and machine settings, and
    for drafting methods the drafter (with a digest of its checkpoint's files), tree and budget."""
    settings = {key: OmegaConf.to_container(cfg[key], resolve=True) if OmegaConf.is_config(cfg[key]) else cfg[key]
                for key in ("target", "decode", "seed", "threads", "packed_weights", "attention")}
    settings["device"] = device_name(cfg.device)  # the model (a GPU's, a CPU's): a resume elsewhere would mix machines' timings
    if plan.node is not None:
        for group, node in (("drafter", plan.node.drafter), ("tree", plan.node.tree), ("budget", plan.budget),
                            ("gpu", plan.node.gpu)):
            settings[group] = OmegaConf.to_container(node, resolve=True)
        if settings["drafter"].get("dtype") == "auto":  # recorded as it ran: the machine decides
            target_dtype = dtype_named(cfg.target.get("dtype", "float32"))
            settings["drafter"]["dtype"] = str(drafter_dtype("auto", cfg.device, target_dtype)).removeprefix("torch.")
        if plan.node.drafter.get("checkpoint"):
            settings["drafter_files"] = files_digest(plan.node.drafter.checkpoint)
    if local_dir(cfg.target.source) is not None:  # a packaged, Hub or random target is known by its name
        settings["target_files"] = files_digest(cfg.target.source, weights=False)
    return settings


def local_dir(source: str) -> Path | None:
    """The local directory `source` names, looked up as the drafters' loader does (here, then
    in the project); None for a Hub id, a packaged model or `random`."""
    return next((p for p in (Path(source).expanduser(), CONF_DIR.parent / source) if p.is_dir()), None)


def files_digest(source: str, weights: bool = True) -> str:
    """A digest of a local model directory's files (names and bytes), or the source itself
    when it is not one: retraining or replacing weights in the same directory changes it.
    Without `weights`, a safetensors file counts by its name, size and header (its tensors'
    names, dtypes, shapes and offsets) only: a target's weights can be 16 GB, too many to
    read at every run's start."""
    path = local_dir(source)
    if path is None:
        return source
    digest = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors")):
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            if weights or file.suffix == ".json":
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    digest.update(chunk)
            else:
                size, head = file.stat().st_size, f.read(8)  # the header's length (little-endian u64), then the header
                digest.update(f"{size}".encode() + head + f.read(min(int.from_bytes(head, "little"), size)))
    return digest.hexdigest()[:16]


def build_methods(cfg: DictConfig, target, plans: list[MethodPlan], settings_of: dict[str, dict]) -> list[Method]:
    """The planned methods' objects, with their settings (`settings_of`, by name: what
    method_settings gave the run dir's check). Methods sharing a drafter configuration share
    one drafter instance."""
    profile, drafters, methods = None, {}, []
    for plan in plans:
        settings = settings_of[plan.name]
        if plan.node is None:
            methods.append(Method(plan.name, settings=settings))
            continue
        key = json.dumps(settings["drafter"], sort_keys=True)
        if key not in drafters:
            drafters[key] = packed(cfg, build(plan.node.drafter, target=target))
        budget = build(plan.budget)
        if budget.mode == "parallel" and not drafters[key].drafts_inside_verification:
            raise ValueError(f"Method {plan.name}: budget.mode=parallel drafts inside the verification forward, which only a FlexDraft "
                             "drafter in the paper's layout (trained with recipe.bonus=mask) can; use sequential or flex.")
        profile = profile or hardware(cfg)
        budget.start(target, profile, Path(cfg.cache_dir), drafters[key].draft_tokens)
        methods.append(Method(plan.name, drafters[key], build(plan.node.tree), budget, plan.oracle, settings))
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
