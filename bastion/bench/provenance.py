"""Where and with what a run was measured: the machine, the settings that shape its timings,
and the code that ran.

A speedup is only comparable with one taken on the same machine class, hardware profile,
dtype and library versions, so every run keeps these beside its records (machine.json) and
its summary and report show them: a number without them cannot be checked or reproduced.
torch is imported inside the functions that ask it, so the report reads machine.json without
loading it.
"""

from __future__ import annotations

import json
import os
import subprocess
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from bastion.files import atomic_path, atomic_write_text, read_json

MACHINE_FILE = "machine.json"
SUMMARY_FIELDS = ("device", "profile", "dtype", "commit")  # the ones summary.csv repeats on every row
CHECKOUT = Path(__file__).resolve().parents[2]

if TYPE_CHECKING:
    from omegaconf import DictConfig


def run_metadata(cfg: DictConfig) -> dict:
    """The machine and settings of a run whose `cfg.device` is resolved (cuda:N, not auto).
    `profile` is the `gpu` group as configured: `auto` means matched by the device's name, or
    measured on CPUs and unknown GPUs (see budget/hardware.py)."""
    import torch

    from bastion.budget.hardware import device_name  # torch-heavy: the report reads machine.json without it
    from bastion.models.cpu import has_amx

    return {
        "device": device_name(cfg.device),
        "host": device_name("cpu"),  # on a GPU too: an eager step's launches are the host's work
        "amx": has_amx(cfg.device),
        "profile": cfg.gpu.name,
        "dtype": cfg.target.dtype,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),  # how idle OpenMP threads wait: what other tenants cost
        "load": os.getloadavg()[0],  # 1-minute load average as the run starts: above the core count, timings are noisy
        "world_size": int(os.environ.get("WORLD_SIZE", 1)),  # torchrun's processes (each its own GPU)
        "torch": torch.__version__,
        "cuda": torch.version.cuda,  # the CUDA runtime torch was built with (None: a CPU build)
        "transformers": version("transformers"),
        "commit": git_commit(CHECKOUT),
    }


def git_commit(checkout: Path) -> str | None:
    """`git rev-parse --short HEAD` of `checkout`, with `-dirty` when its tree has changes
    (untracked files included: a new module changes what runs); None when it is not a git
    checkout (an installed copy of the package, even one inside a checkout's .venv) or git is
    missing. GIT_OPTIONAL_LOCKS=0 keeps `git status` from rewriting the index."""
    if not (checkout / ".git").exists():
        return None
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True,
                              env=env, check=False)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=checkout, capture_output=True, text=True, env=env,
                                check=False)
    except FileNotFoundError:
        return None
    if head.returncode or status.returncode:
        return None
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def write_machine(cfg: DictConfig, out_dir: Path) -> None:
    """Record run_metadata(cfg) as the run dir's machine.json (a resumed run overwrites it)."""
    atomic_write_text(out_dir / MACHINE_FILE, json.dumps(run_metadata(cfg), indent=1))


def read_machine(run_dir: Path) -> dict:
    """A run dir's machine.json; {} for runs made before runs recorded their machine."""
    path = run_dir / MACHINE_FILE
    return read_json(path, "delete it or rerun into a new hydra.run.dir") if path.exists() else {}


def summary_fields(run_dir: Path) -> dict:
    """SUMMARY_FIELDS of a run dir's machine.json (None where it has none)."""
    machine = read_machine(run_dir)
    return {key: machine.get(key) for key in SUMMARY_FIELDS}


def write_summary(summary: pd.DataFrame, path: Path) -> None:
    """Write a run's summary.csv whole or not at all (files.py): a kill mid-write leaves the
    previous one."""
    with atomic_path(path) as tmp:
        summary.to_csv(tmp, index=False)


def read_summary(path: Path) -> pd.DataFrame:
    """A run's summary.csv with its provenance columns as text: a short commit of digits only
    (0863448) must not come back as the number 863448. One that does not parse is named."""
    try:
        return pd.read_csv(path, dtype=dict.fromkeys(SUMMARY_FIELDS, str))
    except ValueError as error:  # pandas' ParserError and EmptyDataError, UnicodeDecodeError
        raise ValueError(f"{path} is not a readable summary ({' '.join(str(error).split())}); delete it and rerun the run "
                         "into the same hydra.run.dir, which keeps its records and writes the summary again.") from None
