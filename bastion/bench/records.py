"""Result records on disk: one JSON object per prompt x method, appended as prompts finish.
Torch-free, so reports and notebooks start fast."""

from __future__ import annotations

import json
from pathlib import Path


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut short by a kill: that prompt simply runs again
    return records


def drop_cut_line(path: Path) -> None:
    """Truncate a last line cut short by a kill, so records appended next start on a line of
    their own instead of merging with it (and both being lost)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        if f.read(1) != b"\n":  # only then read the file, to find the last complete line
            f.seek(0)
            f.truncate(f.read().rfind(b"\n") + 1)


def run_records(run_dir: Path) -> list[dict]:
    """All records of a run dir: results.jsonl, or torchrun's results.rankN.jsonl shards."""
    return [r for path in sorted(Path(run_dir).glob("results*.jsonl")) for r in read_records(path)]
