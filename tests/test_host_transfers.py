"""A greedy decode step waits for the device at most twice: once for the drafts its trees are
built from, once for the verification's accepted paths; and it sends host values to the
device without waiting (a blocking copy synchronises a GPU's stream)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.overrides import TorchFunctionMode

from bastion.budget.fixed import FixedBudget
from bastion.drafters.dflash import DFlashDrafter, new_dflash_config
from bastion.engine import _step, generate
from bastion.sampling import Sampling
from bastion.tree.best_first import best_first
from bastion.tree.chain import chain
from bastion.tree.static import static

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__bool__,
         torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


class DeviceReads(TorchFunctionMode):
    """Counts reads of tensor values by the host (what is a device-to-host transfer on a GPU);
    reading a tensor that such a read already brought over (`.cpu().numpy()`) is not another.
    Also counts blocking sends, which on a GPU wait for every queued kernel: values copied by
    `torch.tensor(..., device=...)`, moved by `.to(device)` without non_blocking, or indexing a
    tensor by a Python list (copied to the device as a blocking send)."""

    def __init__(self):
        super().__init__()
        self.count, self.on_host, self.blocking_sends = 0, set(), 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in READS and id(args[0]) not in self.on_host:
            self.count += 1
            if isinstance(out, torch.Tensor):
                self.on_host.add(id(out))
        device = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        if (func is torch.tensor and "device" in kwargs) or (func is torch.Tensor.to and device is not None and not kwargs.get("non_blocking")):
            self.blocking_sends += 1
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and has_list(args[1]):
            self.blocking_sends += 1
        return out


def has_list(index) -> bool:
    return isinstance(index, list) or (isinstance(index, tuple) and any(isinstance(i, list) for i in index))


def step_reads(target, monkeypatch, **decode) -> tuple[list[int], list[int]]:
    """Per decode step of a random DFlash drafter's decode: the device reads and the blocking sends."""
    drafter = DFlashDrafter(new_dflash_config(target, 1, 4, [0, 1], 16), target).to(target.dtype).eval()
    counts, sends = [], []

    def counted(m, batch):
        with DeviceReads() as reads:
            step = _step(m, batch)
        counts.append(reads.count)
        sends.append(reads.blocking_sends)
        return step

    monkeypatch.setattr("bastion.engine._step", counted)
    prompts = [[5 + i, 17, 300 + 7 * i, 41] for i in range(3)]
    generate(target, prompts, drafter=drafter, budget=FixedBudget(16), max_new_tokens=12, **decode)
    return counts, sends


@pytest.mark.parametrize("policy", [best_first, chain, partial(static, shape="eagle1_25")], ids=["best_first", "chain", "static"])
def test_a_greedy_step_reads_the_device_at_most_twice(tiny_qwen3, policy, monkeypatch):
    counts, sends = step_reads(tiny_qwen3, monkeypatch, policy=policy)
    assert counts and max(counts) <= 2, counts
    assert not any(sends), sends


def test_a_sampled_step_reads_the_device_at_most_three_times(tiny_qwen3, monkeypatch):
    """T > 0 with sampled children: the drafts, the children drawn for every row's trees at once,
    and the paths of a rejection sampling that runs on the device."""
    counts, sends = step_reads(tiny_qwen3, monkeypatch, policy=best_first, sampling=Sampling(1.0, tree_mode="sampled"))
    assert counts and max(counts) <= 3, counts
    assert not any(sends), sends


def test_a_keyed_sampled_step_reads_the_device_at_most_twice(tiny_qwen3, monkeypatch):
    """T > 0 with ranked children (keyed sampling, the default): as greedy, and the rows' keys
    reach their noise without a blocking send."""
    counts, sends = step_reads(tiny_qwen3, monkeypatch, policy=best_first, sampling=Sampling(1.0))
    assert counts and max(counts) <= 2, counts
    assert not any(sends), sends
