"""Hardware profiles: peak dense FLOP/s per dtype and memory bandwidth.

Numbers are vendor datasheet figures (dense, no sparsity) for the GPUs, and measured ones for
this project's CPU machines. They are only the latency model's prior: a start-up probe and
online calibration correct whatever a profile gets wrong (see latency.py).
"""

from __future__ import annotations

import platform
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_tflops: dict[str, float]  # dtype name -> dense TFLOP/s
    memory_gbs: float  # GB/s
    launch_overhead_ms: float = 0.0  # fixed cost of one forward (kernel launches, Python)

    def flops_per_s(self, dtype: torch.dtype) -> float:
        name = str(dtype).removeprefix("torch.")
        return 1e12 * self.peak_tflops.get(name, self.peak_tflops.get("float32", 1.0))

    @property
    def bytes_per_s(self) -> float:
        return 1e9 * self.memory_gbs


def device_name(device: str) -> str:
    """The CUDA device's name, or the CPU's model (/proc/cpuinfo on Linux)."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    cpuinfo = Path("/proc/cpuinfo")
    return cpu_model(cpuinfo.read_text() if cpuinfo.exists() else "") or platform.processor() or platform.machine()


def cpu_model(cpuinfo: str) -> str:
    """The first CPU's model name with its family and model numbers: a cloud machine's model
    name may be "AMD EPYC" alone, for a Zen 3 and a Zen 5 (far apart in speed) alike."""
    fields = dict(line.split(":", 1) for line in cpuinfo.split("\n\n")[0].splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    name = fields.get("model name", "")
    if name and "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def known_profiles(directory: Path) -> list[dict]:
    """The profiles in `directory` (conf/gpu) that gpu=auto matches a device against: every one but auto."""
    entries = (yaml.safe_load(path.read_text()) for path in sorted(directory.glob("*.yaml")))
    return [entry for entry in entries if entry["name"] != "auto"]


def profile_from_config(cfg: dict, device: str, known: list[dict]) -> HardwareProfile:
    """conf/gpu/<name>.yaml -> a profile; `auto` matches the device against `known` (the
    other conf/gpu entries) by name, or measures it."""
    if device == "cpu" and cfg["name"] not in ("auto", "cpu"):
        warnings.warn(f"gpu={cfg['name']} describes a GPU but this run is on the CPU ({device_name(device)}): its figures "
                      "are only the latency model's prior, which the probe on this CPU corrects; gpu=auto fits the CPU.", stacklevel=2)
    if cfg["name"] == "auto":
        if device.startswith("cuda"):
            gpu = torch.cuda.get_device_name(torch.device(device)).lower()
            cfg = next((k for k in known if any(m in gpu for m in k.get("match", []))), None)
        else:
            cfg = None
        if cfg is None:
            return measure(device)
    return HardwareProfile(cfg["name"], dict(cfg["peak_tflops"]), cfg["memory_gbs"], cfg.get("launch_overhead_ms", 0.0))


def measure(device: str) -> HardwareProfile:
    """Best observed matmul FLOP/s of each dtype, and copy bandwidth, of this device: a second or
    so. Each dtype is timed itself: bfloat16 runs several times faster than float32 on a CPU
    with AMX or AVX512-BF16, far slower on one without bf16 kernels, and faster on a GPU's
    tensor cores."""
    dev = torch.device(device)
    largest = 4096 if dev.type == "cuda" else 1024
    tflops = {name: _matmul_tflops(dev, getattr(torch, name), largest) for name in ("float32", "bfloat16", "float16")}
    src = torch.empty(64 * 2**20 // 4, device=dev)  # 64 MiB
    dst = torch.empty_like(src)
    gbs = 2 * src.numel() * 4 / _best_time(dev, lambda: dst.copy_(src)) / 1e9
    return HardwareProfile(f"measured-{dev.type}", tflops, gbs)


def _matmul_tflops(dev: torch.device, dtype: torch.dtype, largest: int) -> float:
    """Square matmuls from n = 256, doubled until one takes 10 ms or n reaches `largest`: big
    enough to near the peak where the dtype is fast, a fraction of a second where it is slow."""
    n = 256
    while True:
        a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
        seconds = _best_time(dev, lambda: a @ b)
        if seconds >= 0.01 or n >= largest:
            return 2 * n**3 / seconds / 1e12
        n *= 2


def _best_time(dev: torch.device, fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return min(times)
