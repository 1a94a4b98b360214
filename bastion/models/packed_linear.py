"""Linear layers with weights prepacked for oneDNN, for CPU inference.

Why: on CPU, `F.linear` calls MKL's sgemm, which repacks the whole weight matrix on every call
once the input has more than one row. Decoding streams every weight once per forward, so that
repacking is paid per step, and a verifier's 2..16-token forwards cost far more than AR's
1-token ones for no reason of their own. Packing once at load time (oneDNN's own blocked
layout) removes that and leaves the 1-token forward as fast as before, so every method, AR
included, runs the same kernels (figures: experiments/NOTES.md). GPU runs, float64 models and training (autograd, autocast) keep the plain path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROWS_HINT = 8  # the input row count oneDNN picks its packed layout for; any count runs


class PackedLinear(nn.Linear):
    """An nn.Linear (same parameters, same state dict) that also holds a oneDNN-packed copy
    of its weight and uses it whenever autograd is off."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # shared, not copied
        self.packed = pack_weight(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed, self.bias)

    def __deepcopy__(self, memo) -> nn.Linear:
        """A copy is a plain, trainable nn.Linear: packing is an inference detail, and oneDNN's
        opaque tensors cannot be copied (FlexDraft deep-copies target attention layers)."""
        copy = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        copy.weight = nn.Parameter(self.weight.detach().clone(), self.weight.requires_grad)
        if self.bias is not None:
            copy.bias = nn.Parameter(self.bias.detach().clone(), self.bias.requires_grad)
        return copy


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> oneDNN's packed copy of it (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), on `packed` (pack_weight(weight)) when there is one and
    inference_only."""
    if packed is None or not inference_only(x, weight):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def inference_only(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Neither autograd (a gradient to x or the weight) nor autocast (it casts F.linear's inputs,
    not another kernel's) needs the plain F.linear: a kernel of our own may run."""
    return not ((torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
                or torch.is_autocast_enabled(x.device.type))


def can_pack(module: nn.Module) -> bool:
    """oneDNN packs float32 on any CPU, bfloat16 only where it has bf16 instructions (AVX-512 BF16
    or AVX-NE-CONVERT: not on an AMD EPYC Zen 3, for instance)."""
    weight = next(module.parameters(), None)
    if weight is None or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack_linears(module: nn.Module) -> nn.Module:
    """Swap every nn.Linear inside `module` for a PackedLinear sharing its parameters (on CPU,
    for float32/bfloat16; otherwise nothing changes). Tied weights stay tied. Returns `module`."""
    if not isinstance(module, nn.Module) or not can_pack(module):
        return module  # (a drafter without weights, e.g. ngram, passes through)
    return swap_linears(module, PackedLinear)


def swap_linears(module: nn.Module, kind: type[nn.Linear]) -> nn.Module:
    """Replace every plain nn.Linear inside `module` by kind(linear) (PackedLinear, Int8Linear:
    the same parameters, another kernel); tied weights stay tied. Returns `module`."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, kind(child))
    return module


def linear_kernels(module: nn.Module) -> str:
    """'packed' when `module` runs prepacked linears, else 'dense' (part of latency cache keys)."""
    return "packed" if any(isinstance(m, PackedLinear) for m in module.modules()) else "dense"
