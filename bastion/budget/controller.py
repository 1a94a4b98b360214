"""BASTION's budget controller: size every step's trees to maximise the predicted speedup.

For the n best nodes (A_hat(n) their summed path probabilities) a step is predicted to yield
rows + A_hat(n) tokens in C(n) = T_draft + T_verify(n) + overhead seconds, so the speedup over
AR is S(n) = (rows + A_hat(n)) / C(n) * L_AR / rows. The controller takes the n maximising it.
With a batch, one budget is spent over all rows: nodes are taken best first across rows (each
row's nodes in its own order, so every row keeps a prefix-closed tree), and T_verify is the
latency of the padded batch. T_verify comes from the roofline model in latency.py, refitted
online from measured verify times; T_draft and the overhead are medians of measured times.

A_hat is the drafter's own belief, and drafters are overconfident, more so out of domain. So
the controller scales each node's path probability by the running ratio of accepted tokens to
A_hat (its level, a short memory: the domain can change within a decode), times how that ratio
varies with the node's rank in its tree's best-first order (its shape, a long memory: ranks see
few nodes each). Where the sizing curve is flat, what tells 4 nodes from 11 is what the 5th to
11th nodes actually add, and that is measured for free: at T = 0 (and with keyed ranked
children) the nodes a truncation of a verified tree would have accepted are the accepted path's
nodes inside it, so every verified node is counted, accepted or not. The shape at a rank pools
the ranks within a factor sqrt(2) of it and is shrunk towards 1 as far as that evidence is thin.
Draft and other step costs are medians of recent drafted steps (recent.py).

Whether to draft at all answers to realised throughput once there is some (base.py): the
tokens per second this decode's recent drafted steps actually produced, against its AR steps'.
Forecasts pick the size; a forecast that drafting does not pay stops it only until realised
throughput says otherwise, and realised throughput below AR's stops it whatever the forecast.

The model is refitted every `refit_every` steps over a long memory, while drafting and host
costs are medians of the last few steps: when the machine's pace drifted, verify prices lagged
the rest of the step, so larger trees looked cheaper than they were, and the steps that chose
them were those whose prices had fallen furthest behind (forecasts ran low on average, the
largest sizes' most). So the model's pace (latency.py) follows each drafted step's measured
verify time against its forecast, by a running mean that keeps up within a few steps as the
step's other costs do; while the model itself is wrong (exploring, below) the pace waits, or
the two would learn one error (experiments/NOTES.md).

A model that is wrong (a wrong hardware profile, another process on the machine) only ever
sees the sizes it chooses, which cannot tell compute from memory costs apart. So while its
forecasts are off by more than `tolerance` on average (a running mean of the signed log error,
so that timing noise cancels and a bias does not), the controller explores: it verifies at
half, a quarter and twice its choice in turn, and refits at once, until forecasts are right.
The tolerance is wide: a roofline cannot follow the steps a CPU's matmul kernels take between
sizes, which leave even a probe-calibrated model off by a fraction on some prompts, and
exploring for that cost more than the error did (experiments/NOTES.md).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from bastion.budget.base import Budget
from bastion.budget.hardware import HardwareProfile
from bastion.budget.latency import LatencyModel, calibrated
from bastion.tree.draft_tree import DraftTree


class BastionBudget(Budget):
    EXPLORE = (0.5, 0.25, 2.0)
    PRIOR = 2.0  # a rank's shape starts flat, with this much belief (expected tokens) behind it
    FOLLOW = 0.3  # the weight of each drafted step's verify error in the running means that follow it (bias, pace)

    def __init__(self, max_nodes: int = 256, probe: bool = True, refit_every: int = 16, smoothing: float = 0.2,
                 tolerance: float = 0.5, scale_acceptance: bool = True, per_rank: bool = True, pause_drafting: bool = True,
                 window: int = 8, mode: str = "flex", follow_pace: bool = True):
        if max_nodes < 1:
            raise ValueError(f"budget.max_nodes must be at least 1 (got {max_nodes}).")
        if refit_every < 1:
            raise ValueError(f"budget.refit_every must be at least 1 (got {refit_every}).")
        super().__init__(mode, pause_drafting, window)
        self.max_nodes, self.probe, self.refit_every, self.smoothing = max_nodes, probe, refit_every, smoothing
        self.tolerance, self.scale_acceptance, self.per_rank, self.follow_pace = tolerance, scale_acceptance, per_rank, follow_pace
        self.accepted, self.believed = 2.0, 2.0  # decayed sums of accepted tokens and A_hat (a prior of ratio 1)
        self.hits, self.belief = np.zeros(max_nodes), np.zeros(max_nodes)  # the same per rank 1.., where paths are known
        ranks = np.arange(1, max_nodes + 1)  # the ranks near each: ceil(rank / sqrt 2) .. floor(rank * sqrt 2)
        self._near = np.ceil(ranks / math.sqrt(2)).astype(np.int64) - 1, np.minimum(ranks * math.sqrt(2), max_nodes).astype(np.int64)
        self.exploring = False  # while forecasts are biased
        self.bias = 0.0  # running mean of log(measured / forecast) verify time
        self._explored = 0  # explorations so far: the factors cycle across episodes
        self._sized: list[DraftTree] = []  # the trees the last drafted step verified
        self._seen = 0

    def start(self, target, hardware: HardwareProfile, cache_dir: Path, draft_tokens: int = 0) -> None:
        """Build the latency model: probe-calibrated (cached), or the profile's prior alone."""
        if self.latency is None:
            if self.probe:
                self.latency = calibrated(target, hardware, cache_dir)
            else:
                self.latency = LatencyModel.from_profile(target.args, target.dtype, hardware)
        super().start(target, hardware, cache_dir, draft_tokens)

    def reset(self) -> None:
        super().reset()
        self._sized = []  # a new prompt starts at full depth

    @property
    def acceptance_ratio(self) -> float:
        """Accepted tokens per unit of A_hat, measured (1 without calibration)."""
        return self.accepted / self.believed if self.scale_acceptance else 1.0

    def rank_ratios(self) -> np.ndarray:
        """[max_nodes] accepted tokens per unit of path probability at ranks 1..max_nodes: the
        pooled ratio times the rank's shape (its ranks' long-run ratio over the long-run ratio
        of all ranks), which is flat where they have seen little (or nothing: ranks deeper than
        any verified yet, so that the controller tries them)."""
        if not self.scale_acceptance:
            return np.ones(self.max_nodes)
        (low, high), hits, belief = self._near, np.append(0, self.hits.cumsum()), np.append(0, self.belief.cumsum())
        overall = (hits[-1] + self.PRIOR) / (belief[-1] + self.PRIOR)
        near = (hits[high] - hits[low] + self.PRIOR * overall) / (belief[high] - belief[low] + self.PRIOR)
        return self.acceptance_ratio * near / overall

    def size(self, trees: list[DraftTree], contexts: list[int]) -> list[DraftTree]:
        counts, verify, cost, speedup = self.curve(trees, contexts)
        best = 1 + int(np.argmax(speedup[1:])) if len(speedup) > 1 else 0  # the best tree with a draft node
        # while exploring, forecasts are off: only realised throughput judges
        self.judge_forecast(None if self.exploring else float(speedup[best]), self.retry_cost(float(cost[best]), contexts))
        if self.exploring:
            factor = self.EXPLORE[self._explored % len(self.EXPLORE)]
            self._explored += 1
            best = int(np.clip(round(max(best, 1) * factor), 1, len(counts) - 1))
        self.predicted_s = float(verify[best])
        self._sized = [tree.truncate(int(n)) for tree, n in zip(trees, counts[best])]
        return self._sized

    def max_depth(self) -> int:
        """One deeper than the deepest tree it chose last: the next step's choice is much like
        the last, and may still grow by a level each step (the first step: max_nodes)."""
        if not self._sized:
            return self.max_nodes
        return min(self.max_nodes, 1 + max(int(t.depths.max()) for t in self._sized))

    def curve(self, trees: list[DraftTree], contexts: list[int]):
        """For n = 0.. all nodes: per-row node counts [n+1, B], predicted verify time [n+1],
        predicted step time in AR steps [n+1] and predicted speedup over AR S(n) [n+1]."""
        counts, gained = merge_best_first(trees, self.rank_ratios())
        widest = counts.max(axis=1)  # [n+1] the padded batch's draft nodes per row, nondecreasing in n
        grows = np.concatenate([[True], widest[1:] > widest[:-1]])  # np.unique without its sort
        widths, at = widest[grows], np.cumsum(grows) - 1
        ctx = np.asarray(contexts)[None, :].repeat(len(widths), 0)
        verify = self.latency.predict(1 + widths[:, None].repeat(len(trees), axis=1), ctx)[at]  # priced once per width
        draft_s, other_s = self.draft_s(contexts), self.recent.other_s
        cost = (draft_s + verify + other_s) / (verify[0] + other_s)  # n = 0 is an AR step
        speedup = (1 + gained / len(trees)) / cost
        return counts, verify, cost, speedup

    def observe(self, step, contexts: list[int], width: int) -> None:
        """Fold in a measured step. An AR step: its time. A drafted one: its draft and other
        times, its accepted tokens against A_hat (per rank too, where its paths are known),
        its tokens per row and time, and its verify time at the shape that actually ran
        (`width` tokens per row after `contexts` cached ones)."""
        super().observe(step, contexts, width)
        if not step.drafted:
            return
        decay = 1 - self.smoothing / 4  # acceptance is noisy: a long memory
        self.accepted = decay * self.accepted + sum(step.produced) - len(step.produced)
        self.believed = decay * self.believed + sum(t.expected_accepted() for t in self._sized)  # the trees it priced, not
        # step.expected: sampled children (T > 0) replace them with drawn tokens of lower A_hat
        if step.paths and self.per_rank:
            slow = 1 - self.smoothing / 40  # each rank sees few nodes a step: ten times longer still
            self.hits *= slow
            self.belief *= slow
            ranks = np.concatenate([np.arange(t.n_nodes) for t in self._sized])  # each node's rank - 1, row after row
            self.belief += np.bincount(ranks, np.exp(np.concatenate([t.logq[1:] for t in self._sized])), self.max_nodes)
            self.hits += np.bincount([node - 1 for path in step.paths for node in path[1:]], minlength=self.max_nodes)
        # the curve's own error: a wrong profile shows there, while measured sizes' corrections hide it
        error = self.latency.observe_forward([width] * len(contexts), contexts, step.verify_s)
        self._seen += 1
        self.bias += self.FOLLOW * (error - self.bias)
        self.exploring = abs(self.bias) > math.log(1 + self.tolerance)
        if self.follow_pace and self.predicted_s and not self.exploring:  # predicted_s: this step's forecast, today's pace in it
            self.latency.follow(step.verify_s, self.predicted_s, self.FOLLOW)
        if self.exploring or self._seen % self.refit_every == 0:
            self.latency.fit(fit_shape=self.latency.distinct_sizes() >= 4)


def merge_best_first(trees: list[DraftTree], ratios: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Take the rows' nodes one at a time, always the best next node of any row (each row's
    nodes in its own order), a node valued at its path probability times the `ratios` of its
    rank in its row [at least the largest tree's nodes] (none: 1). Returns per-row node counts
    after each pick [n+1, B] and the summed values after each pick [n+1] (A_hat, calibrated).

    Without a heap: a node cannot be taken before the nodes its row lists earlier, so it is
    taken at the lowest value up to it in its row (a running minimum), and taking nodes by
    decreasing running minimum, ties to the lower row, is that greedy merge (a stable sort of
    the rows laid end to end)."""
    values = [np.exp(t.logq[1:]) * (1.0 if ratios is None else ratios[: t.n_nodes]) for t in trees]
    if len(trees) == 1:  # one row: its nodes in its order (a step at batch 1 should not pay for the sort)
        return np.arange(len(values[0]) + 1)[:, None], np.concatenate([[0.0], np.cumsum(values[0])])
    rows = np.repeat(np.arange(len(trees)), [len(v) for v in values])
    order = np.argsort(-np.concatenate([np.minimum.accumulate(v) for v in values]), kind="stable")
    picks = np.zeros((len(order) + 1, len(trees)), dtype=np.int64)
    picks[np.arange(1, len(order) + 1), rows[order]] = 1
    return picks.cumsum(0), np.concatenate([[0.0], np.cumsum(np.concatenate(values)[order])])
