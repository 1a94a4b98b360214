"""Self-distillation data and drafter training on a tiny target: shards resume, training
learns and resumes from its last checkpoint, train.py writes a loadable drafter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bastion.drafters.dflash import DFlashDrafter, new_dflash_config
from bastion.drafters.flexdraft import FlexDraftDrafter, load_flexdraft
from bastion.models.target import load_target
from bastion.train.data import build_selfdistill, load_selfdistill, training_prompts
from bastion.train.dflash import train_dflash
from bastion.train.examples import split_examples, to_examples
from bastion.train.flexdraft import train_flexdraft
from tests.conftest import ROOT, target_config


@pytest.fixture(scope="module")
def tiny():
    target = load_target(**target_config("tiny_qwen3"))
    target.model.requires_grad_(False)
    return target


@pytest.fixture(scope="module")
def data(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("selfdistill")
    prompts = training_prompts({"gsm8k": 1, "mbpp": 1}, 6, seed=0)
    return out, build_selfdistill(tiny, out, prompts, layers=(0, 1), max_new_tokens=12, batch_size=2)


def test_selfdistill_is_the_targets_own_greedy_answers_and_resumes(tiny, data):
    out, dataset = data
    assert len(dataset) == 6 and len(list(out.glob("shard_*"))) == 3
    row = dataset.with_format("torch")[0]
    assert row["features"].shape == (len(row["input_ids"]) - 1, 2 * 64)
    from bastion.engine import generate

    prompt = row["input_ids"][: row["answer_start"]].tolist()
    assert generate(tiny, [prompt], max_new_tokens=12).generations[0].tokens == row["input_ids"][row["answer_start"]:].tolist()
    first = (out / "shard_00000" / "dataset_info.json").stat().st_mtime_ns
    import shutil

    shutil.rmtree(out / "shard_00002")
    prompts = training_prompts({"gsm8k": 1, "mbpp": 1}, 6, seed=0)
    assert len(build_selfdistill(tiny, out, prompts, layers=(0, 1), max_new_tokens=12, batch_size=2)) == 6
    assert (out / "shard_00000" / "dataset_info.json").stat().st_mtime_ns == first  # kept, not rebuilt
    with pytest.raises(FileNotFoundError, match="incomplete"):
        load_selfdistill(out, n_shards=4)


@pytest.mark.parametrize("kind", ["dflash", "flexdraft"])
def test_training_learns_and_resumes(tiny, data, kind, tmp_path):
    examples, val_examples = split_examples(to_examples(data[1]), 0.34)
    assert len(examples) == 4 and len(val_examples) == 2
    torch.manual_seed(0)
    if kind == "dflash":
        drafter, train = DFlashDrafter(new_dflash_config(tiny, 1, 4, [0, 1], 16), tiny), train_dflash
        kw = dict(seqs_per_step=2, anchors=8, lr=3e-3)
    else:
        drafter, train = FlexDraftDrafter(tiny, tuned_layers=1, group_size=4, calibration_hidden=16, mask_token_id=16), train_flexdraft
        kw = dict(seqs_per_step=2, anchors=8, lr=3e-3, lr_tuned=1e-3)
    state = tmp_path / "state.pt"
    log = train(drafter, examples, state, steps=30, log_every=10, save_every=10, val_examples=val_examples, val_every=10, **kw)
    assert log[-1]["loss"] < log[0]["loss"]
    assert len(log[-1]["acc"]) == 3 and len(log[-1]["val_acc"]) == 3 and "val_loss" in log[0]
    # a rerun with more steps resumes at step 30 and keeps the log
    log = train(drafter, examples, state, steps=40, log_every=10, save_every=10, val_examples=val_examples, val_every=10, **kw)
    assert [r["step"] for r in log] == [10, 20, 30, 40]


def test_train_py_end_to_end(tmp_path):
    args = ["target=tiny_qwen3", "drafter=flexdraft", f"cache_dir={tmp_path}", "data.n_prompts=4", "data.batch_size=2",
            "data.max_new_tokens=8", "recipe.tuned_layers=1", "recipe.group_size=4", "recipe.calibration_hidden=8",
            "recipe.optim.steps=3", "recipe.optim.anchors=4", f"recipe.output_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'run'}"]
    result = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tuned_layers"] == 1 and (tmp_path / "out" / "train_log.jsonl").exists()
    tiny = load_target(**target_config("tiny_qwen3"))
    assert load_flexdraft(tiny, str(tmp_path / "out")).group_size == 4
    assert "train.py trains dflash and flexdraft drafters" in subprocess.run(
        [sys.executable, "train.py", "target=tiny_qwen3", "drafter=ngram", "recipe=dflash", f"cache_dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300).stderr
