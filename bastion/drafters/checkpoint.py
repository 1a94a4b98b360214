"""Drafter checkpoints: a directory with config.json and *.safetensors, local or on the Hub."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from bastion.models.loading import resolve_source

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def resolve_checkpoint(checkpoint: str) -> Path:
    """A local directory (relative paths are tried against the project root too) or a Hub id."""
    for base in (Path.cwd(), PROJECT_ROOT):
        path = base / checkpoint
        if (path / "config.json").exists():
            return path
    return resolve_source(checkpoint)


def read_checkpoint(checkpoint: str | None, kind: str, target_name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, weights) of a `kind` drafter; no checkpoint at all says how to train one."""
    if not checkpoint:
        raise ValueError(
            f"Target {target_name} names no {kind} drafter: train one with "
            f"`python train.py drafter={kind} target={target_name}` or set drafter.checkpoint=DIR_OR_HUB_ID."
        )
    path = resolve_checkpoint(checkpoint)
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    return json.loads((path / "config.json").read_text()), state


def save_checkpoint(module: nn.Module, config: dict, out_dir: Path, dtype: torch.dtype) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous() for k, v in module.state_dict().items()}
    save_file(state, out_dir / "model.safetensors")
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
