"""What every budget controller answers each step, with the defaults of a budget that
drafts every step and keeps every tree the policy built."""

from __future__ import annotations

from pathlib import Path

from bastion.tree.draft_tree import DraftTree


class Budget:
    max_nodes: int = 256  # the most draft nodes a row's tree may have (the policy builds up to this)
    predicted_s: float | None = None  # the forecast verify time of the last sized step, where one is made

    def start(self, target, hardware, cache_dir: Path) -> None:
        """Before the first decode: calibrate on this machine (nothing by default)."""

    def reset(self) -> None:
        """A new decode begins (what was learned of the machine and the drafter carries over)."""

    def drafts(self) -> bool:
        """Draft this step, or take a plain AR step?"""
        return True

    def size(self, trees: list[DraftTree], contexts: list[int]) -> list[DraftTree]:
        """The trees to verify: the policy's `trees`, cut to this step's budget (`contexts`:
        each row's cached tokens)."""
        return trees

    def observe(self, step, contexts: list[int], width: int) -> None:
        """A measured step (engine.Step, drafted or AR) that ran `width` tokens
        per row after `contexts` cached ones."""
