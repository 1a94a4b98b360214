"""The optimisation loop every drafter recipe shares: warm-up + cosine schedule, gradient
clipping, per-position accuracy logs, and atomic checkpoints that a rerun resumes from."""

from __future__ import annotations

import json
import math
import pickle
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from bastion.files import atomic_path, atomic_write_text


def lr_at(step: int, steps: int, lr: float, warmup: float) -> float:
    """Linear warm-up, then cosine decay to 10% of lr."""
    w = max(1, int(warmup * steps))
    if step < w:
        return lr * (step + 1) / w
    progress = (step - w) / max(1, steps - w)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_loop(
    module: nn.Module,
    param_groups: list[dict],  # {"params": [...], "lr": peak lr}
    batch_fn: Callable[[torch.Generator], object],
    loss_fn: Callable[[object], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],  # -> loss, hits [K], counts [K]
    state_path: Path,
    steps: int,
    warmup: float = 0.04,
    grad_clip: float = 1.0,
    weight_decay: float = 0.0,
    save_every: int = 50,
    log_every: int = 20,
    seed: int = 0,
    desc: str = "train",
    val_batches: list | None = None,
    val_every: int = 100,
    val_metrics: Callable[[], dict] | None = None,
    run_key: dict | None = None,
    autocast: bool = False,
    on_log: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Optimise `module` in place; resumable from `state_path`. Returns the log records
    (mean loss, accuracy per draft position, seconds per step, every `log_every` steps; and
    every `val_every` steps the loss and accuracy on `val_batches`, held-out data that shows
    over-fitting, and whatever `val_metrics` measures on held-out data).

    `run_key` names what the run learns from (data and recipe, not its length): a saved state
    with another key is refused rather than resumed, so new data never continues an old run.
    `autocast`: forwards in bfloat16 mixed precision (weights and optimiser stay float32).
    `on_log`: called with each new log record once it is complete (train.py's W&B logger), so
    the loop itself knows no logger."""
    for group in param_groups:
        group["peak"] = group["lr"]
    optimizer = torch.optim.AdamW(param_groups, betas=(0.9, 0.95), weight_decay=weight_decay, fused=True)  # fused: one kernel for all parameters
    params = [p for g in param_groups for p in g["params"]]
    device = params[0].device  # batches are built on the host (train/examples.py) and moved here
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.autocast(params[0].device.type, torch.bfloat16, enabled=autocast)
    start, log = 0, []
    if state_path.exists():
        state = load_state(state_path)
        if state.get("key") != run_key:
            raise ValueError(f"{state_path} is a training run on other data or settings; delete it to start over, or set recipe.work_dir.")
        module.load_state_dict(state["drafter"])
        optimizer.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        start, log = state["step"], state["log"]
    module.train()
    hits = counts = 0
    losses, t0 = [], time.time()
    bar = tqdm(range(start, steps), initial=start, total=steps, desc=desc, unit="step")
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, group["peak"], warmup)
        with mixed:
            loss, step_hits, step_counts = loss_fn(on_device(batch_fn(gen), device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
        losses.append(loss.item())
        hits, counts = hits + step_hits, counts + step_counts
        if (step + 1) % log_every == 0 or step + 1 == steps:
            acc = (hits / counts.clamp(min=1)).tolist()
            log.append({"step": step + 1, "loss": sum(losses) / len(losses), "lr": optimizer.param_groups[0]["lr"],
                        "acc": [round(a, 4) for a in acc], "s_per_step": (time.time() - t0) / len(losses)})
            if val_batches and ((step + 1) % val_every == 0 or step + 1 == steps):
                module.eval()
                with mixed:
                    log[-1].update(evaluate(loss_fn, [on_device(b, device) for b in val_batches]), **(val_metrics() if val_metrics else {}))
                module.train()
            bar.set_postfix(loss=f"{log[-1]['loss']:.3f}", acc1=f"{acc[0]:.3f}", acc4=f"{acc[min(3, len(acc) - 1)]:.3f}")
            if on_log:
                on_log(log[-1])
            hits = counts = 0
            losses, t0 = [], time.time()
        if (step + 1) % save_every == 0 or step + 1 == steps:
            save_state(state_path, {"drafter": module.state_dict(), "optimizer": optimizer.state_dict(),
                                    "generator": gen.get_state(), "step": step + 1, "log": log, "key": run_key})
    module.eval()
    return log


def on_device(batch, device: torch.device):
    """A batch (tensors, in tuples and lists, beside anything else) with its tensors on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(on_device(part, device) for part in batch)
    return batch


@torch.no_grad()
def evaluate(loss_fn, batches: list) -> dict:
    results = [loss_fn(batch) for batch in batches]
    hits, counts = sum(r[1] for r in results), sum(r[2] for r in results)
    return {"val_loss": sum(float(r[0]) for r in results) / len(results),
            "val_acc": [round(a, 4) for a in (hits / counts.clamp(min=1)).tolist()]}


def save_state(path: Path, state: dict) -> None:
    """Write atomically: a kill mid-write leaves the previous state intact. `state` holds
    tensors and plain containers only (state dicts, the generator's byte tensor, the log, the
    run key), so that load_state can read it without unpickling code."""
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_state(path: Path) -> dict:
    """The state save_state wrote. weights_only: a crafted or foreign file in the cache is
    refused instead of running the code its pickle names (and a damaged one is refused too)."""
    try:
        return torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError):
        raise ValueError(f"{path} is damaged or holds more than tensors and plain data, so it is not loaded; delete it to start over.") from None


def write_log(path: Path, log: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in log))
