"""Summary metrics over result records (one record per prompt x method).

AAL (average acceptance length) = tokens produced by decode steps / decode steps, the bonus
token included, as in DFlash and EAGLE; the first token, which prefill produces, is left out
of both, so AR decoding has AAL exactly 1. Speedup = AR wall time / method wall time over the
same prompts of the same run. Lossless = every output equals AR's, token for token: at
temperature 0, and at temperature > 0 with ranked children (keyed sampling draws AR's sample);
sampled children are lossless in distribution only, which tests prove, so it stays blank.
lossless_ties = every output equals AR's or first leaves it at a near-tie of the target's
logits, which rounding explains (divergence.py; at temperature 0, else as lossless).
speedup_lo / speedup_hi = a 95% bootstrap interval of the speedup over batches
(speedup_interval); `note` says when a speedup rests on too few prompts or batches to trust.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from bastion.bench.divergence import is_tie

BASELINE = "ar"


MIN_PROMPTS = 5  # below this a speedup is noted as unreliable, however narrow its interval
RESAMPLES = 2000


def batch_walls(records: pd.DataFrame) -> pd.Series:
    """Wall time of each batch of one method on one benchmark, by batch_id: each row carries the
    time of the turns it took part in, so a batch's is its rows' largest (the row with the most
    turns took part in every one) and each batch counts once."""
    return records.groupby("batch_id").batch_wall_s.max()


def speedup_interval(ar_walls: pd.Series, walls: pd.Series, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the speedup: batches (shared by AR and the method, so each
    pair saw the same machine state) are resampled with replacement and the speedup recomputed
    as the headline is, total AR wall / total method wall. Chosen over an interquartile range
    of per-batch speedups because it bounds the reported number itself (a ratio of sums, which
    can fall outside the per-batch quartiles) and narrows as batches accumulate, so a run of
    few batches shows its uncertainty; a percentile bootstrap still undercovers when batches
    are few, hence the MIN_PROMPTS note. NaNs when fewer than two batches are shared.
    Deterministic (`seed`), so a summary recomputed by the report matches the run's."""
    ar_walls, walls = ar_walls.align(walls, join="inner")
    if len(walls) < 2:
        return float("nan"), float("nan")
    picks = np.random.default_rng(seed).integers(0, len(walls), size=(RESAMPLES, len(walls)))  # [R, batches]
    ratios = ar_walls.to_numpy()[picks].sum(axis=1) / walls.to_numpy()[picks].sum(axis=1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def summarize(records: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (bench, method), group in records.groupby(["bench", "method"], sort=False):
        baseline = records[(records.bench == bench) & (records.method == BASELINE)]
        shared = sorted(set(group.prompt_id) & set(baseline.prompt_id))
        walls = batch_walls(group)
        wall = float(walls.sum())
        new_tokens = int(group.new_tokens.sum())
        steps = int(group.steps.sum())
        row = {
            "method": method,
            "bench": bench,
            "n_prompts": len(group),
            "new_tokens": new_tokens,
            "aal": (new_tokens - int(group.turns.sum())) / steps if steps else float("nan"),
            "tokens_per_s": new_tokens / wall if wall else float("nan"),
            "tpot_ms": 1000 * wall / new_tokens if new_tokens else float("nan"),
            "ttft_ms": 1000 * float(group["ttft_s" if "ttft_s" in group else "prefill_s"].mean()),  # records before ttft_s: every turn's
            "speedup": float("nan"),
            "speedup_lo": float("nan"),
            "speedup_hi": float("nan"),
            "lossless": None,
            "lossless_ties": None,
            "temperature": float(group.temperature.iloc[0]) if "temperature" in group else 0.0,
            "note": "",
        }
        notes = []
        if shared and len(shared) == len(group) == len(baseline):
            ar_walls = batch_walls(baseline)
            row["speedup"] = float(ar_walls.sum()) / wall
            row["speedup_lo"], row["speedup_hi"] = speedup_interval(ar_walls, walls)
            if method != BASELINE:  # AR's own speedup is 1 by definition
                notes += reliability_notes(len(group), row["speedup_lo"])
            if token_equal(group) and token_equal(baseline):
                ours = group.set_index("prompt_id").tokens
                ref = baseline.set_index("prompt_id").tokens
                row["lossless"] = all(ours[p] == ref[p] for p in shared)
                row["lossless_ties"] = lossless_ties(group, [p for p in shared if ours[p] != ref[p]], row["temperature"])
        else:
            notes.append(f"speedup blank: {len(group) - len(shared)} of its {len(group)} prompts have no AR record, "
                         f"{len(baseline) - len(shared)} of AR's {len(baseline)} have none of its")
        compiling = float(group.groupby("batch_id").compile_s.max().sum()) if "compile_s" in group else 0.0
        if compiling:  # torch.compile built a graph inside a timed step: one-off time, counted in its wall
            notes.append(f"{compiling:.1f} s of its timed steps compiled (torch.compile): its wall includes them")
        row["note"] = "; ".join(notes)
        rows.append(row)
    return pd.DataFrame(rows)


def reliability_notes(n_prompts: int, speedup_lo: float) -> list[str]:
    """What keeps a measured speedup from being trusted as it stands."""
    notes = ["spread blank: one batch (the interval resamples batches)"] if np.isnan(speedup_lo) else []
    if n_prompts < MIN_PROMPTS:
        notes.append(f"only {n_prompts} prompt(s): too few for a reliable speedup (use {MIN_PROMPTS} or more)")
    return notes


def lossless_ties(records: pd.DataFrame, differing: list, temperature: float) -> bool | None:
    """Whether every output that differs from AR's (the prompt ids `differing`) first left it at a
    near-tie (divergence.py): known at temperature 0 only, where the runner records each first
    divergence (None above it); an output that differs with no divergence recorded (its AR
    record in another process's shard) is not counted a tie."""
    if not differing:
        return True
    if temperature != 0 or "divergence" not in records:
        return None
    found = records.set_index("prompt_id").divergence
    return all(isinstance(found[p], dict) and is_tie(found[p]) for p in differing)


def token_equal(records: pd.DataFrame) -> bool:
    """Whether these records' outputs are meant to equal AR's token for token (module docstring)."""
    if "temperature" not in records or (records.temperature == 0).all():
        return True
    return "tree_mode" in records and (records.tree_mode == "ranked").all()


def with_oracle(summary: pd.DataFrame, swept: list[str], name: str) -> pd.DataFrame:
    """Add, per benchmark, a row `name` copying the best-speedup method among `swept` (the
    fixed budgets of an oracle sweep), with the winning method in `oracle_of`."""
    best = summary[summary.method.isin(swept)].sort_values("speedup", ascending=False).groupby("bench", sort=False).head(1)
    return pd.concat([summary, best.assign(oracle_of=best.method, method=name)], ignore_index=True)


STEP_LISTS = ["produced", "tree_sizes", "expected", "step_s", "verify_s", "predicted_verify_s"]  # a record's per-step lists


def step_table(records: pd.DataFrame) -> pd.DataFrame:
    """One row per decode step (method, bench, produced, tree_size, expected, step_s, verify_s,
    predicted_verify_s): the per-step lists of every record, flattened. `produced` counts the
    bonus token, so `produced - 1` is the number of accepted draft tokens; AR steps have tree
    size 0; predicted_verify_s is NaN where no latency model forecast the step."""
    steps = records[["method", "bench", *STEP_LISTS]].explode(STEP_LISTS).dropna(subset=["produced"])
    steps = steps.rename(columns={"tree_sizes": "tree_size"}).reset_index(drop=True)
    numeric = steps.columns[2:]
    steps[numeric] = steps[numeric].apply(pd.to_numeric, errors="coerce")
    return steps.astype({"produced": int, "tree_size": int})


def _distribution(steps: pd.DataFrame, column: str) -> pd.DataFrame:
    counts = steps.groupby(["method", column], sort=False).size().rename("steps").reset_index()
    counts["fraction"] = counts.steps / counts.groupby("method", sort=False).steps.transform("sum")
    return counts.sort_values(["method", column], kind="stable").reset_index(drop=True)


def accepted_length_histogram(steps: pd.DataFrame) -> pd.DataFrame:
    """Per method, how many steps produced each number of tokens (bonus included), so the
    histogram's mean is the method's per-step AAL. `steps` is step_table(records)."""
    return _distribution(steps, "produced")


def tree_size_distribution(steps: pd.DataFrame) -> pd.DataFrame:
    """Per method, how many steps verified a tree of each size: for a budget controller, the
    budgets it chose. `steps` is step_table(records)."""
    return _distribution(steps, "tree_size")


def depth_acceptance_rate(steps: pd.DataFrame) -> pd.DataFrame:
    """Per method and depth d >= 1: the share of steps that accepted at least d draft tokens,
    among the steps whose tree had at least d nodes (a tree of n nodes is at most n deep, and
    the records keep sizes, not depths). Depths run to one past the deepest acceptance, where
    the rate is 0. AR steps (no tree) drop out. `steps` is step_table(records)."""
    rows = []
    for method, group in steps[steps.tree_size > 0].groupby("method", sort=False):
        accepted = group.produced - 1
        for depth in range(1, int(accepted.max()) + 2):
            could = group.tree_size >= depth
            if could.any():
                rows.append({"method": method, "depth": depth, "steps": int(could.sum()),
                             "rate": float((accepted[could] >= depth).mean())})
    return pd.DataFrame(rows, columns=["method", "depth", "steps", "rate"])


def aal_by_tree_size(steps: pd.DataFrame) -> pd.DataFrame:
    """Per method, tokens per step (bonus included) of the steps whose tree size falls in each
    power-of-two bin [2^k, 2^(k+1)), with the bin's mean tree size: how acceptance grows with
    the budget. AR steps (no tree) drop out. `steps` is step_table(records)."""
    drafted = steps[steps.tree_size > 0]
    bins = 2 ** np.floor(np.log2(drafted.tree_size)).astype(int)
    grouped = drafted.assign(size_bin=bins).groupby(["method", "size_bin"], sort=False)
    table = grouped.agg(tree_size=("tree_size", "mean"), aal=("produced", "mean"), steps=("produced", "size"))
    return table.reset_index().sort_values(["method", "size_bin"], kind="stable").reset_index(drop=True)
