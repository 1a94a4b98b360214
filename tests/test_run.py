"""`python run.py` end to end on a tiny model: the files it writes, and resuming."""

from __future__ import annotations

import json

import pandas as pd

from tests.test_errors import run_py

ARGS = ["target=tiny_qwen3", "bench.limit=3", "decode.max_new_tokens=6", "drafter.block_size=4", "budget.nodes=4"]


def test_run_writes_records_and_summary_then_resumes(tmp_path):
    result = run_py(*ARGS, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert len(records) == 6 and {r["method"] for r in records} == {"ar", "ngram+best_first+fixed4"}
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert {"method", "bench", "n_prompts", "new_tokens", "aal", "tokens_per_s", "speedup", "lossless"} <= set(summary.columns)
    ar = summary.set_index("method").loc["ar"]
    assert ar.aal == 1.0 and ar.speedup == 1.0 and ar.n_prompts == 3
    assert summary.lossless.all()
    assert "ngram+best_first+fixed4" in result.stdout  # the table is printed

    # a rerun in the same directory decodes nothing again and duplicates nothing
    again = run_py(*ARGS, "bench.limit=4", f"hydra.run.dir={tmp_path}")
    assert again.returncode == 0, again.stderr
    records = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert len(records) == 8
    assert len({(r["method"], r["prompt_id"]) for r in records}) == 8


def test_cfg_job_prints_the_composed_config():
    result = run_py("--cfg", "job")
    assert result.returncode == 0
    for group in ("target:", "drafter:", "tree:", "budget:", "gpu:", "bench:", "logger:"):
        assert group in result.stdout
