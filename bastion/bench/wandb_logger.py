"""Weights & Biases logging when the config says `logger=wandb`: for run.py the composed config,
every decode step, the summary table, the report's figures and files; for train.py the config
and the training log records.

wandb is an optional extra (`pip install '.[wandb]'`), imported only when asked for. Without
WANDB_API_KEY the run is kept offline in <run dir>/wandb/; `wandb sync <run dir>/wandb/offline-run-*`
uploads it later (from a machine that has a key). Every function takes the run `start` returned
and does nothing when it is None, so the caller needs no branches of its own.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from bastion.bench.metrics import BASELINE
from bastion.compose import CONTROL

STEP_METRICS = ["produced", "tree_size", "expected", "step_s", "verify_s", "predicted_verify_s"]


def start(cfg: dict, run_dir: Path):
    """A W&B run holding `cfg` (the resolved config as a dict), its files under `run_dir`/wandb/,
    or None unless cfg's logger is wandb."""
    logger = cfg.get("logger") or {}
    if logger.get("name") != "wandb":
        return None
    try:
        import wandb
    except ImportError:  # a ValueError, so the entry points show this sentence rather than a traceback
        raise ValueError("logger=wandb needs the wandb package: run `pip install '.[wandb]'` in the bastion "
                         "checkout (or `pip install wandb`), or choose logger=console.") from None
    mode = logger.get("mode") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    run_dir.mkdir(parents=True, exist_ok=True)  # train.py's work dir does not exist before its first run
    return wandb.init(project=logger.get("project", "bastion"), entity=logger.get("entity"), mode=mode,
                      tags=list(logger.get("tags") or []), config=cfg, dir=str(run_dir))


def log_steps(run, steps: pd.DataFrame) -> None:
    """Every decode step of every method (steps: metrics.step_table), each method on its own
    axis `<method>/step`, since methods take different numbers of steps for the same prompts."""
    if run is None:
        return
    for method, group in steps.groupby("method", sort=False):
        run.define_metric(f"{method}/*", step_metric=f"{method}/step")
        for step, values in enumerate(group[STEP_METRICS].itertuples(index=False)):
            run.log({f"{method}/step": step, **{f"{method}/{k}": float(v) for k, v in values._asdict().items()}})


def log_summary(run, summary: pd.DataFrame, report_files: list[Path]) -> None:
    """The summary as a table and as run-summary scalars `<bench>/<method>/{speedup,aal}`, plus
    `speedup` and `aal` of the best row that is not AR or its A/A control (the one a sweep
    optimises); PNGs of the report as images, its other files (report.md/.tex/.csv) saved with
    the run."""
    if run is None:
        return
    import wandb

    run.log({"summary": wandb.Table(dataframe=summary)})
    for row in summary.itertuples(index=False):
        run.summary[f"{row.bench}/{row.method}/speedup"] = row.speedup
        run.summary[f"{row.bench}/{row.method}/aal"] = row.aal
    drafting = summary[~summary.method.isin([BASELINE, CONTROL])].dropna(subset=["speedup"])
    if not drafting.empty:
        best = drafting.loc[drafting.speedup.idxmax()]
        run.summary["speedup"], run.summary["aal"] = best.speedup, best.aal
    for path in map(Path, report_files):
        if path.suffix == ".png":
            run.log({f"plots/{path.stem}": wandb.Image(str(path))})
        else:
            run.save(str(path), base_path=str(path.parent), policy="now")


def log_train_record(run, record: dict) -> None:
    """One training log record (bastion/train/loop.py) at its own step, per-position lists
    (`acc`, `val_acc`) as one chart per position: `acc/1`, `acc/2`, ..."""
    if run is None:
        return
    values = {}
    for key, value in record.items():
        if isinstance(value, list):
            values.update({f"{key}/{position}": v for position, v in enumerate(value, 1)})
        elif key != "step":
            values[key] = value
    run.log(values, step=record["step"])


def finish(run) -> None:
    if run is not None:
        run.finish()
