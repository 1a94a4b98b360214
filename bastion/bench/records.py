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


def run_records(run_dir: Path) -> list[dict]:
    """All records of a run dir: results.jsonl, or torchrun's results.rankN.jsonl shards."""
    return [r for path in sorted(Path(run_dir).glob("results*.jsonl")) for r in read_records(path)]
