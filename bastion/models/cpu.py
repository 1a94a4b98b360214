"""What the CPU under a run has: kernel choices (attention, bfloat16) and run records ask alike."""

from __future__ import annotations

import torch


def has_amx(device: str | torch.device = "cpu") -> bool | None:
    """Whether the CPU has AMX tiles (fast bfloat16 matmuls); None on a GPU run."""
    return None if str(device).startswith("cuda") else torch.cpu._is_amx_tile_supported()
