"""Self-distillation data and drafter training on a tiny target: shards resume and grow,
training learns and resumes from its last checkpoint (only its own), train.py writes a
loadable drafter; the target writes its own chat requests (SmolLM2)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch

from bastion.models.target import fast_bfloat16
from bastion.drafters.dflash import DFlashDrafter, new_dflash_config
from bastion.drafters.eagle3 import load_eagle3
from bastion.drafters.flexdraft import FlexDraftDrafter, load_flexdraft
from bastion.models.loading import packaged_dir
from bastion.models.target import load_target
from bastion.train.data import (
    OPENERS,
    build_selfdistill,
    chat_prompts,
    file_prompts,
    followup_prompts,
    machine,
    source_counts,
    user_turn_prefix,
)
from bastion.train.dflash import block_loss, feature_std, sample_batch, soft_cross_entropy, train_dflash, with_feature_noise
from bastion.train.cli import new_eagle3_drafter, with_draft_vocab
from bastion.train.examples import sample_anchors, split_examples, to_examples
from bastion.train.eagle3 import train_eagle3
from bastion.train.flexdraft import group_loss, train_flexdraft
from bastion.train.loop import on_device, train_loop
from tests.conftest import ROOT, target_config


@pytest.fixture(scope="module")
def tiny():
    target = load_target(**target_config("tiny_qwen3"))
    target.model.requires_grad_(False)
    return target


@pytest.fixture(scope="module")
def data(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("selfdistill")
    return out, build_selfdistill(tiny, out, file_prompts("gsm8k", 6), layers=(0, 1), max_new_tokens=12, batch_size=2, top_k=2)


def mtimes(out):
    return {p.parent.name: p.stat().st_mtime_ns for p in out.glob("shard_*/dataset_info.json")}


def test_selfdistill_is_the_targets_own_greedy_answers_and_resumes(tiny, data):
    out, dataset = data
    assert len(dataset) == 6 and len(list(out.glob("shard_*"))) == 3
    row = dataset.with_format("torch")[0]
    assert row["features"].shape == (len(row["input_ids"]) - 1, 2 * 64)
    answer = row["input_ids"][row["answer_start"]:]
    assert row["top_ids"].shape == row["top_logprobs"].shape == (len(answer), 2) and (row["top_ids"][:, 0] == answer).all()
    example = to_examples(dataset)[0]  # in memory as stored (datasets reads float16 as float32: twice the memory)
    assert example.features.dtype == example.top_logprobs.dtype == torch.float16 and example.top_ids.dtype == torch.int32
    bare = to_examples(dataset, features=False)[0]  # FlexDraft's: the features are most of the data, and unread
    assert bare.features is None and torch.equal(bare.tokens, example.tokens) and torch.equal(bare.top_ids, example.top_ids)
    from bastion.engine import generate

    prompt = row["input_ids"][: row["answer_start"]].tolist()
    assert generate(tiny, [prompt], max_new_tokens=12).generations[0].tokens == row["input_ids"][row["answer_start"]:].tolist()
    built = mtimes(out)
    shutil.rmtree(out / "shard_00002")
    assert len(build_selfdistill(tiny, out, file_prompts("gsm8k", 6), layers=(0, 1), max_new_tokens=12, batch_size=2, top_k=2)) == 6
    assert mtimes(out)["shard_00000"] == built["shard_00000"]  # kept, not rebuilt


def test_a_shard_write_cut_short_leaves_no_half_shard_and_an_older_half_one_is_rebuilt(tiny, tmp_path, monkeypatch):
    from datasets import Dataset

    def build():
        return build_selfdistill(tiny, tmp_path, file_prompts("gsm8k", 2), layers=(0,), max_new_tokens=4, batch_size=2)

    save = Dataset.save_to_disk

    def killed(dataset, path, **kwargs):
        save(dataset, path, **kwargs)
        info = Path(path) / "dataset_info.json"
        info.write_text(info.read_text()[:40])  # killed while writing the file a finished shard is known by
        raise KeyboardInterrupt

    monkeypatch.setattr(Dataset, "save_to_disk", killed)
    with pytest.raises(KeyboardInterrupt):
        build()
    assert list(tmp_path.iterdir()) == []  # neither a half shard nor a temporary folder
    monkeypatch.undo()
    ids = build()["id"]
    info = tmp_path / "shard_00000" / "dataset_info.json"
    info.write_text(info.read_text()[:40])  # what a kill left when shards were written in place
    assert build()["id"] == ids and json.loads(info.read_text())


def test_more_prompts_reuse_the_shards_built_and_changed_shards_are_rebuilt(tiny, tmp_path):
    assert file_prompts("gsm8k", 9)[:6] == file_prompts("gsm8k", 6)  # a source's order does not depend on n
    build_selfdistill(tiny, tmp_path, file_prompts("gsm8k", 4), layers=(0,), max_new_tokens=4, batch_size=2)
    built = mtimes(tmp_path)
    grown = build_selfdistill(tiny, tmp_path, file_prompts("gsm8k", 6), layers=(0,), max_new_tokens=4, batch_size=2)
    assert len(grown) == 6 and {k: v for k, v in mtimes(tmp_path).items() if k in built} == built
    rebatched = build_selfdistill(tiny, tmp_path, file_prompts("gsm8k", 6), layers=(0,), max_new_tokens=4, batch_size=3)
    assert len(rebatched) == 6 and sorted(rebatched["id"]) == sorted(grown["id"])
    assert mtimes(tmp_path)["shard_00000"] != built["shard_00000"]  # other prompts in it now: rebuilt


def test_source_counts_follow_the_mix_and_bad_sources_are_refused():
    assert source_counts({"gsm8k": 0.4, "math": 0.3, "mbpp": 0.1, "chat": 0.2}, 1440) == {"gsm8k": 576, "math": 432, "mbpp": 144, "chat": 288}
    assert list(source_counts({"followup": 0.1, "chat": 0.2, "gsm8k": 0.7}, 10)) == ["chat", "gsm8k", "followup"]  # built last
    with pytest.raises(ValueError, match="Unknown training sources"):
        source_counts({"sharegpt": 1}, 10)
    with pytest.raises(ValueError, match="mbpp has 464 prompts"):
        file_prompts("mbpp", 500)


def test_an_untrained_target_writing_no_chat_request_is_refused(tiny, tmp_path):
    with pytest.raises(RuntimeError, match="no usable chat request in 5 rounds"):
        chat_prompts(tiny, 1, tmp_path, batch_size=2, max_new_tokens=3)


@pytest.mark.slow
def test_chat_requests_are_the_targets_own_and_the_list_grows_in_order(smollm2, tmp_path):
    assert smollm2.tokenizer.decode(user_turn_prefix(smollm2)).endswith("<|im_end|>\n<|im_start|>user\n")
    first = chat_prompts(smollm2, 3, tmp_path, batch_size=8, max_new_tokens=64)
    assert [pid.split("-")[0] for pid, _ in first] == ["chat/0", "chat/1", "chat/2"]
    texts = [messages[0]["content"] for _, messages in first]
    assert all(m[0]["role"] == "user" and len(m) == 1 for _, m in first) and len(set(texts)) == 3
    assert all(len(text.split()) >= 3 and "<|im_" not in text for text in texts)
    assert chat_prompts(smollm2, 3, tmp_path, batch_size=8, max_new_tokens=64) == first  # cached
    grown = chat_prompts(smollm2, 12, tmp_path, batch_size=8, max_new_tokens=64)
    assert grown[:3] == first
    assert any(m[0]["content"].startswith(o) for _, m in grown for o in OPENERS if o)  # openers widen the requests


@pytest.mark.slow
def test_followups_continue_the_chat_conversations_the_target_answered(smollm2, tmp_path):
    """A follow-up's prompt is a chat request, the target's own finished answer to it (from the
    chat data) and the next user message the target writes."""
    chats = chat_prompts(smollm2, 4, tmp_path / "chat", batch_size=8, max_new_tokens=48)
    data = build_selfdistill(smollm2, tmp_path / "chat", chats, layers=(0,), max_new_tokens=160, batch_size=4)
    answers = {row["id"]: smollm2.tokenizer.decode(row["input_ids"][row["answer_start"]:-1]).strip() for row in data
               if row["input_ids"][-1] in smollm2.eos_ids}
    followups = followup_prompts(smollm2, 3, tmp_path / "followup", tmp_path / "chat", batch_size=4, max_new_tokens=64)
    assert [pid.split("-")[0] for pid, _ in followups] == ["followup/0", "followup/1", "followup/2"]
    requests = {m[0]["content"]: pid for pid, m in chats}
    for _, (first, answer, then) in followups:
        assert [first["role"], answer["role"], then["role"]] == ["user", "assistant", "user"]
        assert answer["content"] == answers[requests[first["content"]]] and len(then["content"].split()) >= 3


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
@pytest.mark.parametrize("kind", ["dflash", "eagle3", "flexdraft", "flexdraft-clean-bonus"])
def test_training_learns_and_resumes(tiny, data, kind, autocast, tmp_path):
    examples, val_examples = split_examples(to_examples(data[1]), 0.34)
    assert len(examples) == 4 and len(val_examples) == 2
    torch.manual_seed(0)
    if kind == "dflash":
        drafter, train = DFlashDrafter(new_dflash_config(tiny, 1, 4, [0, 1], 16), tiny), train_dflash
        kw = dict(seqs_per_step=2, anchors=8, lr=3e-3, feature_noise=0.1, soft_labels=0.5)
    elif kind == "eagle3":
        drafter, columns = new_eagle3_drafter(tiny, (0, 1), examples, 300)
        train, kw = partial(train_eagle3, columns=columns), dict(seqs_per_step=2, lr=3e-3, ttt_steps=3)
    else:
        drafter = FlexDraftDrafter(tiny, tuned_layers=1, group_size=4, calibration_hidden=16, mask_token_id=16, draft_vocab_size=400,
                                   bonus="clean" if kind.endswith("clean-bonus") else "mask")
        drafter, train = with_draft_vocab(drafter, examples, 400), train_flexdraft  # labels outside it carry no loss
        kw = dict(seqs_per_step=2, anchors=8, lr=3e-3, lr_tuned=1e-3)
    kw["autocast"] = autocast
    state = tmp_path / "state.pt"
    log = train(drafter, examples, state, steps=30, log_every=10, save_every=10, val_examples=val_examples, val_every=10, **kw)
    assert log[-1]["loss"] < log[0]["loss"]
    assert len(log[-1]["acc"]) == 3 and len(log[-1]["val_acc"]) == 3 and "val_loss" in log[0]
    if kind != "eagle3":  # held-out chain AAL, walked
        assert log[-1]["val_chain_aal"] >= 1 and (kind == "dflash") == ("val_chain_aal_plain" not in log[-1])
    # a rerun with more steps resumes at step 30 and keeps the log
    log = train(drafter, examples, state, steps=40, log_every=10, save_every=10, val_examples=val_examples, val_every=10, **kw)
    assert [r["step"] for r in log] == [10, 20, 30, 40]
    with pytest.raises(ValueError, match="training run on other data or settings"):
        train(drafter, examples, state, steps=50, run_key={"data": "other"}, val_examples=val_examples, **kw)


def on_meta(drafter):
    """A copy of `drafter` and of its target on the meta device, which stands in for a GPU: an op
    mixing it with a host tensor raises as CUDA's do."""
    target = replace(drafter.target, model=copy.deepcopy(drafter.target.model).to("meta"))
    target.model.rotary.inv_freq = target.model.rotary.inv_freq.to("meta")
    drafter = copy.deepcopy(drafter).to("meta")
    drafter.target = target
    return drafter


@pytest.mark.parametrize("kind", ["dflash", "flexdraft"])
def test_a_training_loss_runs_where_its_drafter_is(tiny, data, kind):
    """train_loop builds batches on the host and moves them to the drafter's device (on_device);
    each loss makes its own tensors there too, so `train.py` runs on a GPU (a host tensor in a
    loss stopped its first step). EAGLE-3's loss reads its batch's answer starts on the host,
    which the meta device cannot."""
    examples, gen = to_examples(data[1]), torch.Generator().manual_seed(0)
    if kind == "dflash":
        drafter = DFlashDrafter(new_dflash_config(tiny, 1, 4, [0, 1], 16), tiny)
        loss = partial(block_loss, gamma=2.0, soft_labels=0.5)
        batch = sample_batch(examples, 2, 4, gen, soft_labels=True)
    else:
        drafter = with_draft_vocab(FlexDraftDrafter(tiny, tuned_layers=1, group_size=4, calibration_hidden=16, mask_token_id=16,
                                                    draft_vocab_size=400), examples, 400)
        loss, batch = partial(group_loss, gamma=4.0), sample_anchors(examples, 2, 4, gen)
    to_draft = drafter.to_draft_ids()  # made before the move: a meta tensor has no values to map
    to_draft = None if to_draft is None else to_draft.to("meta")
    value, hits, counts = loss(on_meta(drafter), on_device(batch, "meta"), to_draft=to_draft)
    assert value.device.type == hits.device.type == counts.device.type == "meta"


def test_a_frozen_mask_embedding_trains_the_same_without_a_graph_below_the_tuned_layers(tiny, data):
    """With the mask embedding frozen, the layers below the tuned ones run without autograd:
    the loss and the tuned weights' gradients are those of the full graph."""
    examples = to_examples(data[1])
    torch.manual_seed(0)
    drafter = FlexDraftDrafter(tiny, tuned_layers=1, group_size=4, calibration_hidden=16, mask_token_id=16)
    batch = sample_anchors(examples, 2, 8, torch.Generator().manual_seed(0))
    grads = []
    for trained in (True, False):
        drafter.mask_embedding.requires_grad_(trained)
        loss, _, _ = group_loss(drafter, batch, gamma=4.0)
        loss.backward()
        grads.append((loss.detach(), [p.grad for p in drafter.tuned.parameters()]))
        drafter.zero_grad(set_to_none=True)
    (full, full_grads), (frozen, frozen_grads) = grads
    torch.testing.assert_close(frozen, full)
    assert any(g is not None for g in full_grads)
    for a, b in zip(frozen_grads, full_grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)
    assert drafter.mask_embedding.grad is None or not drafter.mask_embedding.requires_grad


def test_weight_decay_shrinks_weights_by_lr_times_decay_per_step(tmp_path):
    layer = torch.nn.Linear(3, 3, bias=False)
    before = layer.weight.detach().clone()
    zero_loss = lambda batch: ((layer.weight * 0).sum(), torch.zeros(1), torch.ones(1))  # a zero gradient: only the decay moves it
    train_loop(layer, [{"params": [layer.weight], "lr": 0.1}], lambda gen: None, zero_loss, tmp_path / "state.pt", steps=1, weight_decay=0.5)
    torch.testing.assert_close(layer.weight.detach(), before * (1 - 0.1 * 0.5))


@pytest.mark.parametrize("amx,avx512_bf16,fast", [(True, False, True), (False, True, True), (False, False, False)])
def test_bfloat16_is_chosen_on_cpus_with_amx_or_avx512_bf16(monkeypatch, amx, avx512_bf16, fast):
    """Zen 4/5's AVX512-BF16 runs oneDNN's bfloat16 matmuls ~4.5x float32 (2-core Zen 5, NOTES), as AMX does;
    CPUs with neither run them slower than float32."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert fast_bfloat16("cpu") == fast


def test_autocast_runs_forwards_in_bfloat16_and_keeps_float32_weights(tmp_path):
    layer = torch.nn.Linear(3, 3)
    seen = []

    def loss_fn(batch):
        y = layer(torch.ones(1, 3))
        seen.append(y.dtype)
        return y.float().square().sum(), torch.zeros(1), torch.ones(1)

    train_loop(layer, [{"params": list(layer.parameters()), "lr": 0.1}], lambda gen: None, loss_fn, tmp_path / "state.pt", steps=2, autocast=True)
    assert seen == [torch.bfloat16] * 2 and layer.weight.dtype == torch.float32


def test_soft_cross_entropy_renormalises_over_the_draft_vocabulary():
    logits = torch.randn(3, 5)
    ids = torch.tensor([[4, 1], [2, 6], [6, 7]])  # target ids; the draft vocabulary holds 0..4
    logprobs = torch.log(torch.tensor([[1.0, 0.0], [0.3, 0.2], [0.5, 0.1]]))
    loss = soft_cross_entropy(logits, ids, logprobs, to_draft=torch.tensor([0, 1, 2, 3, 4, -1, -1, -1]))
    hard = torch.nn.functional.cross_entropy(logits, torch.tensor([4, 2, 0]), reduction="none")
    torch.testing.assert_close(loss[:2], hard[:2])  # one-hot, and 0.3 renormalised to 1 over the kept id
    assert loss[2] == 0  # nothing of it inside the draft vocabulary
    mixed = soft_cross_entropy(logits, torch.tensor([[0, 3]]), torch.log(torch.tensor([[0.6, 0.2]])))
    torch.testing.assert_close(mixed, -(0.75 * logits[:1].log_softmax(-1)[:, 0] + 0.25 * logits[:1].log_softmax(-1)[:, 3]))


def test_soft_labels_need_data_with_the_targets_distributions(tiny, data):
    examples = to_examples(data[1])
    for e in examples:
        e.top_ids = e.top_logprobs = None
    with pytest.raises(ValueError, match="set data.top_k"):
        train_dflash(DFlashDrafter(new_dflash_config(tiny, 1, 4, [0, 1], 16), tiny), examples, None, steps=1, soft_labels=0.5)


def test_feature_noise_is_scaled_per_feature_by_its_std(tiny, data):
    examples = to_examples(data[1])
    std = feature_std(examples)
    torch.testing.assert_close(std, torch.cat([e.features.double() for e in examples]).std(0, correction=0).float())
    scale = torch.zeros_like(std)
    scale[:3] = torch.tensor([0.5, 2.0, 8.0])
    tokens, features = torch.zeros(4, 2000, dtype=torch.long), torch.randn(4, 2000, len(std))
    noisy_tokens, noisy, *_ = with_feature_noise((tokens, features, "anchors"), scale, torch.Generator().manual_seed(0))
    assert noisy_tokens is tokens
    noise = (noisy - features).flatten(0, 1)
    torch.testing.assert_close(noise.std(0)[:3], scale[:3], rtol=0.05, atol=0)
    assert (noise[:, 3:] == 0).all()  # features of zero scale untouched


def test_train_py_end_to_end(tmp_path):
    (tmp_path / "models").mkdir()  # cache_dir moves model conversions too: reuse the one the other tests share
    (tmp_path / "models" / "smollm2_135m").symlink_to(packaged_dir("smollm2_135m"))
    args = ["target=tiny_qwen3", "drafter=flexdraft", f"cache_dir={tmp_path}", "data.n_prompts=4", "data.batch_size=2",
            "data.max_new_tokens=8", "~data.mix.chat", "~data.mix.followup", "recipe.tuned_layers=1", "recipe.group_size=4", "recipe.calibration_hidden=8",
            "recipe.optim.steps=3", "recipe.optim.anchors=4", f"recipe.output_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'run'}",
            "data.bfloat16=true", "recipe.optim.autocast=auto"]
    result = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tuned_layers"] == 1 and (tmp_path / "out" / "train_log.jsonl").exists()
    # what ran is recorded: data decoded in bfloat16 (its meta says so), autocast settled to a bool
    assert json.loads((tmp_path / "selfdistill" / "tiny_qwen3" / "meta.json").read_text())["dtype"] == "bfloat16"
    assert "bfloat16: true" in (tmp_path / "out" / "train_config.yaml").read_text()
    assert f"autocast: {str(fast_bfloat16('cpu')).lower()}" in (tmp_path / "out" / "train_config.yaml").read_text()
    # and what making it took, on what machine: every shard was timed
    times = json.loads((tmp_path / "out" / "train_time.json").read_text())
    assert sorted(times["data"]) == ["gsm8k", "math"] and times["untimed_shards"] == 0  # 4 prompts: no MBPP one
    assert all(t["shards"] == t["timed"] and t["minutes"] >= 0 for t in times["data"].values())
    log = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert times["training_minutes"] == pytest.approx(3 * log[-1]["s_per_step"] / 60, abs=0.005)  # one record of 3 steps
    (used,) = times["machines"]  # its thread count is the subprocess's own (test workers may run on fewer)
    assert used.startswith(machine("cpu").rsplit(", ", 1)[0] + ", ") and used.endswith(" threads")
    assert "time to make it: data" in result.stdout and 'held out at step 3: {"val_loss": ' in result.stdout
    float32_data = subprocess.run([sys.executable, "train.py", *args[:-2], "data.bfloat16=false"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert "holds self-distillation data made with other settings" in float32_data.stderr
    tiny = load_target(**target_config("tiny_qwen3"))
    assert load_flexdraft(tiny, str(tmp_path / "out")).group_size == 4
    # a moved training state (another machine's cache, another disk) resumes where it stopped
    (tmp_path / "train" / "flexdraft_tiny_qwen3").rename(tmp_path / "moved")
    longer = [a.replace("recipe.optim.steps=3", "recipe.optim.steps=4") for a in args] + [f"recipe.work_dir={tmp_path / 'moved'}"]
    resumed = subprocess.run([sys.executable, "train.py", *longer], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()] == [3, 4]
    eagle3 = subprocess.run([sys.executable, "train.py", args[0], "drafter=eagle3", *args[2:8], "recipe.draft_vocab=500",
                             "recipe.optim.steps=3", "recipe.optim.ttt_steps=2", f"recipe.output_dir={tmp_path / 'eagle3'}",
                             *args[-3:]], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert eagle3.returncode == 0, eagle3.stderr[-3000:]  # on the data the FlexDraft run built
    drafter = load_eagle3(tiny, str(tmp_path / "eagle3"))
    assert len(drafter.d2t) == 500 and drafter.t2d.sum() == 500 and drafter.feature_layers == (1, 1, 1)  # the one layer recorded
    assert "train.py trains dflash, eagle3, flexdraft drafters" in subprocess.run(
        [sys.executable, "train.py", "target=tiny_qwen3", "drafter=ngram", "recipe=dflash", f"cache_dir={tmp_path}",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300).stderr
