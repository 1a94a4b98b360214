"""Self-distillation data: the target's own greedy answers to training prompts.

A drafter should predict what *this* target says, so its training answers are the target's
greedy outputs (chat template applied), recorded with the target's hidden states at the
drafter's feature layers (captured while decoding, at no extra cost). Stored as a `datasets`
dataset in shards; an interrupted build resumes at the first missing shard.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
from datasets import Array2D, Dataset, Features, Sequence, Value, concatenate_datasets, load_from_disk
from tqdm import tqdm

from bastion.bench.datasets import REASON, chat_tokens, default_data_dir, read_jsonl
from bastion.engine import generate
from bastion.models.target import Target

# Training splits only: never a test set that the benchmarks report.
SOURCES = {
    "gsm8k": (("gsm8k/train.jsonl",), lambda r: r["question"] + REASON),
    "math": (("math/train.jsonl",), lambda r: r["problem"] + REASON),
    "mbpp": (("mbpp/full-train.jsonl", "mbpp/full-validation.jsonl"), lambda r: r["text"]),
}


def training_prompts(mix: dict[str, float], n: int, seed: int = 0, data_dir: str | Path | None = None) -> list[tuple[str, str]]:
    """n (id, text) prompts drawn from the sources in proportion to `mix`, in a seeded order."""
    root = Path(data_dir or default_data_dir())
    unknown = set(mix) - set(SOURCES)
    if unknown:
        raise ValueError(f"Unknown training sources {sorted(unknown)}; known: {', '.join(SOURCES)}.")
    rng = random.Random(seed)
    total = sum(mix.values())
    prompts = []
    for name, weight in mix.items():
        files, text_of = SOURCES[name]
        missing = [f for f in files if not (root / f).exists()]
        if missing:
            raise FileNotFoundError(f"Training data {root / missing[0]} is missing; set BASTION_DATA to a ../shared/data layout.")
        records = [(f"{name}/{f}/{i}", text_of(r)) for f in files for i, r in enumerate(read_jsonl(root / f))]
        rng.shuffle(records)
        prompts += records[: round(n * weight / total)]
    rng.shuffle(prompts)
    return prompts[:n]


def build_selfdistill(
    target: Target,
    out_dir: Path,
    prompts: list[tuple[str, str]],
    layers: tuple[int, ...],
    max_new_tokens: int = 256,
    batch_size: int = 32,
) -> Dataset:
    """Decode `prompts` with the target in batches; one shard per batch under out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    n_features = len(layers) * target.args.hidden_size
    schema = Features({
        "id": Value("string"),
        "input_ids": Sequence(Value("int32")),
        "answer_start": Value("int32"),
        "features": Array2D(shape=(None, n_features), dtype="float16"),
    })
    # Batches of similar prompt length waste little prefill on padding.
    encoded = sorted(((pid, chat_tokens(target.tokenizer, [{"role": "user", "content": text}])) for pid, text in prompts), key=lambda p: len(p[1]))
    batches = [encoded[i : i + batch_size] for i in range(0, len(encoded), batch_size)]
    for k, batch in enumerate(tqdm(batches, desc="self-distillation", unit="batch")):
        shard = out_dir / f"shard_{k:05d}"
        if (shard / "dataset_info.json").exists():
            continue
        tokens = [t for _, t in batch]
        decoding = generate(target, tokens, max_new_tokens=max_new_tokens, record=layers)
        rows = {"id": [], "input_ids": [], "answer_start": [], "features": []}
        for (pid, prompt), gen in zip(batch, decoding.generations):
            rows["id"].append(pid)
            rows["input_ids"].append(prompt + gen.tokens)
            rows["answer_start"].append(len(prompt))
            rows["features"].append(gen.features.numpy().astype(np.float16))
        Dataset.from_dict(rows, features=schema).save_to_disk(str(shard))
    return load_selfdistill(out_dir, len(batches))


def load_selfdistill(out_dir: Path, n_shards: int | None = None) -> Dataset:
    shards = sorted(p for p in Path(out_dir).glob("shard_*") if (p / "dataset_info.json").exists())
    if not shards or (n_shards is not None and len(shards) < n_shards):
        raise FileNotFoundError(f"Self-distillation data in {out_dir} is incomplete; rerun the training command to finish it.")
    return concatenate_datasets([load_from_disk(str(p)) for p in shards[:n_shards]])
