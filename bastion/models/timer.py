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


class Clock:
    """Marks on a device's timeline that cost no synchronisation to take: CUDA events recorded
    on the stream (read once a later mark has completed, which a decode step's transfer of its
    results has waited for anyway), perf_counter on a CPU. Six `now` reads per step were six
    waits for an idle GPU."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None  # the device's own, not GPU 0's

    def mark(self):
        if self.stream is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def seconds(self, start, end) -> float:
        """Time from mark `start` to mark `end` (waiting for `end` to complete)."""
        if self.stream is None:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3
