"""Self-distillation data: the target's own greedy answers to training prompts.

A drafter should predict what *this* target says, so its training answers are the target's
greedy outputs (chat template applied), recorded with the target's hidden states at the
drafter's feature layers (captured while decoding, at no extra cost).

Stored as `datasets` shards, one folder per source (`<dir>/<source>/shard_k`). Each source's
prompts come in a seeded order that does not depend on how many are asked for, cut into shards
of `batch_size` prompts, so a bigger `n_prompts` or another mix reuses every shard already
built; a shard is rebuilt only when its prompt ids changed, and an interrupted build resumes at
the first missing shard.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Mapping
from pathlib import Path

from datasets import Array2D, Dataset, Features, Sequence, Value, concatenate_datasets, load_from_disk
from tqdm import tqdm

from bastion.bench.datasets import REASON, chat_tokens, default_data_dir, read_jsonl
from bastion.engine import generate
from bastion.files import atomic_write_text, read_json
from bastion.models.target import Target
from bastion.recorder import FeatureRecorder
from bastion.sampling import Sampling

# Training splits only: never a test set that the benchmarks report.
FILE_SOURCES = {
    "gsm8k": (("gsm8k/train.jsonl",), lambda r: r["question"] + REASON),
    "math": (("math/train.jsonl",), lambda r: r["problem"] + REASON),
    "mbpp": (("mbpp/full-train.jsonl", "mbpp/full-validation.jsonl"), lambda r: r["text"]),
}
# "chat": requests the target writes itself (see chat_prompts); the offline data has no chat training split.
SOURCES = (*FILE_SOURCES, "chat")
BARREN_ROUNDS = 5


def check_mix(mix, n_prompts, untrained_target: bool) -> None:
    """Refuse, before the target loads, a data mix that would fail minutes into building the
    data: not a mapping of known sources to weights, no prompt at all, a file source missing or
    asked for more prompts than it holds, or chat requests asked of a target with random
    weights (an untrained target writes none that chat_prompts keeps, and chat is built after
    the file sources)."""
    if not isinstance(mix, Mapping):
        raise ValueError(f"data.mix must map training sources to weights, e.g. data.mix={{gsm8k: 0.8, chat: 0.2}} (got {mix}).")
    if isinstance(n_prompts, bool) or not isinstance(n_prompts, int) or n_prompts < 1:
        raise ValueError(f"data.n_prompts must be a whole number of at least 1 (got {n_prompts}).")
    counts = source_counts(dict(mix), n_prompts)
    if not counts:
        raise ValueError(f"data.n_prompts={n_prompts} rounds to no prompt for any source of data.mix; ask for more prompts.")
    if "chat" in counts and untrained_target:
        raise ValueError("The chat source has the target write its own requests and a target with random weights writes none; "
                         "drop it with ~data.mix.chat or give a mix without chat, e.g. data.mix={gsm8k: 1.0}.")
    for name, count in counts.items():
        if name in FILE_SOURCES:
            file_prompts(name, count)


def source_counts(mix: dict[str, float], n: int) -> dict[str, int]:
    """How many of the n prompts each source gives, in proportion to `mix` (weights >= 0, not all 0)."""
    unknown = set(mix) - set(SOURCES)
    if unknown:
        raise ValueError(f"Unknown training sources {sorted(unknown)}; known: {', '.join(SOURCES)}.")
    weights = list(mix.values())
    if not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"data.mix weights must be numbers of at least 0, not all 0 (got {dict(mix)}).")
    total = sum(weights)
    return {name: round(n * weight / total) for name, weight in mix.items() if round(n * weight / total)}


def source_prompts(target: Target, name: str, count: int, out_dir: Path, seed: int = 0) -> list[tuple[str, str]]:
    """The first `count` (id, text) prompts of source `name` (its data folder: out_dir)."""
    return chat_prompts(target, count, out_dir, seed) if name == "chat" else file_prompts(name, count, seed)


def file_prompts(name: str, count: int, seed: int = 0, data_dir: str | Path | None = None) -> list[tuple[str, str]]:
    """The first `count` (id, text) prompts of a file source in its seeded order."""
    root = Path(data_dir or default_data_dir())
    files, text_of = FILE_SOURCES[name]
    missing = [f for f in files if not (root / f).exists()]
    if missing:
        raise FileNotFoundError(f"Training data {root / missing[0]} is missing; set BASTION_DATA to a ../shared/data layout.")
    records = [(f"{name}/{f}/{i}", text_of(r)) for f in files for i, r in enumerate(read_jsonl(root / f))]
    if count > len(records):
        raise ValueError(f"Training source {name} has {len(records)} prompts; the mix asks for {count}.")
    random.Random(f"{seed}/{name}").shuffle(records)
    return records[:count]


def chat_prompts(target: Target, count: int, cache: Path, seed: int = 0, *, batch_size: int = 64,
                 max_new_tokens: int = 96) -> list[tuple[str, str]]:
    """`count` user requests written by the target itself, sampled (T=1, top-p 0.95) right after
    the chat template opens a user turn (the Magpie recipe). Without them a drafter learns math
    and code only, and MT-Bench's 80 questions are a test set. Kept are requests that end their
    turn, have 3 to 200 words and are new; the list is cached in order (`cache/prompts.json`),
    so asking for more continues it. A target that writes no usable request in `BARREN_ROUNDS`
    rounds in a row (an untrained one) is refused."""
    path = cache / "prompts.json"
    state = read_json(path, "delete it to write the requests again") if path.exists() else {"rounds": 0, "prompts": []}
    prefix, tok = user_turn_prefix(target.tokenizer), target.tokenizer
    seen, barren = set(state["prompts"]), 0
    with tqdm(total=count, initial=min(len(seen), count), desc="chat prompts", unit="prompt") as bar:
        while len(state["prompts"]) < count:
            if barren == BARREN_ROUNDS:
                raise RuntimeError(f"{target.name} wrote no usable chat request in {barren} rounds of {batch_size}; drop chat from data.mix.")
            decoding = generate(target, [prefix] * batch_size, max_new_tokens=max_new_tokens,
                                sampling=Sampling(temperature=1.0, top_p=0.95), seed=seed * 1_000_003 + state["rounds"])
            state["rounds"], before = state["rounds"] + 1, len(state["prompts"])
            for gen in decoding.generations:
                text = tok.decode(gen.tokens[:-1], skip_special_tokens=True).strip()
                if gen.finish == "eos" and 3 <= len(text.split()) <= 200 and text not in seen:
                    seen.add(text)
                    state["prompts"].append(text)
                    bar.update(len(state["prompts"]) <= count)
            barren = 0 if len(state["prompts"]) > before else barren + 1
            atomic_write_text(path, json.dumps(state, indent=0))
    return [(f"chat/{i}", text) for i, text in enumerate(state["prompts"][:count])]


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user message's text starts."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("The chat training source needs a tokenizer with a chat template.")
    marker = "\x00MESSAGE\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return tokenizer.encode(text[: text.index(marker)], add_special_tokens=False)


def build_selfdistill(
    target: Target,
    out_dir: Path,
    prompts: list[tuple[str, str]],
    layers: tuple[int, ...],
    max_new_tokens: int = 256,
    batch_size: int = 32,
    top_k: int = 0,
) -> Dataset:
    """Decode `prompts` (one source, in order) with the target; one shard per batch under out_dir.
    With `top_k`, each answer token also keeps the target's top_k tokens and log-probs there."""
    out_dir.mkdir(parents=True, exist_ok=True)
    n_features = len(layers) * target.args.hidden_size
    schema = Features({
        "id": Value("string"),
        "input_ids": Sequence(Value("int32")),
        "answer_start": Value("int32"),
        "features": Array2D(shape=(None, n_features), dtype="float16"),
        **({"top_ids": Array2D(shape=(None, top_k), dtype="int32"),
            "top_logprobs": Array2D(shape=(None, top_k), dtype="float16")} if top_k else {}),
    })
    encoded = [(pid, chat_tokens(target.tokenizer, [{"role": "user", "content": text}])) for pid, text in prompts]
    # Sorted by length inside a batch: little prefill wasted on padding, same shards for any n.
    batches = [sorted(encoded[i : i + batch_size], key=lambda p: len(p[1])) for i in range(0, len(encoded), batch_size)]
    shards = [out_dir / f"shard_{k:05d}" for k in range(len(batches))]
    for shard, batch in zip(tqdm(shards, desc=f"self-distillation {out_dir.name}", unit="batch"), batches):
        if shard_ids(shard) == [pid for pid, _ in batch]:
            continue
        tokens = [t for _, t in batch]
        recorder = FeatureRecorder(layers, top_k)
        decoding = generate(target, tokens, max_new_tokens=max_new_tokens, recorder=recorder)
        rows = {name: [] for name in schema}
        for i, ((pid, prompt), gen) in enumerate(zip(batch, decoding.generations)):
            rows["id"].append(pid)
            rows["input_ids"].append(prompt + gen.tokens)
            rows["answer_start"].append(len(prompt))
            rows["features"].append(recorder.features[i].numpy())
            if top_k:
                rows["top_ids"].append(recorder.top_ids[i].numpy())
                rows["top_logprobs"].append(recorder.top_logprobs[i].numpy())
        shutil.rmtree(shard, ignore_errors=True)
        Dataset.from_dict(rows, features=schema).save_to_disk(str(shard))
    return concatenate_datasets([load_from_disk(str(s)) for s in shards])


def shard_ids(shard: Path) -> list[str] | None:
    """The prompt ids a finished shard holds (None when it is missing or unfinished)."""
    if not (shard / "dataset_info.json").exists():
        return None
    return load_from_disk(str(shard))["id"]
