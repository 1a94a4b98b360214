"""Turning drafting off while it does not pay, shared by BASTION's controller and flex mode.

A drafter that loses to AR on some prompts (out of domain, or a machine whose multi-token
forwards are expensive) should cost almost nothing there. After a step that says drafting
does not pay, the next steps are plain AR steps; then drafting is tried once more, and each
retry that fails again doubles the stretch (8, 16, ... 256 steps), so a drafter that never
pays costs a vanishing share of steps, and one that starts paying is back within a stretch.
"""

from __future__ import annotations


class ARStretch:
    def __init__(self, first: int = 8, longest: int = 256):
        self.first, self.longest = first, longest
        self.left = 0  # AR steps left in the current stretch
        self.next = first  # the length of the next stretch

    def skip(self) -> bool:
        """Count one step of a stretch: True while this step should be an AR step. The last
        step of a stretch is a retry (drafts, and is measured)."""
        if not self.left:
            return False
        self.left -= 1
        return self.left > 0

    def failed(self) -> None:
        """Drafting did not pay: start a stretch; the one after it is twice as long."""
        self.left, self.next = self.next, min(2 * self.next, self.longest)

    def paid(self) -> None:
        self.next = self.first
