"""`python run.py` end to end on a tiny model: the files it writes, and resuming."""

from __future__ import annotations

import json

from bastion.bench.provenance import read_summary
from tests.test_errors import run_py

ARGS = ["target=tiny_qwen3", "drafter=ngram", "budget=fixed", "bench.limit=3", "decode.max_new_tokens=6", "drafter.drafts=4", "budget.nodes=4"]


def test_run_writes_records_and_summary_then_resumes(tmp_path):
    result = run_py(*ARGS, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert len(records) == 6 and {r["method"] for r in records} == {"ar", "ngram+best_first+fixed4"}
    summary = read_summary(tmp_path / "summary.csv")
    assert {"method", "bench", "n_prompts", "new_tokens", "aal", "tokens_per_s", "speedup", "lossless"} <= set(summary.columns)
    ar = summary.set_index("method").loc["ar"]
    assert ar.aal == 1.0 and ar.speedup == 1.0 and ar.n_prompts == 3
    assert summary.lossless.all()
    assert "ngram+best_first+fixed4" in result.stdout  # the table is printed
    assert "[INFO]" not in result.stdout  # plain messages on the console, no timestamps
    log = (tmp_path / "run.log").read_text()  # Hydra's job log holds what the console showed
    assert "ngram+best_first+fixed4" in log and f"records: {tmp_path / 'results.jsonl'}\n" in log

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


def test_torchrun_shards_prompts_and_merges_records(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "run.py", *ARGS, "bench.limit=5",
            f"hydra.run.dir={tmp_path}"]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    shards = [[json.loads(line) for line in open(tmp_path / f"results.rank{r}.jsonl")] for r in (0, 1)]
    assert {len(s) for s in shards} == {6, 4}  # 5 prompts x 2 methods: prompts 0, 2, 4 and 1, 3
    assert not {r["prompt_id"] for r in shards[0]} & {r["prompt_id"] for r in shards[1]}
    summary = read_summary(tmp_path / "summary.csv")
    assert (summary.n_prompts == 5).all() and summary.lossless.all()
    assert f"records: {tmp_path / 'results.rank0.jsonl'}, {tmp_path / 'results.rank1.jsonl'}\n" in result.stdout  # the files written
