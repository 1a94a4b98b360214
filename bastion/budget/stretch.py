"""Turning drafting off while it does not pay (every budget's `pause_drafting`, base.py).

A drafter that loses to AR on some prompts (out of domain, or a machine whose multi-token
forwards are expensive) should cost almost nothing there. After a step that says drafting
does not pay, the next steps are plain AR steps; then drafting is tried once more, and each
retry that fails again doubles the stretch (8, 16, ... 256 steps), so a drafter that never
pays costs a vanishing share of steps, and one that starts paying is back within a stretch.

A retry is a drafted step, and where those are dear (a batch of 16 rows on a CPU: several AR
steps each) eight AR steps and a retry would lose a third of the stretch to the retry. So a
stretch is also at least long enough that its retry, costing `retry_cost` AR steps (the quickest
recent drafted step's, or the forecast before one ran), wastes at most `waste` (5%) of the
stretch: (retry_cost - 1) / waste.
"""

from __future__ import annotations

import math


class ARStretch:
    def __init__(self, first: int = 8, longest: int = 256, waste: float = 0.05):
        self.first, self.longest, self.waste = first, longest, waste
        self.left = 0  # AR steps left in the current stretch
        self.next = first  # the length of the next stretch, before the retry-cost floor

    def skip(self) -> bool:
        """Count one step of a stretch: True while this step should be an AR step. The last
        step of a stretch is a retry (drafts, and is measured)."""
        if not self.left:
            return False
        self.left -= 1
        return self.left > 0

    def failed(self, retry_cost: float = 1.0) -> None:
        """Drafting did not pay: start a stretch whose retry costs `retry_cost` AR steps; the
        next stretch is twice as long."""
        floor = math.ceil((retry_cost - 1) / self.waste - 1e-9)
        self.left = min(max(self.next, floor), self.longest)
        self.next = min(2 * self.left, self.longest)

    def measure_ar(self) -> None:
        """One AR step, then draft again: the price of an AR step is measured, not forecast,
        before a verdict rests on it."""
        self.left = 2  # skip(): an AR step, then the retry

    def paid(self) -> None:
        self.next = self.first
