"""How well does the calibrated roofline model predict verify times it was not fitted on?

    python experiments/latency_model.py                       # SmolLM2-135M on this machine
    python experiments/latency_model.py target=qwen3_8b gpu=h100 device=cuda

Calibrates with the start-up probe (chain forwards at context 256), then times forwards of
N = 1..256 tree tokens at other contexts (128 and 768 tokens) and prints predicted vs measured
time and the median absolute relative error.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from hydra import compose, initialize_config_dir

from bastion.budget.latency import calibrated, probe
from bastion.compose import build_target, hardware, resolve_device

ROOT = Path(__file__).resolve().parents[1]
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
CONTEXTS = (128, 768)


def main(overrides: list[str]) -> None:
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    cfg.device = resolve_device(cfg.device)
    target = build_target(cfg)
    with tempfile.TemporaryDirectory() as fresh:  # a fresh probe, not a cached one
        model = calibrated(target, hardware(cfg), Path(fresh))
    theta = model.theta
    print(f"{target.name} on {cfg.device}: t0={np.exp(theta[0]) * 1e3:.2f} ms, compute x{np.exp(theta[1]):.2f}, "
          f"memory x{np.exp(theta[2]):.2f}, p={1 + np.exp(theta[3]) - 1e-3:.2f}")
    print(f"{'N':>5} {'context':>8} {'measured ms':>12} {'predicted ms':>13} {'error':>7}")
    errors = []
    for context in CONTEXTS:
        measured = probe_times(target, context)
        for n, seconds in zip(SIZES, measured):
            predicted = float(model.predict(np.array([n]), np.array([context])))
            errors.append(abs(predicted / seconds - 1))
            print(f"{n:>5} {context:>8} {seconds * 1e3:>12.1f} {predicted * 1e3:>13.1f} {100 * errors[-1]:>6.1f}%")
    print(f"median absolute error: {100 * np.median(errors):.1f}% (max {100 * max(errors):.1f}%) over {len(errors)} points")


def probe_times(target, context: int) -> list[float]:
    """Measured verify times of SIZES at `context`, timed exactly as the start-up probe does."""
    from bastion.budget.hardware import HardwareProfile
    from bastion.budget.latency import LatencyModel

    scratch = LatencyModel.from_profile(target.args, target.dtype, HardwareProfile("scratch", {"float32": 1.0}, 1.0))
    probe(target, scratch, sizes=SIZES, context=context)
    return [scratch.probed[n][2] for n in SIZES]


if __name__ == "__main__":
    torch.set_num_threads(torch.get_num_threads())
    main(sys.argv[1:])
