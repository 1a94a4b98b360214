"""Host values onto the device without waiting for it."""

from __future__ import annotations

import torch


def to_device(values, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of host values (lists of ints, ...) on `device`, sent without a wait:
    `torch.tensor(values, device="cuda")` copies and then synchronises the stream, waiting for
    every queued kernel, which a host-light step would pay several times over. A non-blocking
    copy from pageable memory is staged by the driver before it returns, so the host tensor may
    be freed at once. On a CPU this is torch.tensor(values)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
