"""Every shipped config composes and passes the checks run.py (train.py) makes before any model
loads: each experiment, each grid point of the W&B sweep, and each `python run.py ...` /
`python train.py ...` example of the docs, found by pattern so that a new example is tested
without editing this file. Multirun examples (-m) are composed one job at a time, as Hydra's
basic sweeper splits them (the experiment's own hydra.sweeper.params included)."""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from bastion.bench.cli import check_settings
from bastion.compose import build, plan_methods, replace_dict_overrides
from bastion.sampling import Sampling
from bastion.train.cli import RECIPES
from bastion.train.data import check_mix
from run import installed
from tests.conftest import ROOT

GUIDES = [ROOT / "README.md", *sorted((ROOT / "experiments").glob("*.md")), ROOT / "run.py", ROOT / "train.py", ROOT / "Makefile"]
DOCS = [*GUIDES, *sorted((ROOT / "conf").rglob("*.yaml"))]  # the configs' comments hold examples too
CONFIGS = {"run.py": "config", "train.py": "training"}
# `python run.py ARGS`, `torchrun --nproc-per-node 8 run.py ARGS`, the Makefile's `$(PY) run.py ARGS`. An argument
# is what a shell reads as one word: quoted, or free of spaces, backticks, comments and shell metacharacters,
# so a command ends where its Markdown code span, comment or sentence does (and before a `<placeholder>`).
COMMAND = re.compile(r"""
    (?: python | \$\(PY\) | torchrun(?:\ --?[\w-]+\ \d+)* ) \ (run|train)\.py
    ( (?:\ +(?: "[^"]*" | '[^']*' | [^\s`\#()|;&<>"'] )+ )* )""", re.VERBOSE)
FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p"}  # what to print: the job's config is composed all the same
LAUNCHER_PLUGIN = "hydra_plugins.hydra_submitit_launcher"


@dataclass(frozen=True)
class Command:
    script: str  # run.py | train.py
    overrides: tuple[str, ...]
    multirun: bool = False


def doc_commands(text: str) -> list[Command]:
    """The run.py / train.py commands of a doc. Shell line continuations are joined, and so are
    Markdown code spans that wrap onto the next line; `...` stands for "your overrides"."""
    text = re.sub(r"\\\n\s*", " ", text)
    text = re.sub(r"(?<!`)`[^`]+`(?!`)", lambda span: span.group().replace("\n", " "), text)
    commands = []
    for script, args in COMMAND.findall(text):
        words, overrides, multirun = iter(shlex.split(args)), [], False
        for word in words:
            if word in FLAGS_WITH_VALUE:
                next(words)
            elif word in ("-m", "--multirun"):
                multirun = True
            elif word.startswith("-"):
                raise AssertionError(f"{script} {args}: teach this test what the flag {word} means")
            elif word != "...":
                overrides.append(word)
        commands.append(Command(f"{script}.py", tuple(overrides), multirun))
    return commands


DOC_COMMANDS = list(dict.fromkeys((path.relative_to(ROOT).as_posix(), command)
                                  for path in DOCS for command in doc_commands(path.read_text())))


def composed(script: str, overrides: list[str], hydra: bool = False):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(CONFIGS[script], overrides=overrides, return_hydra_config=hydra)


def jobs(command: Command) -> list[list[str]]:
    """The overrides of each job the command starts: one, or every combination of a multirun's
    sweeps and the composed config's hydra.sweeper.params (what Hydra's basic sweeper runs).
    Without the submitit plugin the launcher's overrides are left out: the jobs' own still compose."""
    overrides = list(command.overrides)
    if not installed(LAUNCHER_PLUGIN):
        overrides = [o for o in overrides if not o.startswith(("hydra/launcher=", "hydra.launcher."))]
    if not command.multirun:
        return [overrides]
    parsed = OverridesParser.create().parse_overrides(overrides)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    params = composed(command.script, fixed, hydra=True).hydra.sweeper.params or {}
    swept = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + overrides)
    return [job for batch in BasicSweeper.split_arguments(swept, None) for job in batch]


def check(script: str, overrides: list[str]) -> None:
    """Compose, then what run.py (train.py) checks before any model loads."""
    cfg = composed(script, overrides)
    OmegaConf.set_struct(cfg, False)
    replace_dict_overrides(cfg, overrides)
    if script == "train.py":
        assert cfg.drafter.name in RECIPES, f"train.py trains {RECIPES} (got {cfg.drafter.name})"
        check_mix(cfg.data.mix, cfg.data.n_prompts, untrained_target=cfg.target.get("source") == "random")
        return
    check_settings(cfg)
    d = cfg.decode
    Sampling(d.temperature, d.top_k, d.top_p, d.tree_mode)
    for plan in plan_methods(cfg)[1:]:
        build(plan.budget)


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")))
def test_every_experiment_composes(experiment):
    for job in jobs(Command("run.py", (f"experiment={experiment}",), multirun=True)):
        check("run.py", job)


def sweep_grid(path: Path) -> list[list[str]]:
    """Every grid point of a W&B sweep file, as the overrides its agent passes (`key=value` each,
    ${args_no_hyphens}) after the command's own Hydra overrides."""
    sweep = yaml.safe_load(path.read_text())
    assert sweep["program"] == "run.py" and sweep["method"] == "grid"
    fixed = [arg for arg in sweep["command"] if not arg.startswith("${")]
    params = sweep["parameters"]
    values = [p["values"] if "values" in p else [p["value"]] for p in params.values()]
    return [fixed + [f"{k}={v}" for k, v in zip(params, point)] for point in itertools.product(*values)]


def test_every_grid_point_of_the_wandb_sweep_composes():
    grid = sweep_grid(ROOT / "experiments" / "wandb_sweep.yaml")
    assert len(grid) == 5 * 2 * 5
    for point in grid:
        check("run.py", point)


def command_id(x) -> str:
    return x if isinstance(x, str) else " ".join([x.script, *["-m"] * x.multirun, *x.overrides])


@pytest.mark.parametrize("doc,command", DOC_COMMANDS, ids=command_id)
def test_every_documented_command_composes(doc, command):
    for job in jobs(command):
        check(command.script, job)


def test_examples_are_found_in_every_doc():
    """The pattern finds commands everywhere it should (a pattern that found none would pass
    the test above vacuously), multiruns and wrapped lines included."""
    docs = {doc for doc, _ in DOC_COMMANDS}
    for path in GUIDES:
        assert path.relative_to(ROOT).as_posix() in docs
    found = {c for _, c in DOC_COMMANDS}
    assert Command("run.py", ("drafter=ngram", "tree=chain", "budget=fixed", "budget.nodes=4", "bench.limit=20")) in found
    assert Command("run.py", ("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "gpu=a100", "target=qwen3_8b",
                              "bench=gsm8k,math500,humaneval,mbpp,mt_bench", "tree=chain,best_first"), True) in found
    assert Command("run.py", ("hydra.run.dir=outputs/qwen3_8b_all", "target=qwen3_8b", "bench=all", "gpu=h100")) in found
    wrapped = [c for c in found if c.script == "train.py" and "recipe.optim.soft_labels=0.0" in c.overrides]
    assert wrapped and "data.n_prompts=480" in wrapped[0].overrides  # a code span over two lines of README
    assert len(jobs(Command("run.py", ("experiment=flexdraft_batch_cpu", "bench=gsm8k,mt_bench"), True))) == 5 * 2


def test_a_broken_example_fails():
    """The bug the sweep file and run.py's docstring had: budget.nodes is the fixed budget's
    key, not the default (bastion) budget's."""
    with pytest.raises(ConfigCompositionException, match="budget.nodes"):
        check("run.py", ["drafter=ngram", "tree=chain", "budget.nodes=4"])
    with pytest.raises(ValueError, match="budget.nodes must be at least 1"):
        check("run.py", ["budget=fixed", "budget.nodes=0"])
    with pytest.raises(ValueError, match="Unknown training sources"):
        check("train.py", ["+data.mix.nope=1.0"])


@pytest.mark.skipif(installed(LAUNCHER_PLUGIN), reason="the submitit plugin is installed here")
def test_slurm_without_the_plugin_says_what_to_install():
    result = subprocess.run([sys.executable, "run.py", "-m", "hydra/launcher=slurm", "bench=gsm8k"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: hydra/launcher=slurm needs Hydra's submitit plugin: run "
                                     "`pip install '.[cluster]'` in the bastion checkout.")
