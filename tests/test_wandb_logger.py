"""logger=wandb against a fake `wandb` module: what is logged, offline without a key, and the
one-sentence error when wandb is not installed; train.py's log with the real wandb, offline,
where it is installed. No network."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from functools import partial

import pytest
import torch

from bastion.bench import wandb_logger
from bastion.bench.report import load, write_report
from bastion.models.loading import packaged_dir
from bastion.train.loop import train_loop
from tests.conftest import ROOT
from tests.test_report import METHOD, PLOTS, write_run

CFG = {"logger": {"name": "wandb", "project": "bastion", "entity": None, "mode": None, "tags": ["t"]}, "seed": 0}


class FakeRun:
    def __init__(self, **init):
        self.init, self.logged, self.axes, self.saved, self.summary, self.finished = init, [], {}, [], {}, False

    def log(self, data, step=None):
        self.logged.append(data if step is None else {"_step": step, **data})

    def define_metric(self, name, step_metric):
        self.axes[name] = step_metric

    def save(self, path, base_path, policy):
        self.saved.append(path)

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    module = types.SimpleNamespace(init=FakeRun, Table=lambda dataframe: ("table", len(dataframe)),
                                   Image=lambda path: ("image", path))
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_console_logger_starts_nothing(fake_wandb, tmp_path):
    assert wandb_logger.start({"logger": {"name": "console"}}, tmp_path) is None
    wandb_logger.log_summary(None, None, [])  # every call is a no-op without a run
    wandb_logger.finish(None)


def test_offline_without_a_key_online_with_one(fake_wandb, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = wandb_logger.start(CFG, tmp_path)
    assert run.init == {"project": "bastion", "entity": None, "mode": "offline", "tags": ["t"], "config": CFG,
                        "dir": str(tmp_path)}
    monkeypatch.setenv("WANDB_API_KEY", "k")
    assert wandb_logger.start(CFG, tmp_path).init["mode"] == "online"


def test_steps_summary_and_report_files_are_logged(fake_wandb, tmp_path):
    run_dir = write_run(tmp_path)
    files = write_report([run_dir])
    long, steps = load([run_dir])
    run = wandb_logger.start(CFG, run_dir)
    wandb_logger.log_steps(run, steps)
    assert run.axes == {"ar/*": "ar/step", f"{METHOD}/*": f"{METHOD}/step"}
    ours = [d for d in run.logged if f"{METHOD}/step" in d]
    assert len(ours) == 100 and ours[-1][f"{METHOD}/step"] == 99 and ours[0][f"{METHOD}/produced"] == 3.0

    run.logged.clear()
    wandb_logger.log_summary(run, long, files)
    assert run.logged[0] == {"summary": ("table", 4)}
    assert run.summary["math500/" + METHOD + "/speedup"] == pytest.approx(4.0)
    assert run.summary["speedup"] == pytest.approx(4.0) and run.summary["aal"] == pytest.approx(2.0)
    assert {k.split("/")[1] for d in run.logged[1:] for k in d} == PLOTS
    assert sorted(p.rsplit("/", 1)[1] for p in run.saved) == ["report.csv", "report.md", "report.tex"]
    wandb_logger.finish(run)
    assert run.finished


def test_missing_wandb_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ValueError, match=r"logger=wandb needs the wandb package: run `pip install '\.\[wandb\]'`"):
        wandb_logger.start(CFG, tmp_path)


def test_run_py_without_wandb_says_it_in_one_sentence(tmp_path):
    (tmp_path / "wandb").mkdir()  # a wandb that fails to import, whether or not the real one is installed
    (tmp_path / "wandb" / "__init__.py").write_text("raise ImportError('not installed')\n")
    args = ["target=tiny_qwen3", "drafter=none", "bench.limit=1", "logger=wandb", f"hydra.run.dir={tmp_path / 'run'}"]
    result = subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "error: logger=wandb needs the wandb package: run `pip install '.[wandb]'`" in result.stderr


def test_training_records_reach_the_run_one_chart_per_position(fake_wandb, tmp_path):
    """train_loop hands each finished record (held-out measures included) to on_log; the W&B
    run gets it at the record's own step."""
    layer = torch.nn.Linear(3, 3)
    loss_fn = lambda batch: (layer(torch.ones(1, 3)).square().sum(), torch.tensor([1.0, 0.0]), torch.tensor([2.0, 2.0]))
    run = wandb_logger.start(CFG, tmp_path)
    log = train_loop(layer, [{"params": list(layer.parameters()), "lr": 0.1}], lambda gen: None, loss_fn,
                     tmp_path / "state.pt", steps=4, log_every=2, val_batches=[None], val_every=4,
                     on_log=partial(wandb_logger.log_train_record, run))
    assert [d["_step"] for d in run.logged] == [r["step"] for r in log] == [2, 4]
    assert run.logged[0]["acc/1"] == 0.5 and run.logged[0]["acc/2"] == 0.0 and "acc" not in run.logged[0]
    assert {"loss", "lr", "s_per_step"} <= set(run.logged[0]) and "val_loss" not in run.logged[0]
    assert run.logged[1]["val_loss"] == log[1]["val_loss"] and run.logged[1]["val_acc/1"] == 0.5


def test_train_py_logs_its_training_to_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    (tmp_path / "models").mkdir()  # cache_dir moves model conversions too: reuse the one the other tests share
    (tmp_path / "models" / "smollm2_135m").symlink_to(packaged_dir("smollm2_135m"))
    args = ["target=tiny_qwen3", "drafter=flexdraft", f"cache_dir={tmp_path}", "data.n_prompts=4", "data.batch_size=2",
            "data.max_new_tokens=8", "~data.mix.chat", "~data.mix.followup", "recipe.tuned_layers=1", "recipe.group_size=4",
            "recipe.calibration_hidden=8", "recipe.optim.steps=4", "recipe.optim.log_every=2", "+recipe.optim.val_every=2",
            "recipe.optim.anchors=4", f"recipe.output_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'run'}",
            "logger=wandb"]
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    result = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    work_dir = tmp_path / "train" / "flexdraft_tiny_qwen3"  # recipe.work_dir: the W&B run sits beside the training state
    assert list((work_dir / "wandb").glob("offline-run-*/run-*.wandb"))  # offline without a key
    history = result.stderr.split("Run history:")[1].split("Run summary:")[0]  # what wandb shows when the run finishes
    for key in ("loss", "lr", "s_per_step", "acc/1", "acc/3", "val_loss", "val_acc/1"):
        assert re.search(rf"wandb: +{re.escape(key)} ", history), key
    assert "saved " in (tmp_path / "run" / "train.log").read_text()
