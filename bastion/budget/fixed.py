"""Fixed budget: verify the same number of draft nodes every step."""

from __future__ import annotations

from bastion.tree.draft_tree import DraftTree


class FixedBudget:
    """Every row's tree gets `nodes` draft nodes (fewer when the drafter offers fewer)."""

    predicted_s = None  # a fixed budget predicts no latency

    def __init__(self, nodes: int):
        if nodes < 1:
            raise ValueError(f"budget.nodes must be at least 1 draft node per step (got {nodes}); use drafter=none for plain AR decoding.")
        self.max_nodes = nodes

    def start(self, target, hardware, cache_dir) -> None:
        """Nothing to calibrate."""

    def drafts(self) -> bool:
        """Every step drafts."""
        return True

    def size(self, trees: list[DraftTree], contexts: list[int]) -> list[DraftTree]:
        return trees

    def observe(self, step, contexts: list[int], width: int) -> None:
        """Measured step times; a fixed budget ignores them."""
