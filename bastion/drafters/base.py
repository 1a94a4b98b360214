"""What every drafter gives the engine, and what the engine gives it back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from bastion.models.int8_linear import int8_linear, quantize_weight
from bastion.models.packed_linear import PackedLinear, linear, pack_weight
from bastion.tree.draft_tree import DraftTree
from bastion.tree.proposal import BlockProposal, TreeProposal


@dataclass
class DraftContext:
    """What a drafter sees each step."""

    sequences: list[list[int]]  # per row: prompt + generated; the last token (the root) is not yet in the target cache
    features: torch.Tensor | None  # [B, T, F] target features of the tokens committed since the last call, right-padded
    n_features: list[int]  # [B] valid T per row
    cache: object = None  # the target's KVCache (drafters that run the target itself draft against it)
    max_depth: int | None = None  # the deepest tree the budget can use this step (a drafter that grows trees stops there)


class Drafter:
    """What the engine asks of a drafter, with the defaults of one that only proposes blocks
    from the context it is given (n-gram lookup, a test drafter): a new drafter overrides
    `propose` and whatever state or forward it keeps."""

    feature_layers: tuple[int, ...] = ()  # target layers whose outputs the drafter conditions on
    proposes_trees: bool = False  # a TreeProposal (ranked children per node), not per-position candidates
    drafts_inside_verification: bool = False  # can draft in the verification forward itself (budget.mode=parallel)
    draft_tokens: int = 0  # tokens per row of the target-sized forward a draft runs (FlexDraft's group; 0: a small drafter)

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
        that a draft forward after it runs; (0, 0) where not drafts_inside_verification."""
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


class DraftVocabulary:
    """An optional draft vocabulary for drafters that score drafts with the target's own LM
    head (DFlash, FlexDraft; EAGLE-3's trick): drafts come from these target tokens only, so
    the head reads a fraction of its rows, and whatever the drafter adds per token (FlexDraft's
    calibration bias) is that much smaller. The drafter registers a `draft_vocab` buffer ([V']
    token ids, or None for the whole vocabulary) and holds `target`."""

    _head: torch.Tensor | None = None  # the LM head rows of the draft vocabulary, gathered once
    _score: Callable[[torch.Tensor], torch.Tensor] | None = None  # hidden -> logits by them (_head_kernel)
    int8_head: bool = False  # score drafts by an int8 copy of those rows (models/int8_linear.py; decoding only)

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        self.draft_vocab = token_ids.to(self.draft_vocab.device if self.draft_vocab is not None else token_ids.device)
        self._head = None

    def head_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The LM head rows drafts are scored over, all of them or the draft vocabulary's, in
        `dtype` (the target's by default; a drafter in another dtype scores in its own)."""
        weight = self.target.model.lm_head.weight
        dtype = dtype or weight.dtype
        if self.draft_vocab is None and dtype == weight.dtype and not self.int8_head:
            return weight
        if self._head is None or self._head.device != weight.device or self._head.dtype != dtype:
            rows = weight if self.draft_vocab is None else weight[self.draft_vocab]
            self._head = rows.detach().to(dtype, copy=True)
            self._score = self._head_kernel()
        return self._head

    def _head_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """_head as a linear layer: int8 (int8_head), packed for oneDNN where the target's head is, else plain."""
        if self.int8_head:
            int8, scales = quantize_weight(self._head)
            return partial(int8_linear, int8=int8, scales=scales)
        packed = pack_weight(self._head) if isinstance(self.target.model.lm_head, PackedLinear) else None
        return partial(linear, weight=self._head, packed=packed)

    def draft_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., h] -> logits over the draft vocabulary [..., V'] (the whole one without)."""
        weight = self.head_weight(hidden.dtype)
        if weight is self.target.model.lm_head.weight:  # the target's own head, as it is packed
            return self.target.model.lm_head(hidden)
        return self._score(hidden)

    def in_full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., V'] -> [..., V], -inf outside it (float32 at least)."""
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if self.draft_vocab is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.target.args.vocab_size), -torch.inf)
        return full.index_copy_(-1, self.draft_vocab, logits)

    def to_draft_ids(self) -> torch.Tensor | None:
        """[V] target id -> draft id (-1 outside the draft vocabulary), on the draft vocabulary's
        device (what training's labels are mapped on); None without one."""
        if self.draft_vocab is None:
            return None
        return draft_ids(self.draft_vocab, self.target.args.vocab_size).to(self.draft_vocab.device)


def draft_ids(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A draft vocabulary's target token ids [V'] -> the map [V] from target id to draft id
    (-1 outside it), on the host: what training turns its labels into."""
    to_draft = torch.full((vocab_size,), -1, dtype=torch.long)
    to_draft[token_ids.cpu()] = torch.arange(len(token_ids))
    return to_draft
