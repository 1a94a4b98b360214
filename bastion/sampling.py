"""Sampling settings shared by AR decoding and speculative verification.

At temperature > 0 "lossless" means the output distribution equals that of AR sampling, so
both draw from exactly the same processed distribution: logits / temperature, then top-k,
then top-p. Temperature 0 is greedy decoding.

Sampling is keyed, not streamed: the token at output position t of a row is
argmax(log p + g), with Gumbel noise g fixed by (seed, the row's key, t) alone (Gumbel-max).
Every method then draws exactly AR's token wherever its context equals AR's, so with ranked
children a verifier accepts a draft iff it is that token: the output equals AR's for the same
seed whatever the tree, its size or the machine's timings, and `lossless` at T > 0 is token
equality again. Acceptance is what rejection sampling over ranked children gives (a set of
children holds the sample with probability p(set) either way).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

TREE_MODES = ("sampled", "ranked")


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    # How a tree's children relate to the draft distribution q when temperature > 0:
    #   ranked:  children are the policy's top-ranked tokens; accept x iff it is the keyed
    #            Gumbel-max sample (module docstring): outputs equal AR's for the same seed
    #   sampled: children drawn from q without replacement; accept x w.p. min(1, p(x)/q(x))
    #            (SpecInfer, Sequoia): lossless in distribution only, from a seeded stream
    tree_mode: str = "ranked"

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"Sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1 "
                f"(got temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p})."
            )
        if self.tree_mode not in TREE_MODES:
            raise ValueError(f"decode.tree_mode must be one of {', '.join(TREE_MODES)} (got {self.tree_mode}).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits -> the distribution tokens are drawn from (at least fp32)."""
        scores = logits.to(torch.promote_types(logits.dtype, torch.float32)) / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, -torch.inf)
        probs = torch.softmax(scores, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p  # keep the smallest set reaching top_p
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    @property
    def keyed(self) -> bool:
        """Tokens are keyed Gumbel-max samples (greedy is the noiseless case)."""
        return self.greedy or self.tree_mode == "ranked"

    def noise(self, seed: int, keys: torch.Tensor, start: torch.Tensor, levels: int, vocab: int) -> torch.Tensor | None:
        """The keyed Gumbel noise [B, levels, V] (float64) of rows keyed `keys` [B] at output
        positions start[b] + 0 .. levels - 1: a tree's nodes at one depth share a position, so
        it is drawn once per step and depth, not per node nor per chunk of nodes, for more
        levels than any node's depth (known on the host: reading depths would wait for the
        device). None at temperature 0."""
        if self.greedy:
            return None
        return gumbel(seed, keys, start[:, None] + torch.arange(levels, device=start.device), vocab)

    def scores(self, logits: torch.Tensor, noise: torch.Tensor | None, depths: torch.Tensor) -> torch.Tensor:
        """logits [B, M, V] of tree nodes at `depths` [B, M] -> scores whose argmax is the keyed
        sample: the logits themselves at temperature 0 (no noise), else log p + the noise of
        each node's depth (float64, so the noise's tail survives the sum)."""
        if noise is None:
            return logits
        return self.probs(logits).double().log() + noise.gather(1, depths[:, :, None].expand(-1, -1, logits.shape[-1]))


GREEDY = Sampling()

_MASK32 = 0xFFFFFFFF
NOISE_CELLS = 1 << 18  # (row, position, token) words a CPU hashes at once (1 MB; at least one position's)


def _word(value: int) -> int:
    """A 32-bit word as the int32 that holds its bits."""
    value &= _MASK32
    return value - (1 << 32) if value >> 31 else value


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int32 words."""
    return (x >> s) & ((1 << (32 - s)) - 1)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (C. Wellons' lowbias32) on int32 words: their
    products wrap mod 2^32 to the unsigned products' bits, at a quarter of the int64
    emulation's work."""
    x = x ^ _shr(x, 16)
    x = x * _word(0x7FEB352D)
    x = x ^ _shr(x, 15)
    x = x * _word(0x846CA68B)
    return x ^ _shr(x, 16)


@cache
def _seed_word(seed: int) -> int:
    """The seed hashed to a 32-bit word, a host int (nothing to copy to a device), once per seed."""
    return int(_hash32(_hash32(torch.tensor(_word(seed), dtype=torch.int32)) ^ _word(seed >> 32)))


def gumbel(seed: int, keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [B, M, V] (float64) that depends only on (seed, keys[b],
    positions[b, m], token): a counter-based generator, so any tree visiting a position draws
    the same noise as AR did, on any device, in any order. On a CPU it is made a few positions
    at a time (NOISE_CELLS): the many passes over a block that outgrows the caches cost far more
    (experiments/NOTES.md)."""
    keys, positions = ((t.to(torch.int64) & _MASK32).to(torch.int32) for t in (keys, positions))
    row = _hash32(_hash32(keys) ^ _seed_word(seed))  # [B]; seed and key hashed apart, so (seed, key) pairs never swap
    cell = _hash32(row[:, None] ^ _hash32(positions))  # [B, M]
    salt = _hash32(cell ^ _word(0x5BD1E995))  # a second, independent word per cell
    token = torch.arange(vocab, device=positions.device, dtype=torch.int32)
    step = cell.shape[1] if cell.device.type != "cpu" else max(1, NOISE_CELLS // max(1, cell.shape[0] * vocab))
    return torch.cat([_noise(cell[:, m : m + step], salt[:, m : m + step], token) for m in range(0, cell.shape[1], step)], 1)


def _noise(cell: torch.Tensor, salt: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Gumbel noise [B, m, V] of the cells [B, m] (words) and their salts."""
    bits = _hash32(_hash32(cell[..., None] ^ token) ^ salt[..., None])  # [B, m, V]
    uniform = (bits.double() + 0.5) / 2**32 + (bits < 0)  # read unsigned: a negative word is 2^32 more
    return -torch.log(-torch.log(uniform))
