"""Fixed budget: verify the same number of draft nodes every step."""

from __future__ import annotations

from bastion.tree.draft_tree import DraftTree


class FixedBudget:
    """Every row's tree gets `nodes` draft nodes (fewer when the drafter offers fewer)."""

    def __init__(self, nodes: int):
        if nodes < 1:
            raise ValueError(f"budget.nodes must be at least 1 draft node per step (got {nodes}); use drafter=none for plain AR decoding.")
        self.max_nodes = nodes

    def size(self, trees: list[DraftTree]) -> list[DraftTree]:
        return trees

    def observe(self, n_tokens: int, seconds: float) -> None:
        """Measured verify latency; a fixed budget ignores it."""
