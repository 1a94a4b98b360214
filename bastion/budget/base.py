"""What every budget controller answers each step, with the defaults of a fixed budget: keep
every tree the policy built.

Two decisions are shared by every budget and made here, so that one place decides whether a
step drafts and how:
- pausing drafting (`pause_drafting`): while drafting does not pay, by forecast until the
  drafted steps are measured and then, as soon as each is measured, by their tokens per
  second against AR steps' (recent.py), the next steps are AR steps (stretch.py: 8 at
  first, doubling while retries fail);
- where a drafter that can also draft inside the verification forward (FlexDraft) drafts
  (`mode`): after it (sequential), inside it (parallel), or each step whichever the latency
  model predicts faster for the step's shapes (flex: the FlexDraft paper's flex decoding).
"""

from __future__ import annotations

from pathlib import Path
from statistics import median

import numpy as np

from bastion.budget.latency import LatencyModel, calibrated
from bastion.budget.recent import RecentSteps
from bastion.budget.stretch import ARStretch
from bastion.tree.draft_tree import DraftTree

MODES = ("sequential", "parallel", "flex")


class Budget:
    max_nodes: int = 256  # the most draft nodes a row's tree may have (the policy builds up to this)
    predicted_s: float | None = None  # the forecast verify time of the last sized step, where one is made

    def __init__(self, mode: str = "sequential", pause_drafting: bool = False, window: int = 8):
        if mode not in MODES:
            raise ValueError(f"budget.mode must be one of {', '.join(MODES)} (got {mode}).")
        self.mode, self.pause_drafting = mode, pause_drafting
        self.stretch = ARStretch()
        self.recent = RecentSteps(window)
        self.latency: LatencyModel | None = None
        self.draft_tokens = 0  # tokens per row of the target-sized forward a draft runs (start)

    def start(self, target, hardware, cache_dir: Path, draft_tokens: int = 0) -> None:
        """Before the first decode: calibrate the latency model on this machine where a
        decision needs it (flex mode; pause_drafting, to forecast a step before one ran).
        `draft_tokens`: tokens per row of the forward a draft runs through the target's own
        layers (FlexDraft's), which prices drafting before a drafted step is measured."""
        self.draft_tokens = draft_tokens
        if self.latency is None and (self.mode == "flex" or self.pause_drafting):
            self.latency = calibrated(target, hardware, cache_dir)

    def reset(self) -> None:
        """A new decode begins. An AR stretch runs on into it, and its retry is judged on the
        steps drafted since, whichever prompts they decode: the verdict was reached on this
        machine, batch size and drafter, which the next prompts share, and judging each
        prompt afresh cost it a drafted step (several AR steps at a large batch on a CPU)."""
        self.recent.reset()

    def drafts(self) -> bool:
        """Draft this step? False inside an AR stretch."""
        return not self.stretch.skip()

    def max_depth(self) -> int:
        """The deepest tree this budget can verify next step: a tree of n nodes is at most n
        deep (a drafter that grows its trees depth by depth, EAGLE-3, grows no deeper)."""
        return self.max_nodes

    def size(self, trees: list[DraftTree], contexts: list[int]) -> list[DraftTree]:
        """The trees to verify: the policy's `trees`, cut to this step's budget (`contexts`:
        each row's cached tokens)."""
        if self.forecast_judges:
            ar_s = self.ar_step_s(contexts)
            width = 1 + max(tree.n_nodes for tree in trees)
            cost = (self.draft_s(contexts) + float(self.predict(width, contexts)) + self.recent.other_s) / ar_s
            tokens = 1 + sum(tree.expected_accepted() for tree in trees) / len(trees)  # the drafter's belief
            self.judge_forecast(tokens / cost, self.retry_cost(cost, contexts))
        return trees

    def retry_cost(self, forecast: float, contexts: list[int]) -> float:
        """What a retry after an AR stretch costs, in AR steps (stretch.py): the quickest recent
        drafted step's, or before one ran the `forecast`."""
        return self.recent.quickest_s / self.ar_step_s(contexts) if self.recent.drafted else forecast

    def draft_s(self, contexts: list[int]) -> float:
        """A step's drafting time: the recent drafted steps' median; before any, the latency
        model's forward of `draft_tokens` per row (0 for a drafter that is not the target: it
        is small beside it): a draft that costs several AR steps (FlexDraft's at a large batch
        on a CPU) must not be measured EVIDENCE times over before drafting stops."""
        if self.recent.drafted or not self.draft_tokens:
            return self.recent.draft_s
        return float(self.predict(self.draft_tokens, contexts))

    def ar_step_s(self, contexts: list[int]) -> float:
        """An AR step's time: the recent AR steps' median, before any the latency model's."""
        if self.recent.ar_s:
            return median(self.recent.ar_s)
        return float(self.predict(1, contexts)) + self.recent.other_s

    @property
    def forecast_judges(self) -> bool:
        """Whether a forecast judges drafting now: with pause_drafting on, until measured steps
        judge, and never in a retry (which is measured)."""
        return self.pause_drafting and not self.recent.retrying and not self.recent.measured

    def judge_forecast(self, forecast: float | None, retry_cost: float) -> None:
        """Where a forecast judges: start an AR stretch when the `forecast` speedup (None: no
        forecast) says drafting does not pay; its retry will cost `retry_cost` AR steps. This
        step's draft is spent, so its trees are still verified."""
        if forecast is None or not self.forecast_judges:
            return
        if forecast < 1:
            self.stretch.failed(retry_cost=retry_cost)
            self.recent.restart(pending=True)
        else:
            self.stretch.paid()

    def judge_measured(self, contexts: list[int]) -> None:
        """With pause_drafting on, after a drafted step is measured: start an AR stretch at once
        when the recent drafted steps produced fewer tokens per second than AR steps, before
        the next step spends a draft. A retry's first steps stop drafting only where they
        would not pay even one standard error of tokens per step luckier: tokens per step
        vary several-fold, and one unlucky retry would double a stretch where drafting pays,
        while a drafter that never pays varies little and is still stopped by its first. Before
        any AR step is measured an AR step is priced by the probe, taken at another moment
        of a machine whose pace drifts and without a decode step's host work, so one AR step
        is measured before any verdict, either way: priced by the probe alone, a drafter that
        loses to AR can look as if it paid and draft every step (experiments/NOTES.md)."""
        ar_s = self.ar_step_s(contexts)
        realised = self.recent.speedup(ar_s)
        if realised is None:
            return
        if not self.recent.ar_s:  # an AR step's time is still the latency model's (a probe's pace): measure one
            self.stretch.measure_ar()
        elif realised >= 1:
            if self.recent.settled:
                self.stretch.paid()
        elif self.recent.settled or self.recent.speedup(ar_s, doubt=1.0) < 1:
            self.stretch.failed(retry_cost=self.recent.quickest_s / ar_s)
            self.recent.restart()

    def parallel(self, width: int, tokens, contexts: list[int]) -> bool:
        """Draft inside this step's verification forward (one forward of width + inside tokens
        per row) rather than after it (forwards of width and of apart tokens)? `tokens()` gives
        (inside, apart), (0, 0) for a drafter that cannot; asked only when the mode needs it,
        since it walks every tree. Drafting inside, the step's forecast (`predicted_s`, where the
        budget made one) becomes the wider forward's."""
        if self.mode == "sequential":
            return False
        inside, apart = tokens()
        if not inside or (self.mode == "parallel" and self.predicted_s is None):
            return inside > 0
        wider_s = float(self.predict(width + inside, contexts))  # the one forecast both questions need
        if self.mode == "flex" and wider_s >= float(self.predict(width, contexts) + self.predict(apart, contexts)):
            return False
        if self.predicted_s is not None:
            self.predicted_s = wider_s
        return True

    def predict(self, tokens, contexts: list[int]) -> np.ndarray:
        """The latency model's forecast of a forward of `tokens` (one count, or several
        [n]) per row after `contexts` cached tokens: seconds [n] (or one)."""
        if self.latency is None:
            raise ValueError(f"budget.mode={self.mode} and pause_drafting={self.pause_drafting} need a latency model: "
                             "build the budget through run.py (budget.start calibrates one).")
        ctx = np.asarray(contexts)[None, :]
        counts = np.atleast_1d(tokens)[:, None].repeat(ctx.shape[1], 1)
        seconds = self.latency.predict(counts, ctx.repeat(len(counts), 0))
        return seconds if np.ndim(tokens) else seconds[0]

    def observe(self, step, contexts: list[int], width: int) -> None:
        """A measured step (engine.Step, drafted or AR) that ran `width` tokens per row after
        `contexts` cached ones."""
        self.recent.observe(step)
        if self.pause_drafting and step.drafted:
            self.judge_measured(contexts)
