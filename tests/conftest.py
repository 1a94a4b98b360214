"""Shared fixtures: the tiny random targets (float64) and SmolLM2-135M (float32)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from bastion.compose import LABELS
from bastion.models.packed_linear import prepack_linears
from bastion.models.target import load_target

ROOT = Path(__file__).resolve().parents[1]
# `make test` runs two pytest-xdist workers on the 2-core machine: one thread each, since most
# tests are bound by Python, not by matrix multiplies.
torch.set_num_threads(1 if "PYTEST_XDIST_WORKER" in os.environ else 2)


def target_config(name: str, **overrides) -> dict:
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "target" / f"{name}.yaml"), resolve=False)
    cfg.pop("_target_")
    for label in LABELS:  # what describes the choice, not what load_target takes
        if label != "name":
            cfg.pop(label, None)
    cfg["device"] = "cpu"
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="session")
def tiny_qwen3():
    return load_target(**target_config("tiny_qwen3", dtype="float64"))


@pytest.fixture(scope="session")
def tiny_llama():
    return load_target(**target_config("tiny_llama", dtype="float64"))


@pytest.fixture(scope="session")
def smollm2():
    return load_target(**target_config("smollm2_135m"))


@pytest.fixture(scope="session")
def smollm2_packed():
    """SmolLM2 as run.py runs it on CPU: linear weights prepacked for oneDNN."""
    target = load_target(**target_config("smollm2_135m"))
    prepack_linears(target.model)
    return target
