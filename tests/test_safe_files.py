"""Files a run keeps and the inputs train.py takes: a training state loads no code, a write cut
short leaves the previous file (or no checkpoint at all), a file that does not parse is named,
train.py writes where the user says and never over a committed checkpoint unchecked, and
`key={...}` on the command line replaces a dict. Nothing is written into the checkout."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import save_file

import bastion.budget.latency
from bastion.budget.hardware import HardwareProfile
from bastion.budget.latency import calibrated
from bastion.compose import replace_dict_overrides
from bastion.drafters.checkpoint import read_checkpoint, save_checkpoint
from bastion.drafters.flexdraft import FlexDraftDrafter
from bastion.files import atomic_path, atomic_write_text
from bastion.models.loading import ModelNotFound
from bastion.models.target import load_target
from bastion.train import cli
from bastion.train.loop import train_loop
from tests.conftest import ROOT, target_config


@pytest.fixture(scope="module")
def tiny():
    return load_target(**target_config("tiny_qwen3"))  # float32, as runs load it


def training_config(tmp_path, *overrides: str):
    """train.py's config as the command line `overrides` compose it (dicts replaced, as train.py does)."""
    overrides = ["target=tiny_qwen3", "drafter=flexdraft", "device=cpu", f"cache_dir={tmp_path}", *overrides]
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("training", overrides=overrides)
    return replace_dict_overrides(cfg, overrides)


@pytest.fixture
def no_target(monkeypatch):
    """train() must stop before this: loading the target is where the expensive work starts."""
    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(cli, "build_target", refuse)


# ---- training state ------------------------------------------------------------------------

def train_linear(state_path, steps):
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 3)
    batch = lambda gen: torch.randn(4, 3, generator=gen)  # consumes the saved generator
    loss = lambda x: (layer(x).square().mean(), torch.zeros(1), torch.ones(1))
    run_key = {"data": {"mix": {"gsm8k": 1.0}, "n_prompts": 4}, "seed": 0}
    train_loop(layer, [{"params": list(layer.parameters()), "lr": 0.1}], batch, loss, state_path, steps=steps,
               save_every=1, log_every=1, run_key=run_key)
    return layer


def test_the_training_state_loads_without_code_and_a_crafted_one_is_refused(tmp_path):
    straight = train_linear(tmp_path / "straight.pt", 4)
    train_linear(tmp_path / "resumed.pt", 2)
    resumed = train_linear(tmp_path / "resumed.pt", 4)  # module, optimiser, generator, log, key round-trip
    torch.testing.assert_close(resumed.weight, straight.weight, rtol=0, atol=0)
    assert torch.load(tmp_path / "resumed.pt", weights_only=True)["step"] == 4

    marker = tmp_path / "ran"

    class Crafted:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    crafted = tmp_path / "crafted.pt"
    torch.save({"drafter": Crafted()}, crafted)
    with pytest.raises(ValueError) as refusal:
        train_linear(crafted, 4)
    assert not marker.exists()  # the command its pickle names never ran
    assert re.fullmatch(re.escape(str(crafted)) + " [^;]*; delete it to start over.", str(refusal.value))

    cut = tmp_path / "cut.pt"
    cut.write_bytes((tmp_path / "resumed.pt").read_bytes()[:300])
    with pytest.raises(ValueError, match=re.escape(str(cut)) + r" .*delete it"):
        train_linear(cut, 4)


# ---- atomic writes and files that do not parse ---------------------------------------------------

def test_a_write_cut_short_leaves_the_previous_file(tmp_path):
    path = tmp_path / "cache" / "file.json"
    atomic_write_text(path, '{"done": true}')
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(path) as tmp:
            tmp.write_text('{"do')
            raise KeyboardInterrupt  # a kill mid-write
    assert json.loads(path.read_text()) == {"done": True}
    assert os.listdir(path.parent) == ["file.json"]  # no temporary file left


def test_written_files_get_the_permissions_a_plain_open_gives(tmp_path):
    """safetensors writes owner-only files; a drafter saved for a team must be readable by it."""
    mask = os.umask(0o022)
    try:
        with atomic_path(tmp_path / "model.safetensors") as tmp:
            save_file({"w": torch.zeros(2)}, tmp)
        assert os.stat(tmp_path / "model.safetensors").st_mode & 0o777 == 0o644
        os.umask(0o077)
        atomic_write_text(tmp_path / "private.json", "{}")
        assert os.stat(tmp_path / "private.json").st_mode & 0o777 == 0o600
    finally:
        os.umask(mask)


def test_a_half_written_latency_cache_is_measured_again_with_a_warning(tiny, tmp_path, monkeypatch):
    # idle timings stand in for the probe: a busy test machine must not decide this test
    monkeypatch.setattr(bastion.budget.latency, "probe_times", lambda target, sizes, context, repeats: [[1e-3 * (1 + n / 64)] * repeats for n in sizes])
    cpu = HardwareProfile("cpu", {"float32": 0.14}, 8, 2.0)
    first = calibrated(tiny, cpu, tmp_path)
    [path] = (tmp_path / "latency").glob("*.json")
    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # what a kill mid-write left before writes were atomic
    with pytest.warns(UserWarning, match=re.escape(str(path)) + r" .*re-measuring"):
        again = calibrated(tiny, cpu, tmp_path)
    assert again.theta.shape == first.theta.shape == (4,)
    assert json.loads(path.read_text())["theta"] == again.theta.tolist()
    path.write_text(json.dumps({"points": []}))  # parses, but is not a calibration
    with pytest.warns(UserWarning, match=re.escape(str(path))):
        calibrated(tiny, cpu, tmp_path)


def small_drafter(tiny):
    torch.manual_seed(0)
    return FlexDraftDrafter(tiny, tuned_layers=1, group_size=4, calibration_hidden=8, mask_token_id=16)


def test_a_checkpoint_save_cut_short_leaves_no_checkpoint_to_load(tiny, tmp_path, monkeypatch):
    out = tmp_path / "drafter"
    save_checkpoint(small_drafter(tiny), out, torch.float32)
    assert read_checkpoint(str(out), "flexdraft", "tiny_qwen3")[0]["group_size"] == 4

    def killed(state, path):
        path.write_bytes(b"\x00" * 100)  # half a file, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr("bastion.drafters.checkpoint.save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(small_drafter(tiny), out, torch.float32)
    with pytest.raises(ModelNotFound, match="has no config.json"):  # not a checkpoint, rather than half of one
        read_checkpoint(str(out), "flexdraft", "tiny_qwen3")
    assert not list(out.glob("*.safetensors")) and not list(out.glob(".*"))


def test_a_checkpoint_file_that_does_not_parse_is_named(tiny, tmp_path):
    out = tmp_path / "drafter"
    save_checkpoint(small_drafter(tiny), out, torch.float32)
    weights, config = out / "model.safetensors", out / "config.json"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match=re.escape(str(weights)) + " is not a readable safetensors file"):
        read_checkpoint(str(out), "flexdraft", "tiny_qwen3")
    weights.write_bytes(good)
    config.write_text('{"group_size": 4,')
    with pytest.raises(ValueError, match=re.escape(str(config)) + " is not valid JSON"):
        read_checkpoint(str(out), "flexdraft", "tiny_qwen3")


# ---- where train.py writes -------------------------------------------------------------------

def test_train_py_writes_to_the_cache_or_where_a_relative_output_dir_says(tmp_path, monkeypatch):
    assert cli.output_dir(training_config(tmp_path)) == tmp_path / "drafters" / "flexdraft_tiny_qwen3"
    monkeypatch.chdir(tmp_path)
    assert cli.output_dir(training_config(tmp_path, "recipe.output_dir=mine")) == tmp_path / "mine"  # not the checkout's


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_checkpoint_git_tracks_is_replaced_only_with_overwrite_true(tmp_path, no_target):
    repo = tmp_path / "repo"
    (repo / "checkpoints" / "mine").mkdir(parents=True)
    (repo / "checkpoints" / "mine" / "config.json").write_text("{}")
    (repo / "scratch").mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "checkpoints"], check=True)
    assert cli.git_tracked(repo / "checkpoints" / "mine") and cli.git_tracked(ROOT / "checkpoints" / "dflash_smollm2_135m")
    assert not cli.git_tracked(repo / "scratch") and not cli.git_tracked(repo / "scratch" / "new") and not cli.git_tracked(tmp_path)

    tracked = ["data.mix={gsm8k: 1.0}", "data.n_prompts=8", f"recipe.output_dir={repo / 'checkpoints' / 'mine'}"]
    with pytest.raises(ValueError, match=re.escape(str(repo / "checkpoints" / "mine")) + " holds a checkpoint that git tracks; add recipe.overwrite=true"):
        cli.train(training_config(tmp_path, *tracked))
    for allowed in ([*tracked, "recipe.overwrite=true"], ["data.mix={gsm8k: 1.0}", "data.n_prompts=8", f"recipe.output_dir={repo / 'scratch'}"]):
        with pytest.raises(AssertionError, match="the target was loaded"):  # past every check
            cli.train(training_config(tmp_path, *allowed))


# ---- dict overrides and the data mix ----------------------------------------------------------

def test_a_dict_override_replaces_the_configured_dict(tmp_path):
    assert OmegaConf.to_container(training_config(tmp_path).data.mix) == {"gsm8k": 0.36, "math": 0.12, "mbpp": 0.044, "chat": 0.32,
                                                                          "followup": 0.156}
    cfg = training_config(tmp_path, "data.mix={gsm8k: 1.0}", "data.n_prompts=8")
    assert OmegaConf.to_container(cfg.data.mix) == {"gsm8k": 1.0} and cfg.data.n_prompts == 8
    cfg = training_config(tmp_path, "data.mix={gsm8k: 1.0, chat: 1.0}", "data.mix.math=0.5", "~data.mix.chat")
    assert OmegaConf.to_container(cfg.data.mix) == {"gsm8k": 1.0, "math": 0.5}  # later overrides inside it still apply
    assert cfg.target.name == "tiny_qwen3" and cfg.drafter.name == "flexdraft"


@pytest.mark.parametrize("overrides, refusal", [
    ([], "a target with random weights writes none; drop them with ~data.mix.chat ~data.mix.followup"),
    (["data.mix={gsm8k: 1.0, chat: 0.1, followup: 0.2}", "data.n_prompts=20"], "asks for 3 follow-ups of 2 chat conversations"),
    (["++data.mix={gsm8k: 1.0, sharegpt: 1.0}"], r"Unknown training sources \['sharegpt'\]"),
    (["data.mix={gsm8k: -1.0}"], "data.mix weights must be numbers of at least 0"),
    (["data.mix={}"], "data.mix weights must be numbers of at least 0, not all 0"),
    (["data.mix={mbpp: 1.0}", "data.n_prompts=500"], "mbpp has 464 prompts; the mix asks for 500"),
    (["~data.mix.chat", "data.n_prompts=0"], "data.n_prompts must be a whole number of at least 1"),
    (["data.mix=gsm8k"], "data.mix must map training sources to weights"),
], ids=["chat_from_random_target", "more_followups_than_chats", "unknown", "negative", "empty", "too_many", "no_prompts", "not_a_dict"])
def test_a_mix_that_would_fail_later_is_refused_before_the_target_loads(tmp_path, no_target, overrides, refusal):
    with pytest.raises(ValueError, match=refusal):
        cli.train(training_config(tmp_path, *overrides))


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_train_py_takes_the_mix_given_and_output_dirs_from_the_current_directory(tmp_path):
    """From the command line: `data.mix={gsm8k: 1.0}` drops chat (which a random target cannot
    write), and a relative output_dir names a tracked folder of the current directory's repo,
    refused in one line before the target loads."""
    repo = tmp_path / "repo"
    (repo / "checkpoints" / "mine").mkdir(parents=True)
    (repo / "checkpoints" / "mine" / "config.json").write_text("{}")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "checkpoints"], check=True)
    args = ["target=tiny_qwen3", "drafter=flexdraft", f"cache_dir={tmp_path}", "data.mix={gsm8k: 1.0}", "data.n_prompts=4",
            "recipe.output_dir=checkpoints/mine", f"hydra.run.dir={tmp_path / 'run'}"]
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=repo, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr == (
        f"error: {repo / 'checkpoints' / 'mine'} holds a checkpoint that git tracks; add recipe.overwrite=true to replace it, "
        "or choose another recipe.output_dir.\n")
    assert (repo / "checkpoints" / "mine" / "config.json").read_text() == "{}"
