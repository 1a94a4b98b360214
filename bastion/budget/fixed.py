"""Fixed budget: verify the same number of draft nodes every step."""

from __future__ import annotations

from bastion.budget.base import Budget


class FixedBudget(Budget):
    """Every row's tree gets `nodes` draft nodes (fewer when the drafter offers fewer)."""

    def __init__(self, nodes: int, mode: str = "sequential", pause_drafting: bool = False, window: int = 8):
        if nodes < 1:
            raise ValueError(f"budget.nodes must be at least 1 draft node per step (got {nodes}); use drafter=none for plain AR decoding.")
        super().__init__(mode, pause_drafting, window)
        self.max_nodes = nodes
