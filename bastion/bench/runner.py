"""Run methods on the same prompts in one process and record every prompt as it finishes.

Fairness: every method (AR included) decodes the same prompts with the same target on the
same machine in the same run, after an untimed warm-up (a short decode of the first batch, at
the run's batch size, by every method), with the device synchronised before each timer read
(engine.py). Methods take turns batch by batch, so a machine that speeds up or slows down
during a run (clocks, other tenants) more slowly than a round of turns shifts every method
alike; quicker changes of pace are noise, which the A/A control row and the interval over
batches show (metrics.py; experiments/NOTES.md measures how much on a shared CPU). Nothing
is lost: a record is appended and flushed per prompt, and a rerun in the same directory skips
what is already recorded with the same settings (rundir.py). At temperature > 0 each prompt's turn
is sampled under a key of its own (its id and turn), so every method, batch size and rerun
draws the same sample for it.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from bastion.bench.datasets import Prompt, chat_tokens
from bastion.bench.divergence import divergence
from bastion.bench.metrics import BASELINE, summarize
from bastion.bench.provenance import summary_fields, write_summary
from bastion.bench.records import drop_cut_line, run_records
from bastion.bench.rundir import fingerprint
from bastion.compose import Method
from bastion.models.target import Target
from bastion.sampling import GREEDY, Sampling


def run_methods(
    target: Target,
    methods: list[Method],
    prompts: list[Prompt],
    bench: str,
    out_dir: Path,
    max_new_tokens: int,
    batch_size: int = 1,
    warmup: bool = True,
    sampling: Sampling = GREEDY,
    seed: int = 0,
    shard: str = "",
    stop: tuple[str, ...] = (),
) -> None:
    """Decode `prompts` with every method; append a record per prompt to
    out_dir/results{shard}.jsonl, skipping those already there with the method's settings and
    the prompt's text (under the run dir's lock, after rundir.check_run_dir refused other
    settings). At temperature 0 a record whose output differs from AR's keeps its first
    divergence (divergence.py)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / f"results{shard}.jsonl"
    current = {(m.name, fingerprint(m.settings)) for m in methods}
    kept = [r for r in run_records(out_dir) if (r["method"], r.get("fingerprint")) in current]  # every shard's: a run
    # resumed by another number of processes (torchrun's, or a plain one) repeats none, nor holds a record twice
    done = {(r["method"], r["bench"], r["prompt_id"], r["prompt_hash"]) for r in kept}
    ar = {r["prompt_id"]: r for r in kept if r["method"] == BASELINE and r["bench"] == bench}  # AR's records, to compare with
    if warmup and prompts:  # the first batch at the run's batch size: a batch-1 warm-up leaves larger batches' shapes cold
        first = [chat_tokens(target, [{"role": "user", "content": p.turns[0]}])
                 for p in prompts[:batch_size]]
        for method in methods:
            method.generate(target, first, min(8, max_new_tokens), sampling, seed, stop)
            if len(first) > 1:  # and one row, where a batch ends: compiled kernels (flex on CUDA) specialise a batch of 1
                method.generate(target, first[:1], min(8, max_new_tokens), sampling, seed, stop)
    drop_cut_line(results)
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    with open(results, "a") as sink, tqdm(total=len(batches) * len(methods), desc=bench, unit="batch", leave=False) as bar:
        for batch in batches:  # every method on one batch, then the next: slow drift of the machine hits all alike
            for method in methods:
                bar.set_postfix_str(method.name)
                todo = [p for p in batch if (method.name, bench, p.id, prompt_hash(p)) not in done]
                if todo:
                    for prompt, record in zip(todo, decode_batch(target, method, todo, bench, max_new_tokens, sampling, seed, stop)):
                        if method.name == BASELINE:
                            ar[prompt.id] = record
                        elif sampling.greedy and prompt.id in ar:
                            record["divergence"] = divergence(target, prompt, ar[prompt.id], record)
                        sink.write(json.dumps(record) + "\n")
                    sink.flush()
                bar.update()


def prompt_hash(prompt: Prompt) -> str:
    """A prompt's text, fingerprinted: an edited prompt file does not resume old answers."""
    return f"{zlib.crc32(json.dumps(prompt.turns).encode()):08x}"


def sample_key(prompt: Prompt, turn: int) -> int:
    """The key a prompt's turn is sampled under (engine.generate's `keys`)."""
    return zlib.crc32(f"{prompt.id}\0{turn}".encode())


def summarize_run(out_dir: Path, prompts: dict[str, list[Prompt]]) -> pd.DataFrame:
    """Summary over this run's prompts (per benchmark, every shard's records) with the run's
    machine, profile, dtype and commit (provenance.py), written to out_dir/summary.csv. Records
    kept twice (two writers, or a hand-merged file) are refused, naming one, rather than
    summarised into a blank speedup."""
    records = pd.DataFrame(run_records(out_dir))
    wanted = {(bench, p.id, prompt_hash(p)) for bench, ps in prompts.items() for p in ps}
    records = records[[key in wanted for key in zip(records.bench, records.prompt_id, records.prompt_hash)]]
    doubled = records[records.duplicated(["method", "bench", "prompt_id"])]
    if len(doubled):
        first = doubled.iloc[0]
        raise ValueError(f"{out_dir} holds {len(doubled)} record(s) twice, e.g. {first.method} on {first.prompt_id}: two runs "
                         "wrote it at once, or results files were merged; rerun into a new hydra.run.dir.")
    summary = summarize(records).assign(**summary_fields(out_dir))
    write_summary(summary, out_dir / "summary.csv")
    return summary


def decode_batch(target: Target, method: Method, batch: list[Prompt], bench: str, max_new_tokens: int,
                 sampling: Sampling = GREEDY, seed: int = 0, stop: tuple[str, ...] = ()) -> list[dict]:
    """Decode a batch of prompts turn by turn (a later turn sees the model's own earlier answers)."""
    conversations: list[list[dict]] = [[] for _ in batch]
    records = [
        {"method": method.name, "bench": bench, "prompt_id": p.id, "prompt_hash": prompt_hash(p),
         "fingerprint": fingerprint(method.settings), "batch_size": len(batch), "turns": len(p.turns),
         "temperature": sampling.temperature, "tree_mode": sampling.tree_mode,
         "new_tokens": 0, "steps": 0, "prefill_s": 0.0, "batch_wall_s": 0.0, "compile_s": 0.0, "tokens": [], "turn_tokens": [], "text": [],
         "finish": [],
         "produced": [], "tree_sizes": [], "expected": [], "step_s": [], "verify_s": [], "predicted_verify_s": []}
        for p in batch
    ]
    for turn in range(max(len(p.turns) for p in batch)):
        rows = [i for i, p in enumerate(batch) if turn < len(p.turns)]
        for i in rows:
            conversations[i].append({"role": "user", "content": batch[i].turns[turn]})
        decoding = method.generate(target, [chat_tokens(target, conversations[i]) for i in rows], max_new_tokens,
                                   sampling, seed, stop, [sample_key(batch[i], turn) for i in rows])
        for row, (i, gen) in enumerate(zip(rows, decoding.generations)):
            text = target.tokenizer.decode(gen.tokens, skip_special_tokens=True)
            conversations[i].append({"role": "assistant", "content": text})
            rec = records[i]
            rec["tokens"] += gen.tokens
            rec["turn_tokens"].append(len(gen.tokens))
            rec["text"].append(text)
            rec["finish"].append(gen.finish)
            rec["new_tokens"] += len(gen.tokens)
            rec["steps"] += gen.steps
            rec["prefill_s"] += decoding.prefill_s
            rec.setdefault("ttft_s", decoding.prefill_s)  # the first turn's: its first token comes with its prefill
            rec["batch_wall_s"] += decoding.wall_s
            rec["compile_s"] += sum(step.draft_s + step.verify_s + step.other_s for step in decoding.steps if step.compiled)
            for step in decoding.steps:
                if row in step.rows:
                    k = step.rows.index(row)
                    rec["produced"].append(step.produced[k])
                    rec["tree_sizes"].append(step.tree_sizes[k])
                    rec["expected"].append(step.expected[k])
                    rec["step_s"].append(step.draft_s + step.verify_s + step.other_s)
                    rec["verify_s"].append(step.verify_s)
                    rec["predicted_verify_s"].append(step.predicted_verify_s)
    batch_id = f"{bench}/{batch[0].id}"
    for rec in records:
        rec["batch_id"] = batch_id
    return records
