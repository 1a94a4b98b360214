"""Drafter checkpoints: a directory with config.json and *.safetensors, local or on the Hub."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from bastion.files import atomic_path, atomic_write_text, read_json
from bastion.models.loading import ModelNotFound, hub_dir, looks_local

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def resolve_checkpoint(checkpoint: str) -> Path:
    """A local directory (relative paths are tried against the project root too) or a Hub id.
    A path that can only be local (models/loading.py looks_local: `./x`, `checkpoints/x`) is
    reported missing rather than looked up on the Hub as if it were `owner/name`."""
    bases = tuple(dict.fromkeys((Path.cwd(), PROJECT_ROOT)))
    candidates = [base / Path(checkpoint).expanduser() for base in bases]
    for path in candidates:
        if (path / "config.json").exists():
            return path
    if folder := next((path for path in candidates if path.is_dir()), None):
        raise ModelNotFound(f"{folder} has no config.json; set drafter.checkpoint to a drafter checkpoint directory.")
    if looks_local(checkpoint, bases):
        raise ModelNotFound(f"Drafter checkpoint directory {checkpoint} does not exist (a relative path is looked up "
                            f"under {' and '.join(map(str, bases))}); set drafter.checkpoint to a drafter checkpoint "
                            f"directory or a Hub id.")
    return hub_dir(checkpoint, "drafter.checkpoint", also=("pytorch_model.bin",))  # EAGLE's releases ship a .bin


def read_checkpoint(checkpoint: str | None, kind: str, target_name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, weights) of a `kind` drafter; no checkpoint at all says how to train one, and a
    file that does not parse is named."""
    if not checkpoint:
        train = f"train one with `python train.py drafter={kind} target={target_name}` or "
        raise ValueError(f"Target {target_name} names no {kind} drafter: "
                         f"{train if (PROJECT_ROOT / 'conf' / 'recipe' / f'{kind}.yaml').exists() else ''}"
                         f"set drafter.checkpoint=DIR_OR_HUB_ID.")
    path = resolve_checkpoint(checkpoint)
    config, state = read_json(path / "config.json", "fix it, or train or download the drafter again"), {}
    for file in sorted(path.glob("*.safetensors")):
        try:
            state.update(load_file(file))
        except SafetensorError as error:
            raise ValueError(f"{file} is not a readable safetensors file ({error}); train or download the drafter again.") from None
    if not state and (path / "pytorch_model.bin").exists():  # how some released drafters (EAGLE's) ship
        try:
            state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as error:  # torch raises several kinds for a file that is not a state dict
            raise ValueError(f"{path / 'pytorch_model.bin'} is not a readable weights file ({error}); download the drafter again.") from None
    return config, state


def save_checkpoint(drafter: nn.Module, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write a trained drafter's weights (floating ones in `dtype`) and its `config` (the
    transformers keys it was built from) into `out_dir`, so that
    a kill at any moment leaves either a loadable checkpoint or a folder that is not one.
    config.json marks a checkpoint (resolve_checkpoint looks for it), so it goes first and comes
    back last, each file written atomically: in between the folder is no checkpoint at all,
    never new weights under an old config. (A whole temporary folder renamed into place cannot
    replace a folder that exists, and a checkpoint folder also holds the run's recipe and log.)
    Older weight files go too, since loading reads every *.safetensors in the folder."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in (out_dir / "config.json", *out_dir.glob("*.safetensors")):
        old.unlink(missing_ok=True)
    state = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous() for k, v in drafter.state_dict().items()}
    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(state, tmp)
    config = {**drafter.config, "torch_dtype": str(dtype).removeprefix("torch.")}
    atomic_write_text(out_dir / "config.json", json.dumps(config, indent=2) + "\n")


def shaped_like(target, model_type: str, layers: int) -> dict:
    """The transformers config keys of a drafter as wide as `target` (so it can share the
    target's embeddings and head): what new drafter configs start from."""
    a = target.args
    return {
        "model_type": model_type,
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "head_dim": a.head_dim,
        "rms_norm_eps": a.rms_norm_eps,
        "rope_parameters": dict(target.config.rope_parameters),
        "max_position_embeddings": a.max_position,
        "vocab_size": a.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
    }
