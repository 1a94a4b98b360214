"""What every drafter gives the engine, and what the engine gives it back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bastion.tree.draft_tree import DraftTree
from bastion.tree.proposal import BlockProposal, TreeProposal


@dataclass
class DraftContext:
    """What a drafter sees each step."""

    sequences: list[list[int]]  # per row: prompt + generated; the last token (the root) is not yet in the target cache
    features: torch.Tensor | None  # [B, T, F] target features of the tokens committed since the last call, right-padded
    n_features: list[int]  # [B] valid T per row
    cache: object = None  # the target's KVCache (drafters that run the target itself draft against it)


class Drafter:
    """What the engine asks of a drafter, with the defaults of one that only proposes blocks
    from the context it is given (n-gram lookup, a test drafter): a new drafter overrides
    `propose` and whatever state or forward it keeps."""

    feature_layers: tuple[int, ...] = ()  # target layers whose outputs the drafter conditions on
    proposes_trees: bool = False  # a TreeProposal (ranked children per node), not per-position candidates

    def reset(self, batch_size: int, capacity: int) -> None:
        """Forget all rows: a new batch of prompts starts; no row will exceed `capacity` tokens."""

    def keep_rows(self, rows: list[int]) -> None:
        """Finished rows leave the batch; keep `rows`, in that order."""

    def propose(self, ctx: DraftContext) -> BlockProposal | TreeProposal:
        """Draft the next block (or candidate tree) for every row."""
        raise NotImplementedError

    def absorb(self, ctx: DraftContext) -> None:
        """A step without drafting (the budget chose AR): take in the newly verified tokens of
        `ctx` so the next propose() sees the whole context."""

    def extra_tokens(self, max_nodes: int) -> int:
        """Cache slots a verification forward may use beyond the tree's (drafting inside it)."""
        return 0

    def parallel_tokens(self, trees: list[DraftTree]) -> tuple[int, int]:
        """Tokens per row that drafting inside this step's verification forward would add, and
        that a draft forward after it runs; (0, 0): this drafter drafts only after it."""
        return 0, 0

    def verify_forward(self, target, cache, trees: list[DraftTree], tokens: torch.Tensor, depths: torch.Tensor,
                       tree_mask: torch.Tensor, capture: tuple[int, ...], parallel: bool = False):
        """The forward that verifies this step's trees (tokens, depths [B, M], tree_mask
        [B, M, M]), drafting inside it too where `parallel` (the budget's choice, asked only of
        a drafter with parallel_tokens): the target's own, by default. Returns hidden states
        [B, M, h], the `capture` features and the tokens per row it ran."""
        hidden, features = target.forward(tokens, depths, tree_mask, cache, capture)
        return hidden, features, tokens.shape[1]

    def accept(self, paths: list[list[int]]) -> None:
        """The accepted paths (tree indices) of the step verify_forward ran."""
