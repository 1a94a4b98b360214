"""logger=wandb against a fake `wandb` module: what is logged, offline without a key, and the
one-sentence error when wandb is not installed. No network."""

from __future__ import annotations

import sys
import types

import pytest

from bastion.bench import wandb_logger
from bastion.report import load, write_report
from tests.test_report import METHOD, PLOTS, write_run

CFG = {"logger": {"name": "wandb", "project": "bastion", "entity": None, "mode": None, "tags": ["t"]}, "seed": 0}


class FakeRun:
    def __init__(self, **init):
        self.init, self.logged, self.axes, self.saved, self.summary, self.finished = init, [], {}, [], {}, False

    def log(self, data):
        self.logged.append(data)

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
    with pytest.raises(ImportError, match=r"logger=wandb needs the wandb package: run `pip install '\.\[wandb\]'`"):
        wandb_logger.start(CFG, tmp_path)
