"""What the recent steps measured: the evidence on which drafting is turned off.

Drafted steps keep their draft and other seconds (medians of the last `window` price a step,
so one slow step does not move them), their tokens per row and their whole time; tokens per
step are noisier than times, so the throughput of drafting averages the last 4 windows. A
decode's first step is not kept as a drafted one: it also reads the whole prompt into the
drafter, and a mean seeded by it priced drafting far above its cost (experiments/NOTES.md).
A retry later in the decode is kept (its drafter read the stretch's tokens step by step).

After an AR stretch the steps drafted before it are stale evidence: a retry is judged on the
drafted steps measured since the stretch alone, or the window's old steps would outvote it
and stretches would only ever grow. Only the spread of tokens per step, which says how much
a few steps can be trusted rather than whether drafting pays, is taken from every kept step.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median, stdev


class RecentSteps:
    EVIDENCE = 4  # drafted steps measured before their throughput is trusted

    def __init__(self, window: int = 8):
        if window < 1:
            raise ValueError(f"budget.window must be at least 1 step (got {window}).")
        self.window = window
        self.drafted: deque[tuple[float, float, float, float]] = deque(maxlen=4 * window)  # (draft s, other s, tokens per row, step s)
        self.ar_s: deque[float] = deque(maxlen=window)
        self.first = False  # the next step is a decode's first
        self.retrying = False  # an AR stretch has run: only drafted steps since the last one count
        self.fresh = 0  # drafted steps kept since the last stretch

    def reset(self) -> None:
        """A new decode: its first step, if drafted, will not be kept."""
        self.first = True

    def restart(self, pending: bool = False) -> None:
        """An AR stretch starts: what was drafted before it no longer judges drafting. With
        `pending`, the drafted step that started it (stopped by a forecast before it ran) is
        measured after this, and kept unless it is the decode's first: it does not count either."""
        self.retrying, self.fresh = True, -1 if pending and not self.first else 0

    def observe(self, step) -> None:
        """Keep a measured step (engine.Step, drafted or AR)."""
        step_s = step.draft_s + step.verify_s + step.other_s
        first, self.first = self.first, False
        if not step.drafted:
            self.ar_s.append(step_s)
        elif not first:
            self.drafted.append((step.draft_s, step.other_s, sum(step.produced) / len(step.produced), step_s))
            self.fresh += 1

    def median(self, field: int) -> float:
        """Median of one field of the last `window` drafted steps (0 before any)."""
        last = self.last_window()
        return median(step[field] for step in last) if last else 0.0

    def last_window(self) -> list[tuple[float, float, float, float]]:
        """The last `window` drafted steps."""
        return list(self.drafted)[-self.window:]

    @property
    def draft_s(self) -> float:
        return self.median(0)

    @property
    def other_s(self) -> float:
        return self.median(1)

    @property
    def quickest_s(self) -> float:
        """The quickest of the last `window` drafted steps: what a drafted step costs when
        nothing else slows the machine (other work only ever adds time), the price of a retry
        that an AR stretch is sized by. A median there let a burst of load that slowed half a
        window's steps set stretches several times too long."""
        return min(step[3] for step in self.last_window())

    def counted(self) -> int:
        """The kept drafted steps that judge drafting: while retrying, those since the last stretch."""
        return min(self.fresh, len(self.drafted)) if self.retrying else len(self.drafted)

    @property
    def measured(self) -> bool:
        """Whether measured steps judge drafting: EVIDENCE of them, or while retrying one (a
        retry that clearly fails is stopped after one measured step, while one that may pay
        drafts on: a judgement that it pays needs EVIDENCE, base.judge_measured)."""
        return self.counted() >= (1 if self.retrying else self.EVIDENCE)

    @property
    def settled(self) -> bool:
        """Whether EVIDENCE counted drafted steps judge drafting (a retry's first ones do not yet)."""
        return self.counted() >= self.EVIDENCE

    def speedup(self, ar_s: float, doubt: float = 0.0) -> float | None:
        """Tokens per row per second of the counted drafted steps over AR steps' (one token per
        row in `ar_s`); None until measured. `doubt` standard errors are added to their mean
        tokens, the spread of tokens per step taken from every kept drafted step: a bound on
        what a retry's few steps could have shown."""
        if not self.measured:
            return None
        last = list(self.drafted)[-self.counted():]
        tokens = sum(t for _, _, t, _ in last) / len(last)
        if doubt and len(self.drafted) > 1:
            tokens += doubt * stdev(t for _, _, t, _ in self.drafted) / math.sqrt(len(last))
        return tokens / median(s for *_, s in last[-self.window:]) * ar_s
