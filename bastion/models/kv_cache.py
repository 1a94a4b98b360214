"""A KV cache whose rows hold different numbers of verified tokens.

Speculative decoding accepts a different number of tokens per row each step, so every row has
its own length. A forward writes its N tokens (a draft tree, or a prompt chunk) at slots
length[b] + i; commit() then keeps the accepted ones by moving them down to length[b] ..
length[b] + n_keep[b] - 1. Slots past a row's length are scratch: masked out and overwritten.
Lengths live on the host as plain ints, so building a mask never waits for the device.
"""

from __future__ import annotations

import copy
import math

import torch

from bastion.models.attention import Layout
from bastion.models.attention import key_bucket as attention_bucket
from bastion.models.transfer import to_device


class KVCache:
    def __init__(self, n_layers, batch, n_kv_heads, head_dim, capacity, dtype, device, kernel: str = "sdpa",
                 buffers: tuple[torch.Tensor, torch.Tensor] | None = None):
        """`buffers`: a graphed target's keys and values [L, >= batch, Hkv, capacity, D] to write
        into (their first `batch` rows) rather than new ones, since CUDA graphs replay over fixed
        addresses (models/target.py)."""
        self.static = buffers is not None  # its buffers' addresses are fixed
        if buffers is None:
            shape = (n_layers, batch, n_kv_heads, capacity, head_dim)
            buffers = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
        self.buffers = buffers  # [L, >= B, Hkv, S, D], whole: its rows are their first B
        self.k, self.v = (first_rows(buf, batch, self.static) for buf in buffers)  # [L, B, Hkv, S, D]
        self.lengths = [0] * batch  # verified tokens per row
        self.capacity = capacity
        self.kernel = kernel  # the attention kernel its layouts ask for (models/attention.py)
        self.attention_bucket = attention_bucket(kernel, device, dtype)  # that kernel's own key bucket, fixed for the cache's life

    @property
    def device(self) -> torch.device:
        return self.k.device

    def prepare(self, n_new: int, tree_mask: torch.Tensor | None = None, key_bucket: int = 1) -> tuple[torch.Tensor, Layout]:
        """For a forward of `n_new` tokens per row, seeing each other as `tree_mask` [B, N, N]
        says (True where token i may see token j; None: causally), return the cache slots they
        are written to [B, N] and their attention Layout over the verified prefix and themselves
        (attending over a multiple of `key_bucket` slots, within capacity: a compiled forward's
        static shape; and of the attention's own bucket, attention.key_bucket)."""
        longest = max(self.lengths)
        if longest + n_new > self.capacity:
            raise RuntimeError(f"KV cache overflow: {longest} + {n_new} tokens > capacity {self.capacity}")
        lengths = to_device(self.lengths, self.device)
        write_pos = lengths[:, None] + torch.arange(n_new, device=self.device)  # [B, N]
        bucket = math.lcm(key_bucket, self.attention_bucket)
        if longest == 0 and tree_mask is None:  # a prompt's first chunk: plain causal attention (flash on GPUs), no mask to bucket
            bucket = 1
        n_keys = min(self.capacity, -(-(longest + n_new) // bucket) * bucket)
        return write_pos, Layout(lengths, tree_mask, n_new, n_keys, self.kernel)

    def store(self, layer: int, k, v, write_pos) -> None:
        """k, v: [B, Hkv, N, D] into slots write_pos [B, N] of `layer` (cast to the cache's dtype:
        autocast makes them bfloat16). index_put, not scatter_: CPU scatter_ copies the whole
        bfloat16 buffer on every call."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1]
        self.k[layer][rows, :, write_pos] = k.transpose(1, 2).to(self.k.dtype)  # indexed [B, N, Hkv, D]
        self.v[layer][rows, :, write_pos] = v.transpose(1, 2).to(self.v.dtype)

    def write(self, layer: int, k, v, write_pos, s_view: int):
        """store(), then return this layer's keys and values [B, Hkv, s_view, D]."""
        self.store(layer, k, v, write_pos)
        return self.k[layer, :, :, :s_view], self.v[layer, :, :, :s_view]

    def commit(self, keep: list[list[int]]) -> None:
        """keep[b]: indices (into the last forward's tokens, increasing) that row b keeps.

        Only rows that keep something other than a prefix move data: AR steps, chains, prefills
        and most tree steps keep their tokens where they were written."""
        for b, row in enumerate(keep):
            if row != list(range(len(row))):
                n = self.lengths[b]
                src = to_device(row, self.device) + n
                for buf in (self.k, self.v):
                    buf[:, b, :, n : n + len(row)] = buf[:, b, :, src]  # src >= dst: read before written
        self.lengths = [n + len(row) for n, row in zip(self.lengths, keep)]

    def row_range(self, start: int, stop: int) -> KVCache:
        """Rows start..stop-1 as a cache that writes into this one's buffers (a prefill chunk);
        its commits do not reach this cache's lengths."""
        view = copy.copy(self)
        view.k, view.v, view.lengths = self.k[:, start:stop], self.v[:, start:stop], self.lengths[start:stop]
        return view

    @property
    def rows_held(self) -> int:
        """The rows its buffers hold: its own and, past them, rows no cache uses."""
        return self.buffers[0].shape[1]

    def padded(self, batch: int) -> KVCache:
        """This cache as one of `batch` rows (at most rows_held), its own first: the rows past them
        are its buffers' unused rows, read as holding no verified token and written as scratch.
        A graphed target forwards a bucket of rows (models/target.py), so that rows leaving a
        decode do not each record graphs for a batch size of their own."""
        view = copy.copy(self)
        view.k, view.v = (first_rows(buf, batch, self.static) for buf in self.buffers)
        view.lengths = self.lengths + [0] * (batch - len(self.lengths))
        return view

    def keep_rows(self, rows: list[int]) -> None:
        """Drop finished rows: the cache shrinks to `rows`, in that order, in place. The rows that
        move are copied into their places and the buffers become views of their first rows: a
        finished row costs its movers' copy (one row's, in the order `fill_holes` gives), not a
        copy of the whole cache, and the buffers keep their addresses, which graphs replay over."""
        moves = [(new, old) for new, old in enumerate(rows) if new != old]
        if moves:
            new, old = (to_device(list(ends), self.device) for ends in zip(*moves))
            for buf in (self.k, self.v):
                buf[:, new] = buf[:, old]  # the movers are read (a copy) before any row is written
        self.k, self.v = (first_rows(buf, len(rows), self.static) for buf in (self.k, self.v))
        self.lengths = [self.lengths[r] for r in rows]


def first_rows(buffer: torch.Tensor, batch: int, static: bool) -> torch.Tensor:
    """The first `batch` rows of a KV buffer [L, B, ...], marked as at a static address where it
    is a graphed target's: a view is a tensor of its own, and torch.compile's CUDA graphs replay
    over an input that the graph writes into (the cache) only if it is so marked (else they skip
    graphs for that forward)."""
    rows = buffer[:, :batch]
    if static:
        torch._dynamo.mark_static_address(rows)  # unguarded: a new address re-records the graph rather than recompiling
    return rows


def fill_holes(keep: list[int]) -> list[int]:
    """The surviving rows `keep` (increasing) reordered so that the rows past the new batch size
    fill the finished rows' places and every other row stays where it is."""
    n = len(keep)
    movers = iter(r for r in keep if r >= n)
    staying = set(keep)
    return [i if i in staying else next(movers) for i in range(n)]
