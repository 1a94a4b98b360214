"""A run directory's integrity: one writer at a time, and records that match their settings.

A rerun into a run dir resumes it, which is only honest when the records already there were
made with the same settings. Each method's settings are kept in methods.json and every record
carries their fingerprint, so a rerun with other settings is refused (or, with `fresh`, the
old results are set aside) instead of presenting old results as new.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bastion.bench.provenance import MACHINE_FILE
from bastion.bench.records import run_records
from bastion.files import atomic_write_text, read_json

logger = logging.getLogger(__name__)

SETTINGS_FILE = "methods.json"
RESULT_FILES = ("results*.jsonl", SETTINGS_FILE, MACHINE_FILE, "summary.csv", "config.yaml", "overrides.yaml")  # what fresh=true sets aside


def fingerprint(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


@contextmanager
def locked(out_dir: Path, shard: str = ""):
    """Hold the run dir's lock from the settings check to the last record; a second writer is
    refused in one sentence. A plain run holds `.lock` alone; torchrun's ranks (`shard`
    .rankN: each writes shards of its own) hold it together, each also holding `.lock.rankN`
    alone. So a plain run and a torchrun job never write (or, with fresh=true, move) one run
    dir's records at once. The kernel drops a lock when its process dies, so a killed run never
    leaves a stale one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as held:
        _hold(held, out_dir / ".lock", fcntl.LOCK_SH if shard else fcntl.LOCK_EX, out_dir)
        if shard:
            _hold(held, out_dir / f".lock{shard}", fcntl.LOCK_EX, out_dir)
        yield


def _hold(held: ExitStack, path: Path, how: int, out_dir: Path) -> None:
    """Take `path`'s lock (`how`: LOCK_EX, or LOCK_SH for ranks sharing it) for as long as
    `held` lasts. An exclusive holder writes its pid into the file for the refusal to name;
    shared holders empty it, so a refusal names no pid of a plain run long gone."""
    f = held.enter_context(open(path, "a+"))
    try:
        fcntl.flock(f, how | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip()
        who = f"Another run (pid {holder})" if holder else "A torchrun job"
        raise ValueError(f"{who} is writing to {out_dir}; wait for it to finish or choose another hydra.run.dir.") from None
    f.truncate(0)
    if how == fcntl.LOCK_EX:
        f.write(str(os.getpid()))
        f.flush()


def check_run_dir(out_dir: Path, settings: dict[str, dict], fresh: bool = False) -> None:
    """Refuse to resume `out_dir` when a method's records there were made with other settings
    than `settings` (method name -> its settings); with `fresh` set the old results aside in a
    folder of their own instead. Then record the settings."""
    path = out_dir / SETTINGS_FILE
    saved = read_json(path, "delete the run dir or choose another hydra.run.dir") if path.exists() else {}
    if not isinstance(saved, dict) or not all(isinstance(s, dict) and {"fingerprint", "settings"} <= s.keys() for s in saved.values()):
        raise ValueError(f"{path} does not hold each method's settings (an object of method name -> fingerprint and settings); "
                         "delete the run dir or choose another hydra.run.dir.")
    recorded = {r["method"] for r in run_records(out_dir)}
    changed = [name for name in settings if name in recorded and saved.get(name, {}).get("fingerprint") != fingerprint(settings[name])]
    if changed and fresh:
        aside = out_dir / time.strftime("previous-%Y%m%d-%H%M%S")
        aside.mkdir()
        for pattern in RESULT_FILES:
            for file in out_dir.glob(pattern):
                file.rename(aside / file.name)
        logger.info("fresh=true: the earlier results of %s are now in %s", out_dir, aside)
        saved = {}
    elif changed:
        name = changed[0]
        what = _differences(saved[name]["settings"], settings[name]) if name in saved else "settings this version did not record"
        raise ValueError(
            f"{out_dir} already holds results of '{name}' made with other settings ({what}); choose another "
            f"hydra.run.dir, or add fresh=true to set the old results aside and start over."
        )
    saved.update({name: {"fingerprint": fingerprint(s), "settings": s} for name, s in settings.items()})
    atomic_write_text(path, json.dumps(saved, indent=1, sort_keys=True, default=str))


def _differences(old: dict, new: dict, most: int = 3) -> str:
    """'decode.max_new_tokens 48 -> 16, ...': the first settings that differ, dotted."""
    a, b = _flatten(old), _flatten(new)
    keys = [k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
    shown = ", ".join(f"{k} {a.get(k, '(none)')} -> {b.get(k, '(none)')}" for k in keys[:most])
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")


def _flatten(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix: tree if isinstance(tree, str) else json.dumps(tree, default=str)}
    return {k: v for key, value in tree.items() for k, v in _flatten(value, f"{prefix}{key}." if isinstance(value, dict) else f"{prefix}{key}").items()}
