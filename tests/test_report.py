"""The report: paper tables with hand-computed cells, the speedup's spread, the runs' machines, files and
plots, multirun merging, oracle rows."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from bastion.bench.metrics import (
    aal_by_tree_size,
    accepted_length_histogram,
    depth_acceptance_rate,
    summarize,
    tree_size_distribution,
)
from bastion.bench.provenance import MACHINE_FILE
from bastion.bench.report import load, main, write_report
from tests.conftest import ROOT

METHOD = "ngram+best_first+bastion"
# method -> bench -> (wall seconds for the bench's 2 prompts, decode steps per prompt, tokens per step, tree size).
# Every prompt yields 61 tokens: 1 from prefill + steps x tokens per step. AR: 10 s, AAL 1.
# gsm8k: 10 / 5 = 2.00x, AAL (122 - 2) / 40 = 3.00; math500: 10 / 2.5 = 4.00x, AAL 120 / 60 = 2.00.
PLAN = {"ar": {"gsm8k": (10.0, 60, 1, 0), "math500": (10.0, 60, 1, 0)},
        METHOD: {"gsm8k": (5.0, 20, 3, 8), "math500": (2.5, 30, 2, 2)}}
ROW = f"| {METHOD} | 2.00x / 3.00 | 4.00x / 2.00 | 3.00x / 2.50 |"
PLOTS = {"speedup_per_bench", "aal_vs_tree_size", "chosen_budget_hist", "accepted_length_hist", "depth_acceptance",
         "verify_time", "ahat_vs_accepted"}


def write_run(run_dir, plan=PLAN, batch_size=1):
    """A results.jsonl as runner.decode_batch writes it: 2 prompts per bench, in batches of
    `batch_size` that share their batch's wall time; predicted verify times for drafting methods."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "results.jsonl", "w") as f:
        for method, benches in plan.items():
            for bench, (wall, steps, produced, tree) in benches.items():
                for i in range(2):
                    new_tokens = 1 + steps * produced
                    f.write(json.dumps({
                        "method": method, "bench": bench, "prompt_id": f"{bench}/{i}", "batch_size": batch_size,
                        "turns": 1, "temperature": 0.0, "new_tokens": new_tokens, "steps": steps, "prefill_s": 0.1,
                        "batch_wall_s": wall * batch_size / 2, "batch_id": f"{bench}/{i // batch_size}",
                        "tokens": list(range(new_tokens)), "text": ["x"], "finish": ["length"],
                        "produced": [produced] * steps, "tree_sizes": [tree] * steps,
                        "expected": [produced - 0.5] * steps,
                        "step_s": [0.02] * steps, "verify_s": [0.012] * steps,
                        "predicted_verify_s": [0.01 if tree else None] * steps}) + "\n")
    return run_dir


def test_tables_files_and_plots_of_one_run(tmp_path):
    written = write_report([write_run(tmp_path)])
    md = (tmp_path / "report.md").read_text()
    assert "### T=0.0, batch 1" in md
    assert "| method | gsm8k | math500 | mean |" in md
    assert "| ar | 1.00x / 1.00 | 1.00x / 1.00 | 1.00x / 1.00 |" in md
    assert ROW in md
    tex = (tmp_path / "report.tex").read_text()
    assert r"ngram+best\_first+bastion & 2.00$\times$ / 3.00 & 4.00$\times$ / 2.00 & 3.00$\times$ / 2.50 \\" in tex
    assert r"\multicolumn{4}{l}{T=0.0, batch 1}" in tex

    csv = pd.read_csv(tmp_path / "report.csv").set_index(["method", "bench"])
    assert list(csv.reset_index().columns) == ["method", "bench", "temperature", "batch_size", "speedup", "speedup_lo",
                                               "speedup_hi", "aal", "tokens_per_s", "tpot_ms", "ttft_ms", "lossless",
                                               "lossless_ties", "n_prompts"]
    ar = csv.loc[("ar", "gsm8k")]
    assert ar.tokens_per_s == pytest.approx(12.2) and ar.tpot_ms == pytest.approx(10_000 / 122)
    assert ar.ttft_ms == pytest.approx(100) and ar.n_prompts == 2 and ar.batch_size == 1
    ours = csv.loc[(METHOD, "math500")]
    assert ours.speedup == pytest.approx(4.0) and ours.aal == pytest.approx(2.0) and bool(ours.lossless)

    assert {p.stem for p in written if p.suffix == ".png"} == PLOTS
    assert all(p.stat().st_size > 0 for p in written)


def test_command_line_prints_the_table_and_writes_to_out(tmp_path):
    run_dir = write_run(tmp_path / "run")
    result = subprocess.run([sys.executable, "-m", "bastion.bench.report", str(run_dir), "--out", str(tmp_path / "report")],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert ROW in result.stdout
    assert (tmp_path / "report" / "report.csv").exists()
    assert (tmp_path / "report" / "plots" / "speedup_per_bench.png").exists()


def test_a_dir_without_results_is_one_clear_sentence(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main([str(tmp_path)])
    assert exit.value.code == 2
    assert f"No results.jsonl with records under {tmp_path}: pass a Hydra run dir" in capsys.readouterr().err


def test_multirun_jobs_merge_into_one_table(tmp_path):
    """One bench per job, as `python run.py -m bench=gsm8k,math500` lays it out: each job's
    speedup comes from its own AR, and the table is the same as from one run with both."""
    for job, bench in enumerate(["gsm8k", "math500"]):
        write_run(tmp_path / str(job), {method: {bench: plan[bench]} for method, plan in PLAN.items()})
    write_report([tmp_path])
    md = (tmp_path / "report.md").read_text()
    assert md.count("###") == 1 and ROW in md


def test_torchrun_shards_of_a_run_are_one_run(tmp_path):
    lines = open(write_run(tmp_path) / "results.jsonl").readlines()
    for rank in (0, 1):
        (tmp_path / f"results.rank{rank}.jsonl").write_text("".join(lines[rank::2]))
    (tmp_path / "results.jsonl").unlink()
    write_report([tmp_path])
    assert ROW in (tmp_path / "report.md").read_text()


def test_a_prompt_decoded_again_after_an_edit_counts_once(tmp_path):
    """A run resumed after a prompt's text changed decodes it again (a new prompt hash) beside
    its old records: the report, like the run's summary, reads the last."""
    lines = open(write_run(tmp_path) / "results.jsonl").readlines()
    with open(tmp_path / "results.jsonl", "a") as f:
        f.writelines(line for line in lines if '"prompt_id": "gsm8k/0"' in line)
    write_report([tmp_path])
    assert ROW in (tmp_path / "report.md").read_text()


def test_batch_sizes_get_their_own_tables_and_a_batch_plot(tmp_path):
    write_run(tmp_path / "0")
    write_run(tmp_path / "1", {"ar": {"gsm8k": (6.0, 60, 1, 0)}, METHOD: {"gsm8k": (4.0, 20, 3, 8)}}, batch_size=2)
    written = write_report([tmp_path])
    md = (tmp_path / "report.md").read_text()
    assert ROW in md.split("### T=0.0, batch 2")[0]
    assert f"| {METHOD} | 1.50x / 3.00 | 1.50x / 3.00 |" in md.split("### T=0.0, batch 2")[1]
    assert "speedup_vs_batch" in {p.stem for p in written}


def test_oracle_row_is_recomputed_from_the_runs_fixed_budgets(tmp_path):
    plan = {"ar": {"gsm8k": (10.0, 60, 1, 0)}, "ngram+chain+fixed4": {"gsm8k": (5.0, 30, 2, 4)},
            "ngram+chain+fixed8": {"gsm8k": (4.0, 20, 3, 8)}}
    write_run(tmp_path, plan)
    # as the cli saved it; only the oracle's name and the prefix of its winner count
    stale = {"method": "oracle", "bench": "gsm8k", "speedup": 9.99, "aal": 9.99, "oracle_of": "ngram+chain+fixed4"}
    pd.DataFrame([stale]).to_csv(tmp_path / "summary.csv")
    long, _ = load([tmp_path])
    oracle = long.set_index("method").loc["oracle"]
    assert oracle.speedup == pytest.approx(2.5) and oracle.aal == pytest.approx(3.0)


def test_step_metrics_by_hand(tmp_path):
    """METHOD: 40 steps of 3 tokens on trees of 8 nodes, 60 steps of 2 tokens on trees of 2."""
    _, steps = load([write_run(tmp_path)])
    assert len(steps) == 4 * 60 + 2 * 20 + 2 * 30
    ours = steps[steps.method == METHOD]
    assert accepted_length_histogram(ours)[["produced", "fraction"]].values.tolist() == [[2, 0.6], [3, 0.4]]
    assert tree_size_distribution(ours)[["tree_size", "fraction"]].values.tolist() == [[2, 0.6], [8, 0.4]]
    # depth 1: every step accepted >= 1; depth 2: 40 of 100 steps; depth 3: only the 40 trees of 8 could, none did
    depth = depth_acceptance_rate(steps)
    assert depth[["method", "depth", "steps", "rate"]].values.tolist() == [
        [METHOD, 1, 100, 1.0], [METHOD, 2, 100, 0.4], [METHOD, 3, 40, 0.0]]
    assert aal_by_tree_size(steps)[["size_bin", "aal", "steps"]].values.tolist() == [[2, 2.0, 60], [8, 3.0, 40]]


def timed_records(walls: dict[str, list[float]], per_batch: int, bench: str = "gsm8k", prompts: int | None = None):
    """Records of methods whose batches (of `per_batch` prompts) took `walls` seconds each; a
    method's first `prompts` prompts only when given."""
    rows = []
    for method, times in walls.items():
        for b, wall in enumerate(times):
            for i in range(per_batch):
                rows.append({"method": method, "bench": bench, "prompt_id": f"{bench}/{b * per_batch + i}",
                             "batch_id": f"{bench}/{b * per_batch}", "batch_wall_s": wall, "new_tokens": 9, "steps": 8,
                             "turns": 1, "prefill_s": 0.1, "temperature": 0.0, "tokens": [1] * 9})
    records = pd.DataFrame(rows)
    if prompts is None:
        return records
    return records[(records.method == "ar") | (records.groupby("method").cumcount() < prompts)]


def test_speedup_interval_bounds_the_speedup_from_the_batches():
    """AR's batches over the method's: 10/5 = 2.0, 12/8 = 1.5, 9/4 = 2.25, 11/6 = 1.83; the
    speedup is 42/23 = 1.83, and every resampled ratio of sums lies within the batch ratios."""
    summary = summarize(timed_records({"ar": [10, 12, 9, 11], METHOD: [5, 8, 4, 6]}, per_batch=2)).set_index("method")
    ours = summary.loc[METHOD]
    assert ours.speedup == pytest.approx(42 / 23)
    assert 1.5 <= ours.speedup_lo < ours.speedup < ours.speedup_hi <= 2.25
    assert ours.note == ""  # 8 prompts in 4 batches: nothing to warn about
    assert summary.loc["ar", ["speedup", "speedup_lo", "speedup_hi"]].tolist() == [1.0, 1.0, 1.0]
    assert summarize(timed_records({"ar": [10, 12, 9, 11], METHOD: [5, 8, 4, 6]}, per_batch=2)).equals(
        summarize(timed_records({"ar": [10, 12, 9, 11], METHOD: [5, 8, 4, 6]}, per_batch=2)))  # no random drift


def test_a_batch_of_prompts_with_different_turn_counts_counts_every_turn():
    """Each record carries the time of the turns its prompt took part in: a batch whose first
    prompt has one turn and whose second has two took the second's time (10 + 6 s for AR, 5 + 1
    for the method)."""
    records = timed_records({"ar": [10], METHOD: [5]}, per_batch=2)
    records.loc[records.prompt_id == "gsm8k/1", "batch_wall_s"] += records.method.map({"ar": 6, METHOD: 1})
    assert summarize(records).set_index("method").loc[METHOD].speedup == pytest.approx(16 / 6)


def test_compile_time_inside_timed_steps_is_noted():
    """A step during which torch.compile built a graph is timed with it (a batch shrinking to a
    shape not compiled before): the summary says how much, per batch once."""
    records = timed_records({"ar": [10, 12], METHOD: [5, 8]}, per_batch=2).assign(compile_s=0.0)
    records.loc[(records.method == "ar") & (records.batch_id == "gsm8k/2"), "compile_s"] = 3.5
    summary = summarize(records).set_index("method")
    assert summary.loc["ar"].note == "3.5 s of its timed steps compiled (torch.compile): its wall includes them"
    assert "compiled" not in summary.loc[METHOD].note
    assert "compiled" not in summarize(timed_records({"ar": [10, 12], METHOD: [5, 8]}, per_batch=2)).note.str.cat()  # older records


def test_a_speedup_from_few_prompts_or_one_batch_is_noted():
    one_batch = summarize(timed_records({"ar": [10], METHOD: [5]}, per_batch=3)).set_index("method")
    assert one_batch.loc[METHOD].speedup == 2.0 and pd.isna(one_batch.loc[METHOD].speedup_lo)
    assert one_batch.loc[METHOD].note == ("spread blank: one batch (the interval resamples batches); "
                                          "only 3 prompt(s): too few for a reliable speedup (use 5 or more)")
    assert one_batch.loc["ar"].note == ""  # AR's speedup is 1 by definition
    partial = summarize(timed_records({"ar": [10, 10], METHOD: [5, 5]}, per_batch=2, prompts=3)).set_index("method")
    assert partial.loc[METHOD].note == ("speedup blank: 0 of its 3 prompts have no AR record, "
                                        "1 of AR's 4 have none of its")


def test_report_shows_the_spread_and_each_runs_machine(tmp_path):
    machine = {"device": "AMD EPYC", "amx": False, "profile": "cpu", "dtype": "float32", "threads": 2,
               "omp_wait_policy": None, "load": 3.14, "torch": "2.13.0", "transformers": "4.99.0",
               "commit": "abc1234-dirty"}
    for job, bench in enumerate(["gsm8k", "math500"]):  # a multirun, one bench per job
        write_run(tmp_path / str(job), {method: {bench: plan[bench]} for method, plan in PLAN.items()})
    (tmp_path / "0" / MACHINE_FILE).write_text(json.dumps(machine))
    write_report([tmp_path])
    md = (tmp_path / "report.md").read_text()
    runs, tables = md.split("### ")[0], md.split("### ")[1]
    assert (f"- `{(tmp_path / '0').resolve()}`: AMD EPYC, no AMX, torch threads 2, load 3.1 at start, profile cpu, "
            "float32, torch 2.13.0, transformers 4.99.0, commit abc1234-dirty") in runs
    assert f"- `{(tmp_path / '1').resolve()}`: machine not recorded" in runs
    assert ROW in tables and f"| {METHOD} | [2.00, 2.00], n=2 (too few) | [4.00, 4.00], n=2 (too few) |" in tables
    assert r"ngram+best\_first+bastion & [2.00, 2.00], n=2 (too few)" in (tmp_path / "report.tex").read_text()
    csv = pd.read_csv(tmp_path / "report.csv").set_index("method")
    assert csv.loc[METHOD, ["speedup_lo", "speedup_hi"]].values.tolist() == [[2.0, 2.0], [4.0, 4.0]]
