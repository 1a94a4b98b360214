"""Paper tables and figures from finished runs: `python -m bastion.bench.report DIR [DIR ...] [--out DIR]`.

A Hydra run dir (outputs/DATE/TIME) holds one results.jsonl (results.rankN.jsonl per process
under torchrun); a multirun dir (multirun/DATE/TIME) holds numbered job dirs with one each.
Every run is summarized on its own, because a speedup is a ratio of wall times taken in one
process on one machine, AR included; runs are then merged by those ratios, never by dividing
times taken in different runs. A method measured by several runs (AR appears in every job of a
sweep) gets the mean of its per-run numbers, the sum of their prompts and the widest of their
speedup intervals. The Markdown names each run's machine and settings (its machine.json).

Writes report.md, report.tex, report.csv and plots/*.png into the first dir (or --out) and
prints the Markdown. Figures are built on matplotlib.figure.Figure, not pyplot, so saving uses
the Agg canvas and a notebook can display the same objects.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, ScalarFormatter

from bastion.bench.metrics import (
    BASELINE,
    MIN_PROMPTS,
    aal_by_tree_size,
    accepted_length_histogram,
    depth_acceptance_rate,
    step_table,
    summarize,
    tree_size_distribution,
    with_oracle,
)
from bastion.bench.provenance import read_machine, read_summary
from bastion.bench.records import run_records

COLUMNS = ["method", "bench", "temperature", "batch_size", "speedup", "speedup_lo", "speedup_hi", "aal", "tokens_per_s",
           "tpot_ms", "ttft_ms", "lossless", "lossless_ties", "n_prompts"]
KEYS = ["method", "bench", "temperature", "batch_size"]
MEASURES = ["speedup", "aal", "tokens_per_s", "tpot_ms", "ttft_ms"]


def find_runs(dirs: list[Path]) -> list[Path]:
    """Every run dir under `dirs` with records (results.jsonl, or torchrun's results.rankN.jsonl)."""
    found = {p.parent.resolve() for d in dirs for p in Path(d).rglob("results*.jsonl") if p.stat().st_size}
    if not found:
        raise FileNotFoundError(f"No results.jsonl with records under {', '.join(map(str, dirs))}: pass a Hydra run "
                                "dir (outputs/DATE/TIME) or multirun dir (multirun/DATE/TIME) of a finished run.py.")
    return sorted(found)


def with_recomputed_oracles(summary: pd.DataFrame, saved_summary: Path) -> pd.DataFrame:
    """Oracle rows exist only in the run's summary.csv (the cli adds them after decoding), each
    with its winning budget in `oracle_of` (e.g. dflash+best_first+fixed16): pick again the best
    of this run's methods with that prefix and a fixed budget, so that the oracle covers the
    same prompts as every other row."""
    saved = read_summary(saved_summary) if saved_summary.exists() else pd.DataFrame()
    if "oracle_of" not in saved:
        return summary
    for name, winner in saved.dropna(subset=["oracle_of"]).drop_duplicates("method")[["method", "oracle_of"]].values:
        fixed = re.escape(re.sub(r"fixed\d+$", "", winner)) + r"fixed\d+"
        summary = with_oracle(summary, [m for m in summary.method.unique() if re.fullmatch(fixed, m)], name)
    return summary


def all_lossless(values: pd.Series) -> bool | None:
    measured = values.dropna()
    return bool(measured.all()) if len(measured) else None


def load(dirs: list[Path]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(long, steps): the merged summary, one row per method x bench x temperature x batch size
    (COLUMNS); and every decode step of every run (metrics.step_table). The batch size of a
    run is the largest batch it decoded."""
    summaries, steps = [], []
    for run_dir in find_runs(dirs):
        records = pd.DataFrame(run_records(run_dir))  # a prompt edited since its records: the last one, as the run's summary
        records = records.drop_duplicates(["method", "bench", "prompt_id"], keep="last")
        summary = with_recomputed_oracles(summarize(records), run_dir / "summary.csv")
        summaries.append(summary.assign(batch_size=int(records.batch_size.max())))
        steps.append(step_table(records))
    grouped = pd.concat(summaries, ignore_index=True).groupby(KEYS, sort=False)
    long = (grouped[MEASURES].mean().join(grouped.lossless.agg(all_lossless)).join(grouped.lossless_ties.agg(all_lossless))
            .join(grouped.n_prompts.sum())
            .join(grouped.speedup_lo.min()).join(grouped.speedup_hi.max()))
    return long.reset_index()[COLUMNS], pd.concat(steps, ignore_index=True)


def setting(temperature: float, batch_size: int) -> str:
    return f"T={temperature}, batch {batch_size}"


def run_lines(dirs: list[Path]) -> list[str]:
    """One line per run under `dirs`: the machine and settings it was measured with."""
    return [describe_run(run_dir, read_machine(run_dir)) for run_dir in find_runs(dirs)]


def describe_run(run_dir: Path, machine: dict) -> str:
    if not machine:
        return f"`{run_dir}`: machine not recorded (made before runs kept machine.json)"
    amx = {True: ", AMX", False: ", no AMX", None: ""}[machine["amx"]]
    return (f"`{run_dir}`: {machine['device']}{amx}, torch threads {machine['threads']}, "
            f"load {machine['load']:.1f} at start, profile {machine['profile']}, {machine['dtype']}, "
            f"torch {machine['torch']}, transformers {machine['transformers']}, "
            f"commit {machine['commit'] or 'none (not a git checkout)'}")


def paper_tables(long: pd.DataFrame) -> dict[str, dict[str, pd.DataFrame]]:
    """Per setting ("T=0.0, batch 1"), tables with rows = methods and columns = benchmarks in
    order of appearance: speedup and aal (plus their mean over benchmarks), and speedup_lo,
    speedup_hi and n_prompts (the spread)."""
    tables = {}
    for (temperature, batch_size), group in long.groupby(["temperature", "batch_size"]):
        pivots = {}
        for value in ("speedup", "aal", "speedup_lo", "speedup_hi", "n_prompts"):
            table = group.pivot(index="method", columns="bench", values=value)
            pivots[value] = table.reindex(index=group.method.unique(), columns=group.bench.unique())
        for value in ("speedup", "aal"):
            pivots[value] = pivots[value].assign(mean=pivots[value].mean(axis=1))
        tables[setting(temperature, batch_size)] = pivots
    return tables


def cells(speedup: pd.DataFrame, aal: pd.DataFrame, times: str) -> pd.DataFrame:
    """"2.31x / 3.45" per method and benchmark; "n/a" for a number the run could not give
    (e.g. no AR baseline on the same prompts), "-" where the method did not run."""
    def cell(s: float, a: float) -> str:
        if pd.isna(s) and pd.isna(a):
            return "-"
        return ("n/a" if pd.isna(s) else f"{s:.2f}{times}") + " / " + ("n/a" if pd.isna(a) else f"{a:.2f}")

    return pd.DataFrame({c: [cell(s, a) for s, a in zip(speedup[c], aal[c])] for c in speedup.columns},
                        index=speedup.index)


SPREAD = (f"Speedup's 95% interval (bootstrap over batches) and prompts; under {MIN_PROMPTS} prompts a speedup "
          "is unreliable.")


def spread_cells(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """"[1.80, 2.20], n=8" per method and benchmark (paper_tables' speedup_lo, speedup_hi and
    n_prompts); "n/a" for an interval one batch cannot give, "-" where the method did not run."""
    def cell(low: float, high: float, n: float) -> str:
        if pd.isna(n):
            return "-"
        interval = "n/a" if pd.isna(low) else f"[{low:.2f}, {high:.2f}]"
        return f"{interval}, n={int(n)}" + (" (too few)" if n < MIN_PROMPTS else "")

    low, high, n = tables["speedup_lo"], tables["speedup_hi"], tables["n_prompts"]
    return pd.DataFrame({c: [cell(*v) for v in zip(low[c], high[c], n[c])] for c in n.columns}, index=n.index)


def markdown(tables: dict[str, dict[str, pd.DataFrame]], runs: Sequence[str] = ()) -> str:
    """The tables of every setting, each followed by its spread; `runs` (run_lines) first."""
    def rows(table: pd.DataFrame) -> list[str]:
        return ["| method | " + " | ".join(table.columns) + " |", "|---" * (len(table.columns) + 1) + "|",
                *(f"| {method} | " + " | ".join(row) + " |" for method, row in table.iterrows())]

    parts = ["Runs:\n" + "\n".join(f"- {line}" for line in runs)] if runs else []
    parts.append("Speedup over AR / AAL (tokens per decode step, bonus included), per benchmark and their mean.")
    for label, pivots in tables.items():
        parts.append("\n".join([f"### {label}", "", *rows(cells(pivots["speedup"], pivots["aal"], "x")), "", SPREAD, "",
                                *rows(spread_cells(pivots))]))
    return "\n\n".join(parts) + "\n"


def latex(tables: dict[str, dict[str, pd.DataFrame]]) -> str:
    """Per setting one plain tabular, its label in the first row, and one of its spread."""
    parts = ["% Speedup over AR / AAL, per benchmark and their mean, then its spread (bastion.bench.report)"]
    for label, pivots in tables.items():
        parts.append(tabular(label, cells(pivots["speedup"], pivots["aal"], r"$\times$")))
        parts.append(tabular(rf"{label}: speedup 95\% interval, prompts", spread_cells(pivots)))
    return "\n\n".join(parts) + "\n"


def tabular(label: str, table: pd.DataFrame) -> str:
    """A plain tabular of `table`'s cells, `label` in its first row."""
    def tex(name: str) -> str:
        return re.sub(r"([_%&#$])", r"\\\1", name)

    width = len(table.columns) + 1
    rows = [" & ".join([tex(method), *row]) + r" \\" for method, row in table.iterrows()]
    return "\n".join([r"\begin{tabular}{l" + "r" * (width - 1) + "}", r"\hline",
                      rf"\multicolumn{{{width}}}{{l}}{{{label}}} \\",
                      " & ".join(["method", *map(tex, table.columns)]) + r" \\", r"\hline",
                      *rows, r"\hline", r"\end{tabular}"])


def new_figure(panels: int = 1) -> tuple[Figure, list]:
    figure = Figure(figsize=(5.5 * panels, 4), layout="constrained")
    return figure, list(figure.subplots(1, panels, squeeze=False)[0])


def draw_bars(ax, table: pd.DataFrame, x: str, y: str) -> None:
    """Bars of `y` per value of `x`, the methods side by side."""
    wide = table.pivot(index=x, columns="method", values=y)
    width = 0.8 / wide.shape[1]
    for i, method in enumerate(wide.columns):
        ax.bar(np.arange(len(wide)) + (i - (wide.shape[1] - 1) / 2) * width, wide[method], width, label=method)
    ax.set_xticks(np.arange(len(wide)), [str(v) for v in wide.index], rotation=90 if len(wide) > 12 else 0)


def draw_lines(ax, table: pd.DataFrame, x: str, y: str) -> None:
    for method, group in table.groupby("method", sort=False):
        ax.plot(group[x], group[y], marker="o", label=method)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def draw_scatter(ax, table: pd.DataFrame, x: str, y: str) -> None:
    """Points per method and the diagonal y = x, where a perfect forecast would lie."""
    for method, group in table.groupby("method", sort=False):
        ax.scatter(group[x], group[y], s=8, alpha=0.5, label=method)
    low, high = min(table[x].min(), table[y].min()), max(table[x].max(), table[y].max())
    ax.plot([low, high], [low, high], color="grey", linewidth=0.8, linestyle="--")


def plot(draw, table: pd.DataFrame, x: str, y: str, title: str, xlabel: str, ylabel: str, log2x=False) -> Figure | None:
    """One panel drawn by `draw`; None when there is nothing to draw."""
    if table.empty:
        return None
    figure, (ax,) = new_figure()
    draw(ax, table, x, y)
    if log2x:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())  # 8, not 2^3
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.legend(fontsize="small")
    return figure


def speedup_per_bench(long: pd.DataFrame) -> Figure | None:
    """Grouped bars per benchmark, one panel per setting; the dashed line is AR."""
    settings = list(long[long.method != BASELINE].groupby(["temperature", "batch_size"]))
    if not settings:
        return None
    figure, axes = new_figure(len(settings))
    for ax, ((temperature, batch_size), group) in zip(axes, settings):
        draw_bars(ax, group, "bench", "speedup")
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set(title=setting(temperature, batch_size), ylabel="speedup over AR")
        ax.legend(fontsize="small")
    return figure


def speedup_vs_batch(long: pd.DataFrame) -> Figure | None:
    """Mean speedup over benchmarks per batch size, one line per method (and temperature)."""
    drafted = long[long.method != BASELINE]
    table = drafted.groupby(["method", "temperature", "batch_size"], sort=False).speedup.mean().reset_index()
    if table.temperature.nunique() > 1:
        table["method"] = table.method + ", T=" + table.temperature.astype(str)
    return plot(draw_lines, table.sort_values("batch_size", kind="stable"), "batch_size", "speedup",
                "Speedup vs batch size", "batch size", "mean speedup over AR (its benchmarks)", log2x=True)


def figures(long: pd.DataFrame, steps: pd.DataFrame) -> dict[str, Figure]:
    """Every figure the data supports, by name (the PNG's stem)."""
    drafting = steps[steps.method != BASELINE]
    drafted = steps[steps.tree_size > 0].assign(accepted=lambda s: s.produced - 1)
    forecast = steps.dropna(subset=["predicted_verify_s"]).assign(
        predicted_ms=lambda s: 1000 * s.predicted_verify_s, measured_ms=lambda s: 1000 * s.verify_s)
    made = {
        "speedup_per_bench": speedup_per_bench(long),
        "speedup_vs_batch": speedup_vs_batch(long) if long.batch_size.nunique() > 1 else None,
        "aal_vs_tree_size": plot(draw_lines, aal_by_tree_size(steps), "tree_size", "aal", "Acceptance vs tree size",
                                 "draft tree size (nodes, mean of a power-of-two bin)", "tokens per step (AAL)",
                                 log2x=True),
        "chosen_budget_hist": plot(draw_bars, tree_size_distribution(drafting[drafting.method.str.contains("bastion")]),
                                   "tree_size", "fraction", "Budgets chosen", "tree size (nodes)", "fraction of steps"),
        "accepted_length_hist": plot(draw_bars, accepted_length_histogram(drafting), "produced", "fraction",
                                     "Tokens per step", "tokens per step (bonus included)", "fraction of steps"),
        "depth_acceptance": plot(draw_lines, depth_acceptance_rate(steps), "depth", "rate", "Acceptance by depth",
                                 "depth d", "P(accepted >= d | tree >= d nodes)"),
        "verify_time": plot(draw_scatter, forecast, "predicted_ms", "measured_ms", "Verify time: forecast vs measured",
                            "predicted verify time (ms)", "measured verify time (ms)"),
        "ahat_vs_accepted": plot(draw_scatter, drafted, "expected", "accepted", "A_hat vs accepted draft tokens",
                                 "A_hat (expected accepted)", "accepted draft tokens"),
    }
    return {name: figure for name, figure in made.items() if figure is not None}


def write_report(dirs: list[Path], out: Path | None = None) -> list[Path]:
    """Write report.md, report.tex, report.csv and plots/*.png into `out` (default: the first
    dir); returns their paths, report.md first."""
    long, steps = load(dirs)
    out = Path(out or dirs[0])
    (out / "plots").mkdir(parents=True, exist_ok=True)
    tables = paper_tables(long)
    written = [out / "report.md", out / "report.tex", out / "report.csv"]
    written[0].write_text(markdown(tables, run_lines(dirs)))
    written[1].write_text(latex(tables))
    long.to_csv(written[2], index=False)
    for name, figure in figures(long, steps).items():
        written.append(out / "plots" / f"{name}.png")
        figure.savefig(written[-1], dpi=120)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bastion.bench.report", description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="Hydra run or multirun dirs")
    parser.add_argument("--out", type=Path, help="where report.* and plots/ go (default: the first dir)")
    args = parser.parse_args(argv)
    try:
        written = write_report(args.dirs, args.out)
    except FileNotFoundError as error:
        parser.error(str(error))
    print(written[0].read_text(), end="")


if __name__ == "__main__":
    main()
