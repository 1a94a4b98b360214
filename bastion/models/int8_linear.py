"""Weight-only int8 linear layers: a drafter's weights in half the bytes, for CPU decoding.

Why: between two drafts the target's forward streams hundreds of megabytes through the caches,
so a drafter step reads its own weights from memory again, and on a CPU that reading is most
of its linears' time: bytes, not arithmetic. One byte per weight instead of bfloat16's two
(gpt-fast's int8 scheme: a symmetric scale per output channel, activations in their own dtype)
halves it. Only drafters take it: their rounding changes which tokens are drafted, never what is
decoded. Training (autograd, autocast) keeps the float weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bastion.models.packed_linear import inference_only, swap_linears


class Int8Linear(nn.Linear):
    """An nn.Linear (same parameters, same state dict) that also holds an int8 copy of its
    weight with per-output-channel scales, and uses it whenever autograd and autocast are off."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # shared, not copied
        self.int8, self.scales = quantize_weight(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not inference_only(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        return int8_linear(x, self.int8, self.scales, self.bias)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 weight [out, in], scales [out] in weight's dtype), weight ~= int8 * scales[:, None]."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    return (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8), scales.to(weight.dtype)


def int8_linear(x: torch.Tensor, int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ (int8 * scales[:, None]).T (+ bias) -> [..., out], in x's dtype."""
    scales = scales if scales.dtype == x.dtype else scales.to(x.dtype)
    out = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), int8, scales).view(*x.shape[:-1], -1)
    return out if bias is None else out + bias


def int8_weights(choice: bool | str, module: nn.Module) -> bool:
    """Whether `module` (a drafter) decodes by int8 weights: `auto` where PyTorch's kernel for
    them is fast, a CPU with bfloat16 or float16 activations, since there a drafter step is
    bound by the bytes of its weights (with float32 activations the kernel takes a slow path,
    several times a float32 linear's time: experiments/NOTES.md); true / false as given, true
    refused in one sentence where the kernel does not run."""
    weight = next(module.parameters())
    runs = weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if choice == "auto":
        return runs and weight.dtype != torch.float32
    if choice not in (True, False):
        raise ValueError(f"drafter.int8 must be true, false or auto (got {choice!r}).")
    if choice and not runs:
        raise ValueError(f"drafter.int8=true needs a drafter on a CPU in float32, bfloat16 or float16 "
                         f"(this one is {weight.dtype} on {weight.device}); use drafter.int8=auto or false.")
    return choice


def quantize_linears(module: nn.Module) -> nn.Module:
    """Swap every nn.Linear inside `module` for an Int8Linear sharing its parameters (ask
    int8_weights first: the kernel runs on CPUs only). Returns `module`."""
    return swap_linears(module, Int8Linear)
