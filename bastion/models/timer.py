"""Timer reads that are honest on GPUs."""

from __future__ import annotations

import time

import torch


def now(device: torch.device) -> float:
    """perf_counter after queued device work has finished: a CUDA kernel launch returns before
    the kernel runs, so an unsynchronised read would time the launch, not the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
