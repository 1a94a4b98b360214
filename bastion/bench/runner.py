"""Run methods on the same prompts in one process and record every prompt as it finishes.

Fairness: every method (AR included) decodes the same prompts with the same target on the
same machine in the same run, after an untimed warm-up, with the device synchronised before
each timer read (engine.py). Methods take turns batch by batch, so a machine that speeds up or
slows down during a run (clocks, other tenants) shifts every method alike. Nothing is lost: a
record is appended and flushed per prompt, and a rerun in the same directory skips what is
already recorded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from bastion.bench.datasets import Prompt, chat_tokens
from bastion.bench.metrics import summarize
from bastion.bench.records import drop_cut_line, read_records, run_records
from bastion.engine import generate
from bastion.models.target import Target
from bastion.sampling import GREEDY, Sampling


@dataclass
class Method:
    """One decoding method: AR is the one without a drafter."""

    name: str
    drafter: object | None = None
    policy: object | None = None
    budget: object | None = None
    oracle: str | None = None  # an oracle sweep's fixed budgets share the name their best is reported under

    def generate(self, target: Target, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = GREEDY,
                 seed: int = 0, stop: tuple[str, ...] = ()):
        return generate(target, prompts, drafter=self.drafter, policy=self.policy, budget=self.budget,
                        max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, stop_strings=stop)


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
    out_dir/results{shard}.jsonl, skipping those already there."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / f"results{shard}.jsonl"
    done = {(r["method"], r["bench"], r["prompt_id"]) for r in read_records(results)}
    if warmup:
        first = chat_tokens(target.tokenizer, [{"role": "user", "content": prompts[0].turns[0]}])
        for method in methods:
            method.generate(target, [first], min(8, max_new_tokens), sampling, seed, stop)
    drop_cut_line(results)
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    with open(results, "a") as sink, tqdm(total=len(batches) * len(methods), desc=bench, unit="batch", leave=False) as bar:
        for batch in batches:  # every method on one batch, then the next: slow drift of the machine hits all alike
            for method in methods:
                bar.set_postfix_str(method.name)
                todo = [p for p in batch if (method.name, bench, p.id) not in done]
                if todo:
                    for record in decode_batch(target, method, todo, bench, max_new_tokens, sampling, seed, stop):
                        sink.write(json.dumps(record) + "\n")
                    sink.flush()
                bar.update()


def summarize_run(out_dir: Path, prompts: dict[str, list[Prompt]]) -> pd.DataFrame:
    """Summary over this run's prompts (per benchmark, every shard's records), written to
    out_dir/summary.csv."""
    records = pd.DataFrame(run_records(out_dir))
    wanted = {(bench, p.id) for bench, ps in prompts.items() for p in ps}
    keep = [(b, p) in wanted for b, p in zip(records.bench, records.prompt_id)]
    summary = summarize(records[keep])
    summary.to_csv(out_dir / "summary.csv", index=False)
    return summary


def decode_batch(target: Target, method: Method, batch: list[Prompt], bench: str, max_new_tokens: int,
                 sampling: Sampling = GREEDY, seed: int = 0, stop: tuple[str, ...] = ()) -> list[dict]:
    """Decode a batch of prompts turn by turn (a later turn sees the model's own earlier answers)."""
    conversations: list[list[dict]] = [[] for _ in batch]
    records = [
        {"method": method.name, "bench": bench, "prompt_id": p.id, "batch_size": len(batch), "turns": len(p.turns),
         "temperature": sampling.temperature,
         "new_tokens": 0, "steps": 0, "prefill_s": 0.0, "batch_wall_s": 0.0, "tokens": [], "text": [], "finish": [],
         "produced": [], "tree_sizes": [], "expected": [], "step_s": [], "verify_s": [], "predicted_verify_s": []}
        for p in batch
    ]
    for turn in range(max(len(p.turns) for p in batch)):
        rows = [i for i, p in enumerate(batch) if turn < len(p.turns)]
        for i in rows:
            conversations[i].append({"role": "user", "content": batch[i].turns[turn]})
        decoding = method.generate(target, [chat_tokens(target.tokenizer, conversations[i]) for i in rows], max_new_tokens, sampling, seed, stop)
        for row, (i, gen) in enumerate(zip(rows, decoding.generations)):
            text = target.tokenizer.decode(gen.tokens, skip_special_tokens=True)
            conversations[i].append({"role": "assistant", "content": text})
            rec = records[i]
            rec["tokens"] += gen.tokens
            rec["text"].append(text)
            rec["finish"].append(gen.finish)
            rec["new_tokens"] += len(gen.tokens)
            rec["steps"] += gen.steps
            rec["prefill_s"] += decoding.prefill_s
            rec["batch_wall_s"] += decoding.wall_s
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
