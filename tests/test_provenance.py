"""Runs record where and with what they were measured: the machine, profile, dtype, versions
and the commit of the code (machine.json), read back for summaries and reports."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch
import transformers
from hydra import compose, initialize_config_dir

from bastion.bench.provenance import (
    SUMMARY_FIELDS,
    git_commit,
    read_machine,
    run_metadata,
    summary_fields,
    write_machine,
)
from tests.conftest import ROOT


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose("config", overrides=list(overrides))


def test_metadata_names_the_cpu_profile_dtype_versions_and_commit(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    machine = run_metadata(composed("device=cpu", "gpu=cpu", "target=smollm2_135m"))
    assert machine["omp_wait_policy"] == "PASSIVE"
    assert machine["device"] and machine["device"] != "cpu"  # the CPU's model name, not the torch device
    assert machine["host"] == machine["device"] and machine["world_size"] == 1 and machine["cuda"] == torch.version.cuda
    assert machine["amx"] in (True, False)
    assert (machine["profile"], machine["dtype"]) == ("cpu", "float32")
    assert machine["threads"] == torch.get_num_threads() and machine["load"] >= 0
    assert (machine["torch"], machine["transformers"]) == (torch.__version__, transformers.__version__)
    assert machine["commit"] is None or re.fullmatch(r"[0-9a-f]{4,40}(-dirty)?", machine["commit"])


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_commit_is_marked_dirty_by_changed_or_new_files_and_absent_outside_a_checkout(tmp_path):
    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout.strip()

    assert git_commit(tmp_path) is None
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "first")
    head = git("rev-parse", "--short", "HEAD")
    assert git_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == f"{head}-dirty"
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("")  # untracked: it may change what runs
    assert git_commit(tmp_path) == f"{head}-dirty"


def test_machine_json_round_trip_and_runs_without_one(tmp_path, monkeypatch):
    monkeypatch.setattr("os.getloadavg", lambda: (1.5, 1.0, 1.0))  # the load moves between two reads of it
    cfg = composed("device=cpu", "target=tiny_qwen3")
    write_machine(cfg, tmp_path)
    assert read_machine(tmp_path) == run_metadata(cfg)
    assert summary_fields(tmp_path) == {key: run_metadata(cfg)[key] for key in SUMMARY_FIELDS}
    assert summary_fields(tmp_path / "older") == dict.fromkeys(SUMMARY_FIELDS)  # made before runs kept machine.json
    assert [p.name for p in tmp_path.iterdir()] == ["machine.json"]  # written atomically: no temporary file left
