"""lossless_ties: where an output first leaves AR's, and whether the target's logits there are
a near-tie that rounding explains."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from bastion.bench.datasets import Prompt, chat_tokens
from bastion.bench.divergence import divergence, first_difference, gap_after, is_tie, tie_gap
from bastion.bench.metrics import summarize
from bastion.engine import generate
from bastion.models.target import compile_forward, load_target
from tests.conftest import target_config


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


@pytest.fixture(scope="module")
def bf16_target():
    return load_target(**{**target_config("tiny_qwen3"), "dtype": "bfloat16"})


def ar_record(target, prompt: Prompt) -> dict:
    """AR's record of a two-turn prompt, as the runner keeps it."""
    record = {"tokens": [], "turn_tokens": [], "text": []}
    conversation = []
    for turn in prompt.turns:
        conversation.append({"role": "user", "content": turn})
        tokens = generate(target, [chat_tokens(target, conversation)], max_new_tokens=12).generations[0].tokens
        text = target.tokenizer.decode(tokens, skip_special_tokens=True)
        conversation.append({"role": "assistant", "content": text})
        record["tokens"] += tokens
        record["turn_tokens"].append(len(tokens))
        record["text"].append(text)
    return record


def test_a_divergence_is_located_and_measured_under_ars_context(bf16_target):
    """A method that took AR's runner-up in the second turn: the divergence names the turn,
    the position in it, both tokens, and the gap of the target's own logits there."""
    prompt = Prompt("p", ["Say something.", "And then?"])
    ar = ar_record(bf16_target, prompt)
    at = ar["turn_tokens"][0] + 3  # the 4th token of the second answer
    conversation = [{"role": "user", "content": prompt.turns[0]}, {"role": "assistant", "content": ar["text"][0]},
                    {"role": "user", "content": prompt.turns[1]}]
    logits = bf16_target.score(chat_tokens(bf16_target, conversation) + ar["tokens"][ar["turn_tokens"][0] : at])[-1].float()
    best, runner_up = logits.topk(2).indices.tolist()
    assert best == ar["tokens"][at]
    ours = {**ar, "tokens": ar["tokens"][:at] + [runner_up] + ar["tokens"][at + 1 :]}
    found = divergence(bf16_target, prompt, ar, ours)
    assert (found["turn"], found["position"], found["ar_token"], found["token"]) == (1, 3, best, runner_up)
    assert found["gap"] == pytest.approx(float(logits[best] - logits[runner_up]))
    assert found["tie_gap"] == tie_gap(torch.bfloat16, float(logits.max()))
    assert divergence(bf16_target, prompt, ar, ar) is None


def test_ties_are_what_the_dtypes_rounding_explains():
    assert tie_gap(torch.bfloat16, 20.0) == pytest.approx(4 * 2**-7 * 20)
    assert tie_gap(torch.float32, 0.5) == pytest.approx(4 * 2**-23)
    assert is_tie(None) and is_tie({"gap": 0.1, "tie_gap": 0.3}) and not is_tie({"gap": 2.0, "tie_gap": 0.3})
    # the target's own forward of AR's context ranks our token first: rounding, however far
    assert is_tie({"gap": -2.0, "tie_gap": 0.3})


def test_summary_tells_exact_from_tie_from_bug():
    base = {"bench": "b", "turns": 1, "steps": 4, "new_tokens": 5, "prefill_s": 0.1, "batch_wall_s": 1.0, "temperature": 0.0}
    rows = [{**base, "method": "ar", "prompt_id": f"p{i}", "batch_id": f"b{i}", "tokens": [1, 2, 3], "divergence": None}
            for i in range(2)]
    tie = {"turn": 0, "position": 1, "ar_token": 2, "token": 9, "gap": 0.01, "tie_gap": 0.3}
    bug = {**tie, "gap": 4.0}
    for method, second in [("exact", None), ("tie", tie), ("bug", bug), ("unknown", None)]:
        rows += [{**base, "method": method, "prompt_id": "p0", "batch_id": "b0", "tokens": [1, 2, 3], "divergence": None},
                 {**base, "method": method, "prompt_id": "p1", "batch_id": "b1",
                  "tokens": [1, 2, 3] if method == "exact" else [1, 9, 3], "divergence": second}]
    summary = summarize(pd.DataFrame(rows)).set_index("method")
    assert summary.loc["exact", ["lossless", "lossless_ties"]].tolist() == [True, True]
    assert summary.loc["tie", ["lossless", "lossless_ties"]].tolist() == [False, True]
    assert summary.loc["bug", ["lossless", "lossless_ties"]].tolist() == [False, False]
    # an output that differs with no divergence recorded (its AR record in another shard) is no tie
    assert summary.loc["unknown", ["lossless", "lossless_ties"]].tolist() == [False, False]


def test_ties_are_not_judged_above_temperature_0():
    """At T > 0 the runner records no divergence (a tie of keyed sampling is not the logit gap's):
    an output that differs from AR's leaves lossless_ties blank, not True."""
    base = {"bench": "b", "turns": 1, "steps": 4, "new_tokens": 5, "prefill_s": 0.1, "batch_wall_s": 1.0,
            "temperature": 0.7, "tree_mode": "ranked"}
    rows = [{**base, "method": "ar", "prompt_id": "p0", "batch_id": "b0", "tokens": [1, 2, 3]},
            {**base, "method": "same", "prompt_id": "p0", "batch_id": "b0", "tokens": [1, 2, 3]},
            {**base, "method": "other", "prompt_id": "p0", "batch_id": "b0", "tokens": [1, 9, 3]}]
    summary = summarize(pd.DataFrame(rows)).set_index("method")
    assert summary.loc["same", ["lossless", "lossless_ties"]].tolist() == [True, True]
    assert summary.loc["other", "lossless"] == False and summary.loc["other", "lossless_ties"] is None  # noqa: E712


def test_a_divergence_on_a_graphed_target_leaves_its_kv_buffers_alone(tiny_qwen3):
    """The gap is scored eagerly: a graphed target's cache for a long context would grow the KV
    buffers its CUDA graphs replay over, and every graph would record again in timed steps."""
    graphed = compile_forward(tiny_qwen3, graphs=True)
    graphed.new_cache(1, 8)
    buffers = graphed.compiled.buffers
    found = gap_after(graphed, list(range(5, 2000)), 7, 8)
    assert graphed.compiled.buffers is buffers
    logits = tiny_qwen3.score(list(range(5, 2000)))[-1]
    assert found["gap"] == pytest.approx(float(logits[7] - logits[8]))
