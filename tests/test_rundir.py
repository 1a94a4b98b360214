"""Run dirs hold only what their settings made: reruns with other settings, two writers at
once, duplicated records and prompt ids are refused in one sentence; sampled runs are
reproducible and checked for losslessness."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
import torch

from bastion.bench.datasets import Prompt
from bastion.bench.provenance import read_summary
from bastion.bench.rundir import check_run_dir, locked
from bastion.bench.runner import prompt_hash, summarize_run
from tests.test_errors import run_py
from tests.test_run import ARGS


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "results.jsonl")]


def test_rerun_with_other_settings_is_refused_then_set_aside_with_fresh(tmp_path):
    assert run_py(*ARGS, f"hydra.run.dir={tmp_path}").returncode == 0
    before = (tmp_path / "results.jsonl").read_text()
    other = run_py(*ARGS, "decode.max_new_tokens=4", "decode.temperature=1.0", f"hydra.run.dir={tmp_path}")
    assert other.returncode == 2
    assert "already holds results of 'ar' made with other settings (decode.max_new_tokens 6 -> 4, decode.temperature 0.0 -> 1.0)" in other.stderr
    assert "fresh=true" in other.stderr and len(other.stderr.strip().splitlines()) == 1
    assert (tmp_path / "results.jsonl").read_text() == before
    assert "max_new_tokens: 6" in (tmp_path / "config.yaml").read_text()  # the config on disk still tells what made the records

    fresh = run_py(*ARGS, "decode.max_new_tokens=4", "fresh=true", f"hydra.run.dir={tmp_path}")
    assert fresh.returncode == 0, fresh.stderr
    assert all(len(r["tokens"]) <= 4 for r in records(tmp_path)) and len(records(tmp_path)) == 6
    (aside,) = tmp_path.glob("previous-*")
    assert (aside / "results.jsonl").read_text() == before
    assert "max_new_tokens: 4" in (tmp_path / "config.yaml").read_text()


def test_another_checkpoint_under_the_same_method_name_is_refused(tmp_path):
    from bastion.compose import files_digest

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"a")
    first = files_digest(str(ckpt))
    (ckpt / "model.safetensors").write_bytes(b"b")
    assert files_digest(str(ckpt)) != first and files_digest("z-lab/some-drafter") == "z-lab/some-drafter"

    run = tmp_path / "run"
    run.mkdir()
    check_run_dir(run, {"dflash+chain+fixed4": {"drafter_files": first}})
    (run / "results.jsonl").write_text(json.dumps({"method": "dflash+chain+fixed4"}) + "\n")
    check_run_dir(run, {"dflash+chain+fixed4": {"drafter_files": first}})  # same settings: resumes
    with pytest.raises(ValueError, match=f"drafter_files {first} -> other"):
        check_run_dir(run, {"dflash+chain+fixed4": {"drafter_files": "other"}})


def test_a_local_target_whose_weights_were_replaced_is_refused(tmp_path):
    """A local target dir is known by its files, not its path: new weights in place (another
    header or size) refuse the rerun. Its weights are not read, only their headers."""
    from safetensors.torch import save_file

    from bastion.compose import method_settings, plan_methods
    from tests.test_errors import composed

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    save_file({"w": torch.zeros(2, 2)}, model / "model.safetensors")
    cfg = composed("target=tiny_qwen3", f"target.source={model}")
    ar = plan_methods(cfg)[0]
    first = method_settings(cfg, ar)
    run = tmp_path / "run"
    check_run_dir(run, {"ar": first})
    (run / "results.jsonl").write_text(json.dumps({"method": "ar"}) + "\n")
    save_file({"w": torch.zeros(2, 2)}, model / "model.safetensors")
    check_run_dir(run, {"ar": method_settings(cfg, ar)})  # the same files: resumes
    save_file({"w": torch.zeros(3, 3)}, model / "model.safetensors")
    with pytest.raises(ValueError, match=f"'ar' made with other settings \\(target_files {first['target_files']} -> "):
        check_run_dir(run, {"ar": method_settings(cfg, ar)})
    for source in ("random", "HuggingFaceTB/SmolLM2-135M-Instruct", "packaged:smollm2_135m"):
        assert "target_files" not in method_settings(composed("target=tiny_qwen3", f"target.source={source}"), ar)


def test_a_resume_on_another_machine_model_is_refused(tmp_path, monkeypatch):
    """Records keep the machine they were timed on: a run dir resumed on another CPU or GPU
    model would mix two machines' timings under the last one's machine.json."""
    import bastion.compose
    from bastion.compose import method_settings, plan_methods
    from tests.test_errors import composed

    cfg = composed("target=tiny_qwen3")
    ar = plan_methods(cfg)[0]
    check_run_dir(tmp_path, {"ar": method_settings(cfg, ar)})
    (tmp_path / "results.jsonl").write_text(json.dumps({"method": "ar"}) + "\n")
    check_run_dir(tmp_path, {"ar": method_settings(cfg, ar)})  # the same machine: resumes
    here = method_settings(cfg, ar)["device"]
    monkeypatch.setattr(bastion.compose, "device_name", lambda device: "Another CPU")
    with pytest.raises(ValueError, match=re.escape(f"device {here} -> Another CPU")):
        check_run_dir(tmp_path, {"ar": method_settings(cfg, ar)})


def test_records_of_an_older_version_are_not_resumed(tmp_path):
    (tmp_path / "results.jsonl").write_text(json.dumps({"method": "ar"}) + "\n")
    with pytest.raises(ValueError, match="settings this version did not record"):
        check_run_dir(tmp_path, {"ar": {"seed": 0}})


def test_a_second_writer_is_refused(tmp_path):
    with locked(tmp_path):
        with pytest.raises(ValueError, match=r"Another run \(pid \d+\) is writing to"):
            with locked(tmp_path):
                pass
        with pytest.raises(ValueError, match=r"Another run \(pid \d+\) is writing to"):  # nor a torchrun rank
            with locked(tmp_path, ".rank1"):
                pass
    with locked(tmp_path):  # released
        pass


def test_torchrun_ranks_share_the_run_dir_and_exclude_a_plain_run(tmp_path):
    """Ranks write shards of their own side by side; a plain run (which, with fresh=true,
    would move their shards aside) is refused while any rank writes, and so is a second copy
    of one rank."""
    with locked(tmp_path, ".rank0"), locked(tmp_path, ".rank1"):
        with pytest.raises(ValueError, match=f"^A torchrun job is writing to {tmp_path}; wait"):
            with locked(tmp_path):
                pass
        with pytest.raises(ValueError, match=r"Another run \(pid \d+\) is writing to"):
            with locked(tmp_path, ".rank1"):
                pass
    with pytest.raises(ValueError, match="A torchrun job is writing to"):  # until the last rank is done
        with locked(tmp_path, ".rank0"), locked(tmp_path):
            pass
    with locked(tmp_path):  # all released
        pass


@pytest.mark.parametrize("shard, holder", [("", r"Another run \(pid \d+\)"), (".rank0", "A torchrun job")])
def test_a_second_run_process_is_refused(tmp_path, shard, holder):
    with locked(tmp_path, shard):
        result = run_py(*ARGS, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2 and re.search(f"{holder} is writing to", result.stderr)
    assert not (tmp_path / "results.jsonl").exists()


@pytest.mark.parametrize("text", ["[]", "3", '{"ar": 3}', '{"ar": {"fingerprint": "x"}}'])
def test_a_settings_file_of_another_shape_is_named(tmp_path, text):
    (tmp_path / "methods.json").write_text(text)
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 'methods.json'))} does not hold each method's settings"):
        check_run_dir(tmp_path, {"ar": {"seed": 0}})


def test_duplicate_prompt_ids_are_refused_before_the_model_loads(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "q": "hi"}\n{"id": "b", "q": "yo"}\n{"id": "a", "q": "again"}\n')
    result = run_py("bench=custom", f"bench.path={prompts}", "bench.field=q", "target.source=nobody/no-such-model",
                    f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert "prompt id 'a' twice" in result.stderr and "Cannot load model" not in result.stderr


def test_doubled_records_are_named_not_summarised_into_nan(tmp_path):
    rec = {"method": "ar", "bench": "b", "prompt_id": "p1", "batch_id": "b/p1", "batch_wall_s": 1.0, "new_tokens": 4,
           "steps": 3, "turns": 1, "prefill_s": 0.1, "tokens": [1, 2, 3, 4], "temperature": 0.0, "tree_mode": "ranked", "prompt_hash": prompt_hash(Prompt("p1", ("q",)))}
    (tmp_path / "results.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match="holds 1 record\\(s\\) twice, e.g. ar on p1"):
        summarize_run(tmp_path, {"b": [Prompt("p1", ("q",))]})


def test_a_blank_speedup_says_why(tmp_path):
    rec = {"bench": "b", "batch_wall_s": 1.0, "new_tokens": 4, "steps": 3, "turns": 1, "prefill_s": 0.1,
           "tokens": [1, 2, 3, 4], "temperature": 0.0, "tree_mode": "ranked", "prompt_hash": prompt_hash(Prompt("p1", ("q",)))}
    rows = [{**rec, "method": "ar", "prompt_id": p, "batch_id": p} for p in ("p1", "p2")]
    rows.append({**rec, "method": "m", "prompt_id": "p1", "batch_id": "p1"})
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize_run(tmp_path, {"b": [Prompt("p1", ("q",)), Prompt("p2", ("q",))]}).set_index("method")
    assert pd.isna(summary.loc["m", "speedup"])
    assert summary.loc["m", "note"] == "speedup blank: 0 of its 1 prompts have no AR record, 1 of AR's 2 have none of its"


def test_a_summary_write_cut_short_leaves_the_previous_one_and_a_broken_one_is_named(tmp_path, monkeypatch):
    rec = {"method": "ar", "bench": "b", "prompt_id": "p1", "batch_id": "p1", "batch_wall_s": 1.0, "new_tokens": 4, "steps": 3,
           "turns": 1, "prefill_s": 0.1, "tokens": [1, 2, 3, 4], "temperature": 0.0, "tree_mode": "ranked",
           "prompt_hash": prompt_hash(Prompt("p1", ("q",)))}
    (tmp_path / "results.jsonl").write_text(json.dumps(rec) + "\n")
    prompts = {"b": [Prompt("p1", ("q",))]}
    summarize_run(tmp_path, prompts)
    before = (tmp_path / "summary.csv").read_text()

    def killed(frame, path, **kwargs):
        open(path, "w").write(before[: len(before) // 2])  # half a summary, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(pd.DataFrame, "to_csv", killed)
    with pytest.raises(KeyboardInterrupt):
        summarize_run(tmp_path, prompts)
    assert (tmp_path / "summary.csv").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl", "summary.csv"]  # no temporary file left
    for broken in ("method,bench\nar,b\nar,b,1,2\n", ""):  # written by hand, or by an older version cut short
        (tmp_path / "summary.csv").write_text(broken)
        with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 'summary.csv'))} is not a readable summary .*; delete it"):
            read_summary(tmp_path / "summary.csv")


def test_an_edited_prompt_is_decoded_again(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "q": "Say hi."}\n')
    args = [*ARGS, "bench=custom", f"bench.path={prompts}", "bench.field=q", f"hydra.run.dir={tmp_path / 'run'}"]
    assert run_py(*args).returncode == 0
    prompts.write_text('{"id": "a", "q": "Say something else entirely."}\n')
    assert run_py(*args).returncode == 0
    texts = {r["prompt_hash"] for r in records(tmp_path / "run")}
    assert len(texts) == 2 and len(records(tmp_path / "run")) == 4


def test_sampled_runs_are_reproducible_and_checked_lossless(tmp_path):
    """T=1: two runs with the same seed write the same tokens for AR and the method, the
    method's tokens equal AR's, and the summary says so; at batch 2 the samples do not change."""
    args = [*ARGS, "decode.temperature=1.0", "decode.max_new_tokens=12"]
    runs = [tmp_path / "a", tmp_path / "b", tmp_path / "batched"]
    for run, extra in zip(runs, ([], [], ["decode.batch_size=2"])):
        result = run_py(*args, *extra, f"hydra.run.dir={run}")
        assert result.returncode == 0, result.stderr
    tokens = [{(r["method"], r["prompt_id"]): r["tokens"] for r in records(run)} for run in runs]
    assert tokens[0] == tokens[1] == tokens[2]
    assert all(tokens[0][("ar", p)] == tokens[0][(m, p)] for m, p in tokens[0])
    summary = read_summary(runs[0] / "summary.csv")
    assert summary.lossless.all() and (summary.temperature == 1.0).all()


@pytest.mark.parametrize("fast", [True, False])
def test_the_drafter_dtype_is_recorded_as_it_runs(monkeypatch, fast):
    """drafter.dtype=auto is settled by the machine: its settings say which dtype drafted."""
    import bastion.models.target
    from bastion.compose import method_settings, plan_methods
    from tests.test_errors import composed

    monkeypatch.setattr(bastion.models.target, "fast_bfloat16", lambda device: fast)
    cfg = composed("drafter=dflash", "device=cpu")
    dflash = plan_methods(cfg)[1]
    assert method_settings(cfg, dflash)["drafter"]["dtype"] == ("bfloat16" if fast else "float32")
