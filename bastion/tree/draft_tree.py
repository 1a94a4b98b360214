"""DraftTree: the candidate tokens one verification pass checks for one row."""

from __future__ import annotations

from dataclasses import InitVar, dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class DraftTree:
    """Draft tokens hanging below a root, the last verified token (its KV is not cached yet).

    Index 0 is the root; nodes 1..N follow parents first, as a policy lists them: in the order
    it values them, so every prefix `truncate(n)` is itself a prefix-closed tree, its best of n
    nodes. That is what lets a budget controller size a tree after it was built (children
    sampled after sizing, T > 0, are listed in their parents' order instead).

    The fields are numpy arrays (sequences are taken too): best-first builds a batch's trees
    as rows of arrays and `pack` stacks them again, so a tree of hundreds of nodes is a view,
    never a conversion to and from Python numbers.
    """

    tokens: np.ndarray  # [1+N] int64; tokens[0] is the root token
    parents: np.ndarray  # [1+N] int64; parents[0] = -1 and parents[i] < i
    logq: np.ndarray  # [1+N] float64; draft log-probability of the path root -> i (root: 0)
    checked: InitVar[bool] = True  # False: the caller built it from arrays, parents first (a policy's picks, a prefix), so the O(N) check is skipped
    known_depths: InitVar[np.ndarray | None] = None  # [1+N] the nodes' depths, where the builder knows them (else `depths` walks the parents)
    known_mass: InitVar[np.ndarray | None] = None  # [1+N] `mass`, where the builder has it (best-first makes a batch's in one
    # op; else `mass` sums the path probabilities): A_hat of the tree and of any prefix is then one read

    @staticmethod
    def root_only(token: int) -> DraftTree:
        return DraftTree(np.array([token]), ROOT_PARENTS, ROOT_LOGQ, checked=False, known_depths=ROOT_DEPTHS)

    def __post_init__(self, checked: bool, known_depths: np.ndarray | None, known_mass: np.ndarray | None):
        if known_depths is not None:
            self.__dict__["depths"] = np.asarray(known_depths, np.int64)  # the cached property's value, given
        if known_mass is not None:
            self.__dict__["mass"] = known_mass  # the cached property's value, given
        if not checked:
            return
        for name, dtype in (("tokens", np.int64), ("parents", np.int64), ("logq", np.float64)):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype))
        if not (len(self.tokens) == len(self.parents) == len(self.logq)) or self.parents[0] != -1:
            raise ValueError("DraftTree needs equal-length tokens/parents/logq with the root at index 0")
        below = self.parents[1:]
        if not ((below >= 0) & (below < np.arange(1, len(self.parents)))).all():
            raise ValueError("DraftTree parents must precede their children")
        depths = self.__dict__.get("depths")  # given: pack trusts them for positions and masks' rounds
        if depths is not None and (len(depths) != len(self.parents) or depths[0] != 0 or (depths[1:] != depths[below] + 1).any()):
            raise ValueError("DraftTree depths must be each parent's depth + 1, the root's 0")

    @property
    def n_nodes(self) -> int:
        """Draft nodes, root excluded."""
        return len(self.tokens) - 1

    @cached_property
    def depths(self) -> np.ndarray:
        """[1+N] int64: each node's depth below the root (the root's 0)."""
        depths = [0]
        for p in self.parents[1:].tolist():
            depths.append(depths[p] + 1)
        return np.array(depths, np.int64)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[i]: the nodes whose parent is i, in tree order."""
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:].tolist(), start=1):
            kids[p].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def mass(self) -> np.ndarray:
        """[1+N] float64: the running sums of the draft nodes' path probabilities (0 at the root)."""
        return np.concatenate([[0.0], np.cumsum(np.exp(self.logq[1:]))])

    def expected_accepted(self) -> float:
        """A_hat: the sum of the nodes' path probabilities, BASTION's surrogate for the number of
        draft tokens a verification accepts."""
        return float(self.mass[-1])

    def truncate(self, n_nodes: int) -> DraftTree:
        if n_nodes >= self.n_nodes:
            return self
        k = n_nodes + 1
        depths, mass = self.__dict__.get("depths"), self.__dict__.get("mass")
        return DraftTree(self.tokens[:k], self.parents[:k], self.logq[:k], checked=False,
                         known_depths=None if depths is None else depths[:k], known_mass=None if mass is None else mass[:k])

    def path(self, node: int) -> list[int]:
        """Indices from the root to `node`, both included."""
        path = [node]
        while node:
            node = int(self.parents[node])
            path.append(node)
        return path[::-1]


ROOT_PARENTS, ROOT_LOGQ, ROOT_DEPTHS = np.array([-1]), np.array([0.0]), np.array([0])  # every root-only tree's, so read-only
ROOT_PARENTS.flags.writeable = ROOT_LOGQ.flags.writeable = ROOT_DEPTHS.flags.writeable = False
ROOT_ROWS = np.array([[[0]], [[-1]], [[0]]])  # a padding slot's token, parent and depth in pack's rows: a root

class Packed(NamedTuple):
    """A batch's trees as one target forward and its verification read them: M = the largest
    1 + N, padding slots are roots that see only themselves (so no attention row is empty) and
    that nothing sees."""

    tokens: torch.Tensor  # [B, M]
    depths: torch.Tensor  # [B, M]: each node's depth below its root
    mask: torch.Tensor  # [B, M, M] bool: True where j is i or an ancestor of i
    parents: torch.Tensor  # [B, M]: -1 at the roots
    ancestors: torch.Tensor  # [D + 1, B, M]: node i's ancestor l levels up at [l, :, i] (i itself at l = 0; the root past its depth)

    @property
    def depth(self) -> int:
        """D, the deepest node's depth: best-first's trees are mostly far shallower than the
        block they grow from, and it bounds the levels verification walks."""
        return self.ancestors.shape[0] - 1


def pack(trees: list[DraftTree], device) -> Packed:
    """Stack trees of different sizes for one target forward: one copy to the device, where
    the masks are one fill of the ancestors' places.

    Each node's ancestors, level by level, are found on the host, D takes of [B x M] numbers
    from the trees' depths (policies know them): numpy's ops on small arrays cost a fraction of
    torch's on a CPU, and on a GPU each would be a launch, so the device gets the ancestors
    with the trees' other rows instead of finding them itself (pointer doubling and bit words
    before, experiments/NOTES.md). Verification reads them too: a path matched where each of
    its nodes did."""
    width, depth = max(len(t.tokens) for t in trees), max(t.depths.max() for t in trees)
    rows = np.empty((4 + depth, len(trees), width), np.int64)  # tokens, parents, depths, then the ancestors 0..D levels up
    rows[:3] = ROOT_ROWS  # padding slots: roots
    for b, tree in enumerate(trees):
        n = len(tree.tokens)
        rows[0, b, :n], rows[1, b, :n], rows[2, b, :n] = tree.tokens, tree.parents, tree.depths
    slots = np.arange(width)
    offsets = np.arange(0, len(trees) * width, width)[:, None]  # [B, 1]: a row's first flat slot
    up = (np.where(rows[1] < 0, slots, rows[1]) + offsets).ravel()  # [B x M]: each node's parent, flat (a root its own)
    rows[3] = node = slots
    for level in range(4, 4 + depth):
        node = up.take(node + offsets)
        rows[level] = node = node - offsets
    tensor = torch.from_numpy(rows).to(device, non_blocking=True)  # every field contiguous: a compiled forward sees one layout
    tokens, parents, depths, ancestors = tensor[0], tensor[1], tensor[2], tensor[3:]
    B, M = tokens.shape
    rows_start = torch.arange(0, B * M * M, M, device=device).view(B, M)  # where each node's row of the [B, M, M] mask starts
    where = (ancestors + rows_start).view(-1)  # [(D + 1) x B x M]: mask[b, i, ancestor] as flat indices
    mask = torch.zeros(B * M * M, dtype=torch.bool, device=device).index_fill_(0, where, True).view(B, M, M)
    return Packed(tokens, depths, mask, parents, ancestors)
