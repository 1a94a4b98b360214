"""experiments/gpu_check.py is ready for a GPU: its smoke mode runs every section on the CPU
(a tiny shape, the Triton kernel under its interpreter) and writes the JSON a GPU run writes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SECTIONS = ("target", "logits", "attention", "forward", "verify_latency", "lossless", "memory", "host_step",
            "compiled_forward", "graphed_forward", "graphed_decode")


@pytest.mark.slow
def test_smoke_run_reports_every_section(tmp_path):
    # as on a GPU machine's own image: PyTorch and transformers, none of this project's config stack
    for name in ("hydra", "omegaconf"):
        (tmp_path / "absent" / name).mkdir(parents=True)
        (tmp_path / "absent" / name / "__init__.py").write_text(f"raise ImportError('no {name} here')\n")
    path = os.pathsep.join(filter(None, [str(tmp_path / "absent"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": path}  # the default output path: $OUT/gpu_check.json
    if importlib.util.find_spec("triton") is not None:
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run([sys.executable, str(ROOT / "experiments" / "gpu_check.py"), "--smoke"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    failed = {name: s.get("traceback") for name, s in report["sections"].items() if not s["ok"]}
    assert result.returncode == 0 and not failed, (failed, result.stderr[-2000:])
    assert tuple(report["sections"]) == SECTIONS and report["smoke"]
    assert {"device", "torch", "triton", "wall_s"} <= report.keys()
    assert all(s["seconds"] > 0 for s in report["sections"].values())
    for name in SECTIONS:
        assert f"{name:<15} ok in " in result.stdout

    sections = report["sections"]
    kernels = [k for k in ("sdpa", "flex", "triton") if k in sections["attention"]]
    assert kernels[:2] == ["sdpa", "flex"]
    for kernel in kernels:  # float32: every kernel is transformers' and SDPA's within rounding
        logits = sections["logits"][kernel]
        assert logits["max_abs_diff"] < 1e-4 and logits["max_abs_diff_through_kernel"] < 1e-4 and logits["argmax_agreement"] == 1.0
        assert sections["attention"][kernel]["max_abs_err_vs_float32"] < 1e-5
    cells = sections["verify_latency"]["cells"]
    assert {(c["B"], c["N"]) for c in cells} == {(b, n) for b in (1, 2) for n in (1, 4, 16)}
    assert all(c["measured_ms"] > 0 and c["prior_ms"] > 0 for c in cells)
    lossless = sections["lossless"]
    methods = ("best_first+fixed8", "best_first+bastion", "eagle3+best_first+fixed59")
    assert all({"exact", "lossless_ties", "divergences"} <= lossless[m].keys() for m in methods)
    assert lossless["eagle3+best_first+fixed59"]["exact"]  # float32 on the CPU: no near-ties to forgive
    assert sections["memory"]["plan_peak_gb"] > 0 and sections["memory"]["measured_peak_gb"] is None  # no CUDA allocator
    assert len(sections["host_step"]["cells"]) == 4
    assert [c["N"] for c in sections["attention"]["batch1"]] == [4]
    assert all(c[f"{k}_max_abs_err_vs_sdpa"] < 1e-5 for c in sections["attention"]["batch1"] for k in kernels)
    causal = sections["attention"]["causal"]  # no tree, after a prefix
    assert [c["N"] for c in causal] == [1, sections["attention"]["shape"]["N"]]
    assert all(c[f"{k}_max_abs_err_vs_sdpa"] < 1e-5 for c in causal for k in kernels)
    forward = sections["forward"]
    assert [(c["B"], c["N"]) for c in forward["cells"]] == [(1, 1), (2, 8)]
    assert all(c[f"{k}_ms"] > 0 for c in forward["cells"] for k in kernels)
    assert forward["profile"]["aten_calls"] > 0 and forward["profile"]["busiest"][0]["self_cpu_ms"] > 0
    (compiled,) = sections["compiled_forward"]["cells"]
    assert compiled["compile_s"] > 0 and compiled["compiled_ms"] > 0 and compiled["eager_ms"] > 0
    assert compiled["capture"]  # N > 1: compiled with the drafter's feature layers, as graphed_decode's trees run
    (graphed,) = sections["graphed_forward"]["cells"]  # a CPU has no graphs: the same forward, run again
    assert not sections["graphed_forward"]["graphs"]
    assert all(graphed[k]["max_abs_diff"] == 0 and graphed[k]["graph_ms"] > 0 for k in kernels), graphed
    decode = sections["graphed_decode"]  # a CPU compiles by inductor, without graphs
    assert decode["execution"] == "compiled" and decode["skipped_graphs"] == 0 and decode["recorded_graphs_inputs"] == 0
    assert decode["eager_ar"]["step_ms"] > 0 and decode["graphed_ar"]["compile_or_record_s"] > 0
    assert decode["graphed_ar"]["lossless_ties"] and decode["graphed_best_first3"]["lossless_ties"]
    assert decode["graphed_best_first3"]["compile_or_record_s"] == 0  # compiled_forward compiled its steps' graph


def test_sections_past_the_deadline_are_skipped_and_reported(tmp_path):
    """A device run has a hard time limit: past --deadline the sections not yet started are
    skipped (here every one: the deadline is past before the first), so the one in flight when
    the limit strikes is never lost. Sections go in the order --only names them."""
    out = tmp_path / "gpu_check.json"
    command = [sys.executable, str(ROOT / "experiments" / "gpu_check.py"), str(out), "--smoke", "--only", "logits,target",
               "--deadline", "1e-9"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    skipped = {"ok": False, "error": "skipped: past the 1e-09 s deadline", "seconds": 0.0}
    sections = json.loads(out.read_text())["sections"]
    assert sections == {"target": skipped, "logits": skipped} and list(sections) == ["logits", "target"]


def test_a_section_past_its_limit_is_stopped_and_the_next_runs(tmp_path):
    out = tmp_path / "gpu_check.json"
    command = [sys.executable, str(ROOT / "experiments" / "gpu_check.py"), str(out), "--smoke", "--only", "target,logits",
               "--section-limit", "0.001"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    sections = json.loads(out.read_text())["sections"]
    assert result.returncode == 1 and list(sections) == ["target", "logits"], result.stderr[-2000:]
    assert all(s["error"] == "SectionTimeout: past its time limit (--section-limit)" for s in sections.values())


def test_a_failed_section_reports_the_cells_it_measured(tmp_path, monkeypatch):
    """A section that fails or runs out of time midway (a compile taking the rest of its limit)
    still reports the cells measured before: device time is too scarce to measure them again."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))  # as when run as a script: host_step beside it
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "experiments" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    run = gpu_check.Run(gpu_check.SMOKE, "auto", tmp_path)

    def section(run):
        run.partial().append({"B": 1, "N": 1, "compile_s": 2.0})
        raise RuntimeError("the next shape failed to compile")

    result = gpu_check.run_section(run, section, limit=0)
    assert not result["ok"] and result["error"] == "RuntimeError: the next shape failed to compile"
    assert result["partial_cells"] == [{"B": 1, "N": 1, "compile_s": 2.0}]
    assert gpu_check.run_section(run, lambda run: {"cells": run.partial()}, limit=0)["cells"] == []
