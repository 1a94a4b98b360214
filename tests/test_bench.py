"""Benchmarks: the offline copies and their documented sizes, MT-Bench's second turn, custom
prompt files, a warm-up at the run's batch size, the A/A control, and a run killed mid-way
that resumes without losing or repeating a record."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir

from bastion.bench.datasets import BENCHES, Prompt, chat_tokens, load_prompts
from bastion.bench.provenance import read_summary
from bastion.bench.records import read_records
from bastion.bench.runner import Method, decode_batch, run_methods
from bastion.compose import CONTROL, plan_methods
from bastion.engine import Step
from bastion.train.data import user_turn_prefix
from tests.test_errors import ROOT, run_py


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


@dataclass
class Recording(Method):
    """A method that answers " answerN" to its Nth call and keeps the prompts of every call."""

    calls: list = field(default_factory=list)

    def generate(self, target, prompts, *args, **kwargs):
        self.calls.append(prompts)
        answer = target.tokenizer.encode(f" answer{len(self.calls)}")
        return FakeDecoding([FakeGeneration(list(answer)) for _ in prompts])


def test_chat_template_args_reach_every_prompt_the_target_reads():
    """A preset's chat_template_args (Qwen3: enable_thinking=False) shape benchmark prompts
    and the self-distillation data's prompts and requests alike."""
    calls = []

    class Tokenizer:
        chat_template = "a template"

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kwargs):
            calls.append(kwargs)
            return "<turn>" + messages[-1]["content"]

        def encode(self, text, add_special_tokens=True):
            return [len(text)]

    target = SimpleNamespace(tokenizer=Tokenizer(), chat_args={"enable_thinking": False})
    assert chat_tokens(target, [{"role": "user", "content": "hi"}]) == [len("<turn>hi")]
    assert user_turn_prefix(target) == [len("<turn>")]
    assert calls == [{"enable_thinking": False}] * 2


def test_qwen3_presets_prompt_without_thinking():
    for name in ("qwen3_8b", "qwen3_4b"):
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[f"target={name}"])
        assert cfg.target.chat_template_args == {"enable_thinking": False}


def test_second_turn_continues_with_the_models_own_answer(tiny_qwen3):
    """The second user turn is sent after the model's first answer, in the same conversation."""
    method = Recording("fake")
    prompt = load_prompts("mt_bench", limit=1)[0]
    records = decode_batch(tiny_qwen3, method, [prompt], "mt_bench", 4)
    first, second = (tiny_qwen3.tokenizer.decode(p[0]) for p in method.calls)
    assert second.startswith(first) and "answer1" in second and prompt.turns[1] in second
    assert records[0]["turns"] == 2 and records[0]["text"] == [" answer1", " answer2"]


def test_records_carry_the_time_of_steps_that_compiled(tiny_qwen3):
    """Steps during which torch.compile built a graph (engine.Step.compiled) are summed per batch,
    every turn's, so the summary can say how much of a wall was compiling."""
    def step(seconds, compiled):
        return Step([0], [0], [1], [0.0], draft_s=0.0, verify_s=seconds, other_s=0.0, compiled=compiled)

    class Compiling(Recording):
        def generate(self, *args, **kwargs):
            return dataclasses.replace(super().generate(*args, **kwargs), steps=(step(2.0, True), step(0.5, False)))

    records = decode_batch(tiny_qwen3, Compiling("fake"), load_prompts("mt_bench", limit=1), "mt_bench", 4)
    assert records[0]["compile_s"] == 4.0  # two turns, one compiling step of 2 s each


def test_time_to_first_token_is_the_first_turns_prefill(tiny_qwen3):
    class Prefilling(Recording):
        def generate(self, *args, **kwargs):
            return dataclasses.replace(super().generate(*args, **kwargs), prefill_s=0.25 * (1 + len(self.calls)))

    (record,) = decode_batch(tiny_qwen3, Prefilling("fake"), load_prompts("mt_bench", limit=1), "mt_bench", 4)
    assert record["ttft_s"] == 0.5 and record["prefill_s"] == 0.5 + 0.75


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


def test_warm_up_decodes_the_first_batch_at_the_runs_batch_size(tiny_qwen3, tmp_path):
    """The untimed warm-up decodes the first batch itself, at the run's batch size, so that
    every method's first timed batch runs shapes it has run before (a batch-1 warm-up did not),
    and then its first row alone: rows leave a batch as they finish, down to one."""
    methods = [Recording("ar"), Recording("other")]
    run_methods(tiny_qwen3, methods, load_prompts("gsm8k", limit=5), "gsm8k", tmp_path, 4, batch_size=4)
    for method in methods:
        assert [len(call) for call in method.calls] == [4, 1, 4, 1]  # warm-ups, then the batches


def test_a_run_resumed_by_another_number_of_processes_repeats_nothing(tiny_qwen3, tmp_path):
    """Records another process's shard holds (a torchrun run finished by a plain one) are done:
    decoded again, they would stand twice in the run and the summary would refuse it."""
    prompts = load_prompts("gsm8k", limit=3)
    run_methods(tiny_qwen3, [Recording("ar")], prompts, "gsm8k", tmp_path, 4, warmup=False, shard=".rank0")
    again = Recording("ar")
    run_methods(tiny_qwen3, [again], prompts, "gsm8k", tmp_path, 4, warmup=False)
    assert again.calls == [] and read_records(tmp_path / "results.jsonl") == []


def test_a_shard_without_prompts_writes_nothing(tiny_qwen3, tmp_path):
    """torchrun ranks beyond the prompts (bench.limit=4 on 8 GPUs) get none: no warm-up, no record."""
    method = Recording("ar")
    run_methods(tiny_qwen3, [method], [], "gsm8k", tmp_path, 4, batch_size=4)
    assert method.calls == [] and read_records(tmp_path / "results.jsonl") == []


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose("config", overrides=list(overrides))


def test_control_is_ar_again_after_the_composed_methods():
    without = [p.name for p in plan_methods(composed("drafter=ngram", "budget=fixed"))]
    plans = plan_methods(composed("drafter=ngram", "budget=fixed", "control=true"))
    assert len(without) == 2 and [p.name for p in plans] == [*without, CONTROL] and plans[-1].node is None
    assert [p.name for p in plan_methods(composed("experiment=demo"))][-1] == CONTROL  # on in every experiment
    with pytest.raises(ValueError, match="control must be true or false"):
        plan_methods(composed("drafter=ngram", "control=maybe"))


@pytest.mark.parametrize("methods", [
    "[{name: a, drafter: ngram}, {name: a, drafter: ngram, budget: fixed}]",
    "[{name: ar, drafter: ngram}]",
    "[{drafter: ngram, tree: best_first, budget: oracle}, {drafter: ngram, tree: best_first, budget: oracle}]",
])
def test_two_methods_of_one_name_are_refused_before_any_decoding(methods):
    """Records, summaries and settings are keyed by method name: a second method of the same
    name would overwrite the first's settings and only fail at the summary, after decoding."""
    with pytest.raises(ValueError, match="Two methods would both be named"):
        plan_methods(composed(f"methods={methods}"))


def test_run_records_its_machine_and_its_noise_floor(tmp_path):
    """control=true: AR decoded again last in every batch, equal to AR token for token; the
    summary carries the spread and the machine, profile, dtype and commit of machine.json."""
    result = run_py("target=tiny_qwen3", "drafter=ngram", "budget=fixed", "budget.nodes=4", "bench.limit=3",
                    "decode.max_new_tokens=6", "control=true", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    order = [(r["batch_id"], r["method"]) for r in read_records(tmp_path / "results.jsonl")]
    assert [m for _, m in order] == ["ar", "ngram+best_first+fixed4", CONTROL] * 3
    machine = json.loads((tmp_path / "machine.json").read_text())
    summary = read_summary(tmp_path / "summary.csv").set_index("method")
    control = summary.loc[CONTROL]
    assert bool(control.lossless) and 0 < control.speedup_lo <= control.speedup <= control.speedup_hi
    assert "only 3 prompt(s): too few" in control.note
    for key in ("device", "profile", "dtype", "commit"):
        assert (summary[key].fillna("") == (machine[key] or "")).all()
    assert machine["profile"] == "auto" and machine["dtype"] == "float32"
