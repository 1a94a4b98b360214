"""DraftTree: the candidate tokens one verification pass checks for one row."""

from __future__ import annotations

from dataclasses import InitVar, dataclass
from functools import cache, cached_property

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

BITS = 64  # ancestor bits per int64 word


@cache
def _bit_table(device) -> torch.Tensor:
    """[256] int64: the bits of each byte value as 8 bool bytes, lowest first (one int64 per
    byte value, so unpacking is one `index_select` of 8-byte words, not a copy of 8-byte rows)."""
    return (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device) & 1).bool().view(torch.int64)[:, 0]


def ancestor_masks(parents: torch.Tensor, depth: int | None = None) -> torch.Tensor:
    """parents [B, M] (-1: a root, or a padding slot) -> the masks [B, M, M] bool, True where j
    is i or an ancestor of i. Pointer doubling: after round r every node holds its ancestors
    up to 2^r - 1 levels up, so doubling_rounds(depth) rounds of whole-tensor ops build trees
    no deeper than `depth` (any tree: M - 1), with no per-node work and no look at the values
    on the host. The rounds merge ancestor sets packed 64 to an int64 word, 64x less data than
    bool rows (experiments/NOTES.md), a node's words fetched as one row of the batch's
    [B x M, W] table (`index_select`), and unpacked a byte at a time through a table
    (little-endian bytes, as on every CPU and GPU torch runs on)."""
    B, M = parents.shape
    device = parents.device
    slots = torch.arange(M, device=device)
    jump = torch.where(parents < 0, slots.expand(B, M), parents)  # [B, M]: 2^r levels up (a root stays put)
    words = _own_bits(M, device).repeat(B, 1)  # [B x M, W]: each node is its own ancestor
    row_start = torch.arange(0, B * M, M, device=device)[:, None]  # [B, 1]: a row's first node in the table
    for _ in range(doubling_rounds(M - 1 if depth is None else depth)):
        words |= words.index_select(0, (jump + row_start).view(-1))
        jump = jump.gather(1, jump)
    table_rows = words.view(torch.uint8).view(-1).int()  # int32 indices: half the memory of int64 ones, and faster
    return _bit_table(device).index_select(0, table_rows).view(torch.bool).view(B, M, -1)[:, :, :M]  # bytes [B, M, 8W] -> [B, M, M]


@cache
def _own_bits(M: int, device) -> torch.Tensor:
    """[M, W] int64: node i's own bit, bit i % 64 of word i // 64 (bit 63 is the sign bit: fine for |)."""
    slots = torch.arange(M, device=device)
    words = torch.zeros(M, -(-M // BITS), dtype=torch.long, device=device)
    words[slots, slots // BITS] = 1 << (slots % BITS)
    return words


def doubling_rounds(depth: int) -> int:
    """Pointer-doubling rounds that reach every ancestor in trees no deeper than `depth`
    (2^r - 1 >= depth): 5 for a 16-token block's trees, where ceil(log2 M) would be 9 at M=257."""
    return max(depth, 1).bit_length()


def pack(trees: list[DraftTree], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Stack trees of different sizes for one target forward.

    Returns tokens [B, M], depths [B, M], the tree mask [B, M, M], parents [B, M] (-1 at the
    roots), M = largest 1+N, and the deepest node's depth: it bounds the pointer-doubling
    rounds here and in acceptance, and best-first's trees are mostly far shallower than the
    block they grow from. The depths come from the trees (policies know them), not from
    doubling on the device. Padding slots are roots that see only themselves (so no attention
    row is empty) and nothing sees them. One copy to the device; the masks are built there.
    """
    width = max(len(t.tokens) for t in trees)
    rows = np.zeros((len(trees), 3, width), np.int64)  # tokens, parents, depths
    rows[:, 1] = -1
    for row, tree in zip(rows, trees):
        n = len(tree.tokens)
        row[0, :n], row[1, :n], row[2, :n] = tree.tokens, tree.parents, tree.depths
    depth = int(rows[:, 2].max())
    tokens, parents, depths = torch.from_numpy(rows).to(device, non_blocking=True).unbind(1)
    return tokens, depths, ancestor_masks(parents, depth), parents, depth
