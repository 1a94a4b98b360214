"""Benchmark prompts: offline copies under a data dir, the Hugging Face Hub otherwise.

Prompt formats follow the DFlash evaluation code (z-lab/dflash, benchmark.py), which the
BASTION and FlexDraft papers reuse: math asks for step-by-step reasoning and a boxed answer,
HumanEval wraps the function stub in a code block, MBPP and MT-Bench are used as written.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"


@dataclass(frozen=True)
class Prompt:
    id: str
    turns: tuple[str, ...]  # user messages; MT-Bench has two, the second sent after the model's first answer


@dataclass(frozen=True)
class Bench:
    local: str  # path under the data dir
    hub: tuple[str, ...]  # load_dataset arguments
    split: str
    turns: Callable[[dict], list[str]]
    id_of: Callable[[dict, int], str]
    size: int  # records in the full split, as documented


BENCHES = {
    "gsm8k": Bench("gsm8k/test.jsonl", ("openai/gsm8k", "main"), "test",
                   lambda r: [r["question"] + REASON], lambda r, i: f"gsm8k/{i}", 1319),
    "math500": Bench("math500/test.jsonl", ("HuggingFaceH4/MATH-500",), "test",
                     lambda r: [r["problem"] + REASON], lambda r, i: r.get("unique_id", f"math500/{i}"), 500),
    "humaneval": Bench("humaneval/test.jsonl", ("openai/openai_humaneval",), "test",
                       lambda r: [HUMANEVAL.format(r["prompt"])], lambda r, i: r["task_id"], 164),
    "mbpp": Bench("mbpp/sanitized-test.jsonl", ("google-research-datasets/mbpp", "sanitized"), "test",
                  lambda r: [r["prompt"]], lambda r, i: f"mbpp/{r['task_id']}", 257),
    "mt_bench": Bench("mt_bench/question.jsonl", ("HuggingFaceH4/mt_bench_prompts",), "train",
                      lambda r: list(r.get("turns") or r["prompt"]),
                      lambda r, i: f"mt_bench/{r.get('question_id', r.get('prompt_id', i))}", 80),
}


def default_data_dir() -> Path:
    """$BASTION_DATA, else ../shared/data beside the project checkout."""
    env = os.environ.get("BASTION_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "data"


def read_jsonl(path: Path) -> list[dict]:
    return [record for _, record in numbered_jsonl(path)]


def numbered_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, record) for each non-blank line of a JSON Lines file. Lines are numbered
    as an editor numbers them, blank ones included, so an error's line is the one to open; a
    line that is not UTF-8 or not a JSON object is refused naming the file and that line."""
    rows = []
    for n, raw in enumerate(Path(path).read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8-sig"))
        except UnicodeDecodeError:
            raise ValueError(f"{path} line {n} is not UTF-8 text; save the file as UTF-8.") from None
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{path} line {n} is not valid JSON ({error.msg} at column {error.colno}); fix or remove that line."
            ) from None
        if not isinstance(record, dict):
            raise ValueError(f"{path} line {n} is not a JSON object; each line must be one {{...}} record.")
        rows.append((n, record))
    return rows


def load_records(name: str, data_dir: str | Path | None = None) -> list[dict]:
    """The benchmark's raw records: the offline copy when present, else the Hub."""
    bench = BENCHES[name]
    path = Path(data_dir or default_data_dir()) / bench.local
    if path.exists():
        if records := read_jsonl(path):
            return records
        raise ValueError(f"{path} holds no records; restore it, or delete it to read benchmark '{name}' from the Hub.")
    try:
        from datasets import load_dataset

        return list(load_dataset(*bench.hub, split=bench.split))
    except Exception as err:
        raise FileNotFoundError(
            f"Benchmark '{name}' is not available: no offline copy at {path} and the Hub gave "
            f"{type(err).__name__}. Set BASTION_DATA (or bench.data_dir) to a directory laid out like ../shared/data."
        ) from None


def load_prompts(
    name: str,
    limit: int | None = None,
    data_dir: str | Path | None = None,
    shuffle: bool = False,
    seed: int = 0,
    path: str | None = None,
    field: str | None = None,
) -> list[Prompt]:
    """Prompts of a benchmark, or of any JSON Lines file (`name='custom'`, `path`, `field`
    holding a string or a list of turns)."""
    if name == "custom":
        prompts = _custom(path, field)
    elif name in BENCHES:
        bench = BENCHES[name]
        prompts = [Prompt(bench.id_of(r, i), tuple(bench.turns(r))) for i, r in enumerate(load_records(name, data_dir))]
    else:
        raise ValueError(f"Unknown benchmark '{name}'; choose one of {', '.join([*BENCHES, 'custom'])}.")
    seen = set()
    for prompt in prompts:  # results are kept and resumed by prompt id
        if prompt.id in seen:
            raise ValueError(f"{path if name == 'custom' else name} has prompt id '{prompt.id}' twice; give every prompt an id of its own.")
        seen.add(prompt.id)
    if shuffle:
        random.Random(seed).shuffle(prompts)
    if limit is not None:
        if limit < 1:
            raise ValueError(f"bench.limit must be at least 1 (got {limit}).")
        prompts = prompts[:limit]
    return prompts


def _custom(path: str | None, field: str | None) -> list[Prompt]:
    if not path or not field:
        raise ValueError("bench=custom needs bench.path=FILE.jsonl and bench.field=NAME.")
    if not Path(path).exists():
        raise FileNotFoundError(f"Custom prompt file {path} does not exist.")
    rows = numbered_jsonl(Path(path))
    if not rows:
        raise ValueError(f"Custom prompt file {path} is empty; write one JSON object per line, the prompt in '{field}'.")
    return [Prompt(str(record.get("id", f"custom/{i}")), _turns(record, field, f"{path} line {n}"))
            for i, (n, record) in enumerate(rows)]


def _turns(record: dict, field: str, where: str) -> tuple[str, ...]:
    """A prompt field holds one message or a list of turns. Anything else is refused: a number
    or null has no text to send, and a dict would become the list of its keys."""
    if field not in record:
        raise ValueError(f"{where} has no field '{field}' (it has {', '.join(record) or 'no fields'}).")
    value = record[field]
    turns = [value] if isinstance(value, str) else value
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise ValueError(
            f"{where}: field '{field}' must be a non-empty string or a list of them (it is {json.dumps(value)[:80]})."
        )
    return tuple(turns)


def check_prompt_lengths(target, prompts: dict[str, list[Prompt]], max_new_tokens: int) -> None:
    """Refuse, before the first decode, a prompt that cannot fit the target's context: the
    engine finds it only when its turn comes, after the prompts before it were decoded. A
    multi-turn prompt is measured with all its user turns and empty answers, the least its last
    turn can take (the answers are not known yet)."""
    context = target.args.max_position
    for bench, listed in prompts.items():
        for prompt in listed:
            messages = [m for turn in prompt.turns
                        for m in ({"role": "user", "content": turn}, {"role": "assistant", "content": ""})]
            n = len(chat_tokens(target, messages[:-1]))
            if n + max_new_tokens > context:
                raise ValueError(
                    f"Prompt {prompt.id} ({bench}) takes {n} tokens, which with decode.max_new_tokens={max_new_tokens} "
                    f"exceeds the context of {target.name} ({context} tokens); leave that prompt out or lower "
                    f"decode.max_new_tokens."
                )


def chat_tokens(target, messages: list[dict]) -> list[int]:
    """Token ids of a conversation ready for the target's reply (its chat template, with the
    target's chat_args, when the tokenizer has one; the plain concatenation of the messages
    otherwise)."""
    tokenizer = target.tokenizer
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **target.chat_args)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode("\n\n".join(m["content"] for m in messages))
