"""Benchmarks: the offline copies and their documented sizes, MT-Bench's second turn, custom
prompt files, and a run killed mid-way that resumes without losing or repeating a record."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from bastion.bench.datasets import BENCHES, Prompt, load_prompts
from bastion.bench.records import read_records
from bastion.bench.runner import Method, decode_batch
from tests.test_errors import ROOT


@pytest.mark.parametrize("name,size", [("gsm8k", 1319), ("math500", 500), ("humaneval", 164), ("mbpp", 257), ("mt_bench", 80)])
def test_offline_copies_have_the_documented_counts(name, size):
    prompts = load_prompts(name)
    assert len(prompts) == size == BENCHES[name].size
    assert len({p.id for p in prompts}) == size and all(p.turns and all(p.turns) for p in prompts)
    assert {len(p.turns) for p in prompts} == ({2} if name == "mt_bench" else {1})


def test_prompt_formats_limit_and_shuffle():
    assert load_prompts("gsm8k", limit=1)[0].turns[0].endswith("put your final answer within \\boxed{}.")
    assert "```python\nfrom typing import List\n\n\ndef has_close_elements" in load_prompts("humaneval", limit=1)[0].turns[0]
    shuffled = load_prompts("math500", limit=5, shuffle=True, seed=1)
    assert shuffled == load_prompts("math500", limit=5, shuffle=True, seed=1) != load_prompts("math500", limit=5)


def test_custom_file_with_strings_and_turns(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "q": "Hi"}\n{"q": ["First", "Then"]}\n')
    assert load_prompts("custom", path=str(path), field="q") == [Prompt("a", ("Hi",)), Prompt("custom/1", ("First", "Then"))]
    with pytest.raises(ValueError, match="line 1 has no field 'x'"):
        load_prompts("custom", path=str(path), field="x")
    with pytest.raises(ValueError, match="Unknown benchmark 'gsm9k'"):
        load_prompts("gsm9k")


@dataclass
class FakeDecoding:
    generations: list
    steps: tuple = ()
    prefill_s: float = 0.0
    wall_s: float = 0.0


@dataclass
class FakeGeneration:
    tokens: list
    finish: str = "length"
    steps: int = 1


def test_second_turn_continues_with_the_models_own_answer(tiny_qwen3):
    """The second user turn is sent after the model's first answer, in the same conversation."""
    seen = []

    class Recording(Method):
        def generate(self, target, prompts, *args, **kwargs):
            seen.append(prompts)
            answer = target.tokenizer.encode(f" answer{len(seen)}")
            return FakeDecoding([FakeGeneration(list(answer)) for _ in prompts])

    prompt = load_prompts("mt_bench", limit=1)[0]
    records = decode_batch(tiny_qwen3, Recording("fake"), [prompt], "mt_bench", 4)
    first, second = (tiny_qwen3.tokenizer.decode(p[0]) for p in seen)
    assert second.startswith(first) and "answer1" in second and prompt.turns[1] in second
    assert records[0]["turns"] == 2 and records[0]["text"] == [" answer1", " answer2"]


def test_killed_run_resumes_without_losing_or_repeating_records(tmp_path):
    args = ["target=tiny_qwen3", "drafter=ngram", "budget=fixed", "budget.nodes=4", "bench.limit=12",
            "decode.max_new_tokens=24", "warmup=false", f"hydra.run.dir={tmp_path}"]
    results = tmp_path / "results.jsonl"
    process = subprocess.Popen([sys.executable, "run.py", *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and (not results.exists() or len(results.read_text().splitlines()) < 3):
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    before = read_records(results)
    assert 3 <= len(before) < 24, "the run should have been killed part-way"
    with open(results, "a") as f:
        f.write('{"method": "ar", "bench": "gsm8k", "prom')  # a record the kill cut short
    again = subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    after = [json.loads(line) for line in results.read_text().splitlines()]
    keys = [(r["method"], r["prompt_id"]) for r in after]
    assert len(after) == 24 and len(set(keys)) == 24
    assert after[: len(before)] == before  # what was written before the kill is kept as it was
