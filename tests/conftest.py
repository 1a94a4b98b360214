"""Shared fixtures: the tiny random targets (float64) and SmolLM2-135M (float32); and the
promise that tests write nothing into the checkout, checked once per session."""

from __future__ import annotations

import os
import shutil
import subprocess
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


CHECKOUT_STATUS = pytest.StashKey[str]()


def checkout_status() -> str | None:
    """`git status` of the checkout, every untracked file listed; None when it is not a git
    work tree or git is missing. GIT_OPTIONAL_LOCKS=0 keeps it from rewriting the index."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return None
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                            text=True, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"}, check=False)
    return status.stdout if status.returncode == 0 else None


def pytest_sessionstart(session):
    """Note the checkout's status before any test runs; under pytest-xdist in the controller
    only, so that the check runs once, over every worker's tests."""
    if not hasattr(session.config, "workerinput") and (status := checkout_status()) is not None:
        session.config.stash[CHECKOUT_STATUS] = status


def pytest_sessionfinish(session):
    """Fail the session when the checkout's status changed while it ran: a test wrote a file
    into the checkout (or changed a tracked one). Compared with the start, so changes made
    before the session do not count."""
    before = session.config.stash.get(CHECKOUT_STATUS, None)
    after = checkout_status() if before is not None else None
    if after is None:
        return
    before, after = set(before.splitlines()), set(after.splitlines())
    changed = [f"now '{line}'" for line in sorted(after - before)] + [f"was '{line}'" for line in sorted(before - after)]
    if changed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            reporter.write("\n")  # after the progress line
            reporter.write_line(f"The tests changed the checkout's git status ({shown}): a test wrote into the checkout; "
                                "write into tmp_path instead.", red=True, bold=True)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
