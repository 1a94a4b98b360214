"""Summary metrics over result records (one record per prompt x method).

AAL (average acceptance length) = tokens produced by decode steps / decode steps, the bonus
token included, as in DFlash and EAGLE; the first token, which prefill produces, is left out
of both, so AR decoding has AAL exactly 1. Speedup = AR wall time / method wall time over the
same prompts of the same run.
"""

from __future__ import annotations

import pandas as pd

BASELINE = "ar"


def batch_wall(records: pd.DataFrame) -> float:
    """Wall time of a method: each batch counted once (all its rows carry the batch's time)."""
    return float(records.drop_duplicates(["method", "bench", "batch_id"])["batch_wall_s"].sum())


def summarize(records: pd.DataFrame) -> pd.DataFrame:
    rows = []
    greedy = "temperature" not in records or (records.temperature == 0).all()
    for (bench, method), group in records.groupby(["bench", "method"], sort=False):
        baseline = records[(records.bench == bench) & (records.method == BASELINE)]
        shared = sorted(set(group.prompt_id) & set(baseline.prompt_id))
        wall = batch_wall(group)
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
            "ttft_ms": 1000 * float(group.prefill_s.mean()),
            "speedup": float("nan"),
            "lossless": None,
            "temperature": float(group.temperature.iloc[0]) if "temperature" in group else 0.0,
        }
        if shared and len(shared) == len(group) == len(baseline):
            row["speedup"] = batch_wall(baseline) / wall
            if greedy:  # at temperature > 0 outputs differ by design; tests check the distribution
                ours = group.set_index("prompt_id").tokens
                ref = baseline.set_index("prompt_id").tokens
                row["lossless"] = all(ours[p] == ref[p] for p in shared)
        rows.append(row)
    return pd.DataFrame(rows)


def with_oracle(summary: pd.DataFrame, swept: list[str], name: str) -> pd.DataFrame:
    """Add, per benchmark, a row `name` copying the best-speedup method among `swept` (the
    fixed budgets of an oracle sweep), with the winning method in `oracle_of`."""
    best = summary[summary.method.isin(swept)].sort_values("speedup", ascending=False).groupby("bench", sort=False).head(1)
    return pd.concat([summary, best.assign(oracle_of=best.method, method=name)], ignore_index=True)
