"""Self-distillation data: the target's own greedy answers to training prompts.

A drafter should predict what *this* target says, so its training answers are the target's
greedy outputs (chat template applied), recorded with the target's hidden states at the
drafter's feature layers (captured while decoding, at no extra cost).

Stored as `datasets` shards, one folder per source (`<dir>/<source>/shard_k`). Each source's
prompts come in a seeded order that does not depend on how many are asked for, cut into shards
of `batch_size` prompts, so a bigger `n_prompts` or another mix reuses every shard already
built; a shard is rebuilt only when its prompt ids changed, and an interrupted build resumes at
the first missing shard. A shard is written whole or not at all (files.atomic_dir), so a kill
leaves none half-written.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from datasets import Array2D, Dataset, Features, Sequence, Value, concatenate_datasets, load_from_disk
from tqdm import tqdm

from bastion.bench.datasets import REASON, chat_tokens, default_data_dir, read_jsonl
from bastion.budget.hardware import device_name
from bastion.engine import generate
from bastion.files import atomic_dir, atomic_write_text, read_json
from bastion.models.cpu import has_amx
from bastion.models.target import Target
from bastion.recorder import FeatureRecorder
from bastion.sampling import Sampling

# Training splits only: never a test set that the benchmarks report.
FILE_SOURCES = {
    "gsm8k": (("gsm8k/train.jsonl",), lambda r: r["question"] + REASON),
    "math": (("math/train.jsonl",), lambda r: r["problem"] + REASON),
    "mbpp": (("mbpp/full-train.jsonl", "mbpp/full-validation.jsonl"), lambda r: r["text"]),
}
# Written by the target itself (the offline data has no chat training split): "chat", first
# requests (chat_prompts); "followup", the user's next message after the target's answer to
# one of them (followup_prompts), so that second turns are trained on too.
SOURCES = (*FILE_SOURCES, "chat", "followup")
BARREN_ROUNDS = 5
# Openings of a user request that the target completes: an unprompted small model drifts to a
# few topics, while people ask an assistant for code, writing, explanations, advice and plans.
# None leaves the request unprompted (the Magpie recipe).
OPENERS = (
    None, None, None, None,
    "Can you help me fix this code", "Write a Python function that", "How do I", "What is the difference between",
    "Explain", "Explain to a beginner how", "Why does", "Write a short story about", "Write an email to",
    "Write a poem about", "Rewrite the following paragraph", "Summarize", "Give me a list of", "What are some tips for",
    "I need advice on", "Plan a", "Compare", "Translate", "Write a SQL query", "Write a JavaScript function",
    "My program crashes when", "Describe", "Suggest names for", "What should I consider when", "Create a recipe for",
    "Help me write a cover letter for", "What happened during", "Give me a step-by-step guide to", "Is it true that",
    "Brainstorm ideas for", "Write a dialogue between", "How can I improve", "Design a",
)

BUILD_FILE = "build.json"  # in each shard: how long decoding it took, and on what machine
Messages = list[dict]  # a conversation: {"role": "user" | "assistant", "content": ...} in order


def check_mix(mix, n_prompts, untrained_target: bool) -> None:
    """Refuse, before the target loads, a data mix that would fail minutes into building the
    data: not a mapping of known sources to weights, no prompt at all, a file source missing or
    asked for more prompts than it holds, requests asked of a target with random weights (an
    untrained target writes none that chat_prompts keeps, and chat is built after the file
    sources), or more follow-ups than chat conversations to follow."""
    if not isinstance(mix, Mapping):
        raise ValueError(f"data.mix must map training sources to weights, e.g. data.mix={{gsm8k: 0.8, chat: 0.2}} (got {mix}).")
    if isinstance(n_prompts, bool) or not isinstance(n_prompts, int) or n_prompts < 1:
        raise ValueError(f"data.n_prompts must be a whole number of at least 1 (got {n_prompts}).")
    counts = source_counts(dict(mix), n_prompts)
    if not counts:
        raise ValueError(f"data.n_prompts={n_prompts} rounds to no prompt for any source of data.mix; ask for more prompts.")
    if counts.get("followup", 0) > counts.get("chat", 0):
        raise ValueError(f"data.mix asks for {counts['followup']} follow-ups of {counts.get('chat', 0)} chat conversations; "
                         "each follow-up continues its own chat conversation, so give chat at least followup's weight.")
    if {"chat", "followup"} & set(counts) and untrained_target:
        raise ValueError("The chat and followup sources have the target write its own requests and a target with random weights "
                         "writes none; drop them with ~data.mix.chat ~data.mix.followup or give a mix without them, e.g. data.mix={gsm8k: 1.0}.")
    for name, count in counts.items():
        if name in FILE_SOURCES:
            file_prompts(name, count)


def source_counts(mix: dict[str, float], n: int) -> dict[str, int]:
    """How many of the n prompts each source gives, in proportion to `mix` (weights >= 0, not
    all 0), in the order they are built: followup after the chat conversations it continues."""
    unknown = set(mix) - set(SOURCES)
    if unknown:
        raise ValueError(f"Unknown training sources {sorted(unknown)}; known: {', '.join(SOURCES)}.")
    weights = list(mix.values())
    if not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"data.mix weights must be numbers of at least 0, not all 0 (got {dict(mix)}).")
    total = sum(weights)
    counts = {name: round(n * weight / total) for name, weight in mix.items() if round(n * weight / total)}
    return dict(sorted(counts.items(), key=lambda item: item[0] == "followup"))


def source_prompts(target: Target, name: str, count: int, out_dir: Path, seed: int = 0) -> list[tuple[str, Messages]]:
    """The first `count` (id, conversation) prompts of source `name` (its data folder: out_dir;
    a follow-up reads the chat source's data beside it)."""
    if name == "chat":
        return chat_prompts(target, count, out_dir, seed)
    if name == "followup":
        return followup_prompts(target, count, out_dir, out_dir.parent / "chat", seed)
    return file_prompts(name, count, seed)


def file_prompts(name: str, count: int, seed: int = 0) -> list[tuple[str, Messages]]:
    """The first `count` (id, conversation) prompts of a file source in its seeded order."""
    root = Path(default_data_dir())
    files, text_of = FILE_SOURCES[name]
    missing = [f for f in files if not (root / f).exists()]
    if missing:
        raise FileNotFoundError(f"Training data {root / missing[0]} is missing; set BASTION_DATA to a ../shared/data layout.")
    records = [(f"{name}/{f}/{i}", [user(text_of(r))]) for f in files for i, r in enumerate(read_jsonl(root / f))]
    if count > len(records):
        raise ValueError(f"Training source {name} has {len(records)} prompts; the mix asks for {count}.")
    random.Random(f"{seed}/{name}").shuffle(records)
    return records[:count]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def prompt_id(source: str, index: int, messages: Messages) -> str:
    """`source/index-digest`: the digest of the conversation makes a shard written from other
    requests (an earlier way of writing them) be rebuilt, not reused for its ids."""
    digest = hashlib.sha1(json.dumps(messages).encode()).hexdigest()[:8]
    return f"{source}/{index}-{digest}"


def chat_prompts(target: Target, count: int, cache: Path, seed: int = 0, *, batch_size: int = 64,
                 max_new_tokens: int = 96) -> list[tuple[str, Messages]]:
    """`count` first requests written by the target itself: sampled right after the chat
    template opens a user turn (the Magpie recipe), three in four continuing one of OPENERS.
    Without them a drafter learns math and code only, and MT-Bench's 80 questions are a test set."""
    tok = target.tokenizer
    template = user_turn_prefix(target)

    def round_prompts(round_: int) -> list[tuple[str | None, list[int], int]]:
        rng = random.Random(f"{seed}/chat/{round_}")
        openers = [rng.choice(OPENERS) for _ in range(batch_size)]
        return [(o, template + (tok.encode(o, add_special_tokens=False) if o else []), len(template)) for o in openers]

    requests = written_requests(target, count, cache / "requests.json", "chat request", round_prompts, seed, max_new_tokens)
    return [(prompt_id("chat", i, [user(text)]), [user(text)]) for i, (_, text) in enumerate(requests)]


def followup_prompts(target: Target, count: int, cache: Path, chat_dir: Path, seed: int = 0, *, batch_size: int = 64,
                     max_new_tokens: int = 96) -> list[tuple[str, Messages]]:
    """`count` second turns: the user's next message after the target's first answer, sampled
    as in chat_prompts right after the template opens the next user turn, for the chat
    conversations (the chat source's data in `chat_dir`, built first) whose answer ended, in
    their order. The prompt is the whole conversation."""
    tok = target.tokenizer
    chats = dict(chat_prompts(target, count_shards(chat_dir), chat_dir, seed))
    rows = [row for s in sorted(chat_dir.glob("shard_*")) if shard_ids(s) is not None
            for row in load_from_disk(str(s)).select_columns(["id", "input_ids", "answer_start"])]
    firsts = [[*chats[row["id"]], {"role": "assistant", "content": tok.decode(answer[:-1]).strip()}]
              for row in rows for answer in [row["input_ids"][row["answer_start"]:]]
              if row["id"] in chats and answer[-1] in target.eos_ids]
    if not firsts:
        raise RuntimeError(f"No chat conversation in {chat_dir} has a finished first answer; build the chat source first.")

    def round_prompts(round_: int) -> list[tuple[int, list[int], int]]:
        picked = [(round_ * batch_size + j) % len(firsts) for j in range(min(batch_size, len(firsts)))]
        return [(i, p, len(p)) for i in picked for p in [user_turn_prefix(target, firsts[i])]]

    requests = written_requests(target, count, cache / "requests.json", "follow-up request", round_prompts, seed,
                                max_new_tokens)
    conversations = [[*firsts[i], user(text)] for i, text in requests]
    return [(prompt_id("followup", i, conv), conv) for i, conv in enumerate(conversations)]


def written_requests(target: Target, count: int, path: Path, what: str, round_prompts: Callable[[int], list[tuple]],
                     seed: int, max_new_tokens: int) -> list[list]:
    """The first `count` requests the target writes, as [key, text]: each round, a continuation
    (T=1, top-p 0.95) of every prefix in `round_prompts(round)`, given as (key, token ids, where
    the request's own tokens start). Kept are requests that end their turn, have 3 to 200 words
    and are new; the list is cached in order at `path`, so asking for more continues it. A
    target that writes no usable request in BARREN_ROUNDS rounds in a row (an untrained one) is
    refused."""
    state = read_json(path, "delete it to write the requests again") if path.exists() else {"rounds": 0, "requests": []}
    seen, barren = {json.dumps(r) for r in state["requests"]}, 0
    with tqdm(total=count, initial=min(len(seen), count), desc=f"{what}s", unit="request") as bar:
        while len(state["requests"]) < count:
            if barren == BARREN_ROUNDS:
                raise RuntimeError(f"{target.name} wrote no usable {what} in {barren} rounds; drop its source from data.mix.")
            keys, prefixes, starts = zip(*round_prompts(state["rounds"]))
            started = time.perf_counter()
            decoding = generate(target, list(prefixes), max_new_tokens=max_new_tokens,
                                sampling=Sampling(temperature=1.0, top_p=0.95), seed=seed * 1_000_003 + state["rounds"])
            state["rounds"], before = state["rounds"] + 1, len(state["requests"])
            state["seconds"] = round(state.get("seconds", 0) + time.perf_counter() - started, 2)  # (absent in older files)
            state["machines"] = sorted({*state.get("machines", []), machine(str(target.device))})
            for key, prefix, start, gen in zip(keys, prefixes, starts, decoding.generations):
                text = target.tokenizer.decode(prefix[start:] + gen.tokens[:-1], skip_special_tokens=True).strip()
                entry = [key, text]
                if gen.finish == "eos" and 3 <= len(text.split()) <= 200 and json.dumps(entry) not in seen:
                    seen.add(json.dumps(entry))
                    state["requests"].append(entry)
                    bar.update(len(state["requests"]) <= count)
            barren = 0 if len(state["requests"]) > before else barren + 1
            atomic_write_text(path, json.dumps(state, indent=0))
    return state["requests"][:count]


def count_shards(source_dir: Path) -> int:
    """How many prompts the finished shards of a source hold."""
    return sum(len(shard_ids(s) or []) for s in sorted(source_dir.glob("shard_*")))


def user_turn_prefix(target: Target, history: Messages = ()) -> list[int]:
    """Token ids of the target's chat template, after the conversation `history`, up to where
    the next user message's text starts."""
    tokenizer = target.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("The chat and followup training sources need a tokenizer with a chat template.")
    marker = "\x00MESSAGE\x00"
    text = tokenizer.apply_chat_template([*history, user(marker)], tokenize=False, **target.chat_args)
    return tokenizer.encode(text[: text.index(marker)], add_special_tokens=False)


def build_selfdistill(
    target: Target,
    out_dir: Path,
    prompts: list[tuple[str, Messages]],
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
    encoded = [(pid, chat_tokens(target, messages)) for pid, messages in prompts]
    # Sorted by length inside a batch: little prefill wasted on padding, same shards for any n.
    batches = [sorted(encoded[i : i + batch_size], key=lambda p: len(p[1])) for i in range(0, len(encoded), batch_size)]
    shards = [out_dir / f"shard_{k:05d}" for k in range(len(batches))]
    for shard, batch in zip(tqdm(shards, desc=f"self-distillation {out_dir.name}", unit="batch"), batches):
        if shard_ids(shard) == [pid for pid, _ in batch]:
            continue
        tokens = [t for _, t in batch]
        recorder = FeatureRecorder(layers, top_k)
        started = time.perf_counter()
        decoding = generate(target, tokens, max_new_tokens=max_new_tokens, recorder=recorder)
        build = {"seconds": round(time.perf_counter() - started, 2), "machine": machine(str(target.device))}
        rows = {name: [] for name in schema}
        for i, ((pid, prompt), gen) in enumerate(zip(batch, decoding.generations)):
            rows["id"].append(pid)
            rows["input_ids"].append(prompt + gen.tokens)
            rows["answer_start"].append(len(prompt))
            rows["features"].append(recorder.features[i].numpy())
            if top_k:
                rows["top_ids"].append(recorder.top_ids[i].numpy())
                rows["top_logprobs"].append(recorder.top_logprobs[i].numpy())
        with atomic_dir(shard, "dataset_info.json") as tmp:
            Dataset.from_dict(rows, features=schema).save_to_disk(str(tmp))
            atomic_write_text(tmp / BUILD_FILE, json.dumps(build))
            shutil.rmtree(shard, ignore_errors=True)  # the shard it replaces, if any: gone only once this one is whole
    return concatenate_datasets([load_from_disk(str(s)) for s in shards])


def machine(device: str) -> str:
    """What a timing was measured on: the CPU or GPU model, AMX or not, and torch's threads."""
    import torch

    amx = {True: ", AMX", False: ", no AMX", None: ""}[has_amx(device)]
    return f"{device_name(device)}{amx}, {torch.get_num_threads()} threads"


def build_times(data_dir: Path) -> dict[str, dict]:
    """Per source folder under data_dir: its shards, how many of them were timed (older versions
    kept no time), the minutes that the timed shards and the source's written requests took to
    decode, and the machines that decoded them."""
    times = {}
    for source in sorted(p for p in data_dir.iterdir() if p.is_dir()):
        shards = sorted(source.glob("shard_*"))
        builds = [read_json(s / BUILD_FILE, "build the shard again") for s in shards if (s / BUILD_FILE).exists()]
        seconds, machines = sum(b["seconds"] for b in builds), {b["machine"] for b in builds}
        if (source / "requests.json").exists():  # the requests the target wrote for this source
            state = read_json(source / "requests.json", "delete it to write the requests again")
            seconds += state.get("seconds", 0)
            machines.update(state.get("machines", []))
        times[source.name] = {"shards": len(shards), "timed": len(builds), "minutes": round(seconds / 60, 2),
                              "machines": sorted(machines)}
    return times


def shard_ids(shard: Path) -> list[str] | None:
    """The prompt ids a finished shard holds (None when it is missing or unfinished: an older
    version wrote shards in place, and a kill could leave half of one, which is built again)."""
    if not (shard / "dataset_info.json").exists():
        return None
    try:
        return load_from_disk(str(shard))["id"]
    except (OSError, ValueError):  # its dataset_info.json, written last, cut short
        return None
