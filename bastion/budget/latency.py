"""A roofline model of the target's verify latency, calibrated on measured times.

A forward of n tokens (summed over rows) does F FLOPs (weights, attention, LM head) and moves
B bytes (the weights once, each row's KV cache). Under a roofline it takes
    T = t0 + smoothmax(a * F / peak_flops, b * B / bandwidth)
with a, b the inverse efficiencies of compute and memory, t0 a fixed cost per forward, and
smoothmax(x, y) = (x^p + y^p)^(1/p): p -> inf is the textbook max (GPUs overlap compute and
memory traffic), p = 1 their sum (CPUs mostly do not). The hardware profile gives the prior;
a short probe at start-up fits all four parameters (cached per machine, profile, model, dtype,
kernels and attention backend; a probe a busy machine disturbed is refused, not cached) and
measured step times keep refitting t0, a and b online (and p once several sizes are measured),
so a wrong profile corrects itself within a few steps.

Within a run the pace drifts too, faster than refits over a long memory follow. So the model
also carries the machine's pace now (`pace`, which the budget follows step by step from its
forecasts' errors), and each measured time is kept with the pace of its moment: fits and
corrections take every time back to the mean pace of the times they use (`model_pace`), and a
forecast is the model's times brought from that pace to today's. Kept as measured, a refit moved
the curve part of the way to today's pace while a size last measured in a faster minute kept
that minute's correction against it, and so looked cheap (experiments/NOTES.md).

Matmul kernels do not cost what a smooth curve says: they work in tiles, so a forward of 6, 7
or 8 tokens can cost the same and 9 a step more (CPU and GPU alike). A controller reading a
smooth curve picks sizes on the low side of such a step, paying for tokens it does not verify.
So each forward size the model has seen measured (the probe covers every size up to 16)
keeps a correction: the median log ratio of its measured times to the curve's, shrunk towards
the curve as far as the spread of repeated measurements says it could be noise; sizes between
measured ones take their neighbours' corrections, interpolated.

A cached probe was taken on another day, and a machine's pace drifts between runs (another
process, clocks, the host's load): the probe's times then all sit above or below today's by
one factor. Refitting the curve to the probe's and today's times alike bends it between the
two, and a size measured only by the probe keeps a correction against today's curve that is
really the drift, so the controller sees a smaller tree cost more than a bigger one. So the
probe's points carry their own level, a free log-offset in every fit (its shape is
today's, its pace is not), and their corrections are taken against the curve at that level.
"""

from __future__ import annotations

import json
import math
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import least_squares
from tqdm import tqdm

from bastion.budget.hardware import HardwareProfile, device_name
from bastion.files import atomic_write_text
from bastion.models.attention import attention_path
from bastion.models.packed_linear import linear_kernels
from bastion.models.timer import now
from bastion.models.transformer import ModelArgs

PROBE_SIZES = (*range(1, 17), 24, 32, 48, 64, 128, 256)
SIZE_POINTS = 16  # measured times kept per forward size for its correction
RECENT = 64  # forwards measured since, after which a time no longer counts towards its size's correction


@dataclass
class ForwardCost:
    """FLOPs and bytes of one target forward, from the model's shape."""

    args: ModelArgs
    bytes_per_param: int

    def __post_init__(self):
        a = self.args
        attn = a.hidden_size * a.head_dim * (2 * a.n_heads + 2 * a.n_kv_heads)
        mlp = 3 * a.hidden_size * a.intermediate_size
        self.layer_params = a.n_layers * (attn + mlp)
        self.head_params = a.hidden_size * a.vocab_size
        self.kv_bytes_per_token = 2 * a.n_layers * a.n_kv_heads * a.head_dim * self.bytes_per_param

    def flops_bytes(self, new_tokens: np.ndarray, contexts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """new_tokens, contexts: [..., rows] tokens forwarded and tokens cached per row."""
        a = self.args
        n = new_tokens.sum(-1)
        attended = (new_tokens * (contexts + new_tokens)).sum(-1)
        flops = 2 * (self.layer_params + self.head_params) * n + 4 * a.n_layers * a.n_heads * a.head_dim * attended
        moved = (self.layer_params + self.head_params) * self.bytes_per_param + self.kv_bytes_per_token * (contexts + new_tokens).sum(-1)
        return flops.astype(float), moved.astype(float)


@dataclass
class LatencyModel:
    cost: ForwardCost
    peak_flops: float
    bandwidth: float
    theta: np.ndarray = field(default=None)  # log t0, log a, log b, log(p - 1 + 1e-3)
    prior: np.ndarray = field(default=None)  # what fits are pulled towards: the profile's, or the probe's fit
    points: list[tuple[float, float, float, float]] = field(default_factory=list)  # (flops, bytes, seconds, pace) measured
    # in this run, each with the pace of its moment
    max_points: int = 256
    by_size: dict[int, list[tuple[float, float, float, float, int]]] = field(default_factory=dict)  # tokens forwarded -> its
    # last points, each with its forward's number in the run
    forwards: int = 0  # forwards measured in this run
    probed: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # tokens forwarded -> the probe's point
    level: float = 0.0  # log(the probe's times / this run's) for the same forward: the pace's drift since the probe
    correction: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [0 .. largest measured size] log(measured / curve)
    pace: float = 0.0  # log of the machine's pace now, against the run's first forwards (the budget follows it)
    model_pace: float = 0.0  # the mean pace of the points the last fit used: the pace the curve and corrections describe

    def __post_init__(self):
        if self.prior is None and self.theta is not None:
            self.prior = np.array(self.theta, dtype=float)

    @classmethod
    def from_profile(cls, args: ModelArgs, dtype: torch.dtype, hw: HardwareProfile) -> LatencyModel:
        cost = ForwardCost(args, torch.finfo(dtype).bits // 8)
        is_gpu = hw.name not in ("cpu",) and not hw.name.startswith("measured-cpu")
        prior = np.log([max(hw.launch_overhead_ms, 1e-3) * 1e-3, 1 / 0.6, 1 / 0.8, (8.0 if is_gpu else 1.0) - 1 + 1e-3])
        return cls(cost, hw.flops_per_s(dtype), hw.bytes_per_s, prior)

    def predict(self, new_tokens: np.ndarray, contexts: np.ndarray, corrected: bool = True) -> np.ndarray:
        """Seconds of forwards of new_tokens [..., rows] after contexts [..., rows] at today's pace:
        the curve, corrected by size (total tokens; `correct`) unless `corrected` is false."""
        new_tokens = np.asarray(new_tokens)
        flops, moved = self.cost.flops_bytes(new_tokens, np.asarray(contexts))
        seconds = self._predict(self.theta, flops, moved) * math.exp(self.pace - self.model_pace)
        if not (corrected and len(self.correction)):
            return seconds
        return seconds * np.exp(self.correction[np.minimum(new_tokens.sum(-1), len(self.correction) - 1)])

    def _predict(self, theta, flops, moved):
        t0, a, b, p = np.exp(theta[0]), np.exp(theta[1]), np.exp(theta[2]), 1 + np.exp(theta[3]) - 1e-3
        x, y = a * flops / self.peak_flops, b * moved / self.bandwidth
        m = np.maximum(x, y)
        return t0 + m * ((x / m) ** p + (y / m) ** p) ** (1 / p)

    def fit(self, fit_shape: bool, prior_weight: float = 0.01) -> None:
        """Least squares on log time over the probe's and this run's points (weight 1 each),
        pulled towards the prior with `prior_weight` per parameter. `fit_shape` also fits p;
        otherwise p stays the prior's, since a few sizes cannot pin the curve's shape down.
        The probe's level is free once this run has measured anything (see the module doc)."""
        probed = list(self.probed.values())
        if not (self.points or probed):
            return
        if self.points:
            self.model_pace = float(np.mean([point[3] for point in self.points]))
        flops, moved, seconds = map(np.asarray, zip(*probed, *map(self.at_model_pace, self.points)))
        is_probe = np.arange(len(seconds)) < len(probed)
        free = [0, 1, 2, 3] if fit_shape else [0, 1, 2]
        base = np.append(self.prior, 0.0)  # theta's prior, and the level's: no drift
        if self.points and probed:
            free.append(4)

        def residuals(z):
            theta = base.copy()
            theta[free] = z
            fit = np.log(self._predict(theta[:4], flops, moved)) + theta[4] * is_probe - np.log(seconds)
            return np.concatenate([fit, math.sqrt(prior_weight) * (z - base[free])])

        fitted = least_squares(residuals, np.append(self.theta, self.level)[free], method="trf").x
        theta = base.copy()
        theta[free] = fitted
        self.theta, self.level = theta[:4], float(theta[4])
        self.correct()

    def correct(self) -> None:
        """Each measured size's correction against the current curve: the median of the log
        ratios of its last SIZE_POINTS times within the last RECENT forwards (the probe's, at the
        probe's level, first) to the curve, shrunk towards the curve as far as it could be noise
        (`shrunk`). Times expire because the pace drifts within a run too: a size measured in a
        slow minute and not chosen since kept that minute's pace as its correction against a
        curve that followed the pace on, so the controller kept off it for good and alternated
        between the few sizes it went on measuring (experiments/NOTES.md). A size between
        measured ones takes their corrections interpolated, one past them the largest's: priced
        by the bare curve, sizes between the probe's 24 and 32 tokens looked cheaper than both
        wherever the curve ran below its measured neighbours, and the controller jumped to them."""
        residuals = {}  # size -> [points] log(measured / curve)
        for size in {*self.by_size, *self.probed}:
            probed = [(*self.probed[size], self.level)] if size in self.probed else []
            kept = probed + [(*self.at_model_pace(point), 0.0) for point in self.by_size.get(size, []) if point[4] > self.forwards - RECENT]
            if not kept:
                continue
            flops, moved, seconds, level = map(np.asarray, zip(*kept[-SIZE_POINTS:]))
            residuals[size] = np.log(seconds) - level - np.log(self._predict(self.theta, flops, moved))
        sizes = sorted(residuals)
        corrections = shrunk([residuals[size] for size in sizes])
        self.correction = np.interp(np.arange(sizes[-1] + 1), sizes, corrections) if sizes else np.zeros(0)

    def distinct_sizes(self) -> int:
        """Distinct forward costs among the points: enough of them make the curve's shape (p) identifiable."""
        return len({round(math.log(point[0]), 1) for point in [*self.probed.values(), *self.points]})

    def follow(self, seconds: float, forecast: float, weight: float) -> None:
        """Move the pace a `weight` of the way towards a measured forward's `seconds` over its
        `forecast` (made at today's pace): a running mean of the forecasts' log errors."""
        self.pace += weight * math.log(seconds / forecast)

    def at_model_pace(self, point: tuple) -> tuple[float, float, float]:
        """A measured point (flops, bytes, seconds, pace, ...) as (flops, bytes, seconds) at the model's pace."""
        flops, moved, seconds, pace = point[:4]
        return flops, moved, seconds * math.exp(self.model_pace - pace)

    def observe_forward(self, new_tokens: list[int], contexts: list[int], seconds: float) -> float:
        """Keep a measured forward of new_tokens [rows] after contexts [rows], at today's pace;
        returns its log ratio to the curve, uncorrected and at the model's pace (the curve's own
        error at it, whatever the pace has done since: what a wrong profile shows)."""
        flops, moved = self.cost.flops_bytes(np.asarray(new_tokens), np.asarray(contexts))
        point = (float(flops), float(moved), seconds, self.pace)
        self.points.append(point)
        del self.points[: -self.max_points]
        self.forwards += 1
        kept = self.by_size.setdefault(int(sum(new_tokens)), [])
        kept.append((*point, self.forwards))
        del kept[:-SIZE_POINTS]
        return math.log(seconds / float(self._predict(self.theta, *point[:2])))


def shrunk(residuals: list[np.ndarray]) -> np.ndarray:
    """Corrections [sizes] from each size's log ratios of measured times to the curve: their
    medians, shrunk towards 0 (the curve) by how much of their spread across sizes the noise
    of a few measurements explains (empirical Bayes: a median m of k times, each `noise`
    apart from its size's true cost, has variance v = noise^2 pi / 2k, true corrections
    spread tau^2 = mean(m^2) - mean(v), and m is shrunk to m tau^2 / (tau^2 + v)).

    The controller takes the size with the best forecast, so among sizes whose corrections are
    noise it takes the one the noise favoured most (the optimizer's curse): on a CPU whose pace
    drifts, probe points well off made it verify trees whose forwards cost more than it
    believed, above sizes that paid (experiments/NOTES.md). Kernels' real steps, measured alike
    each time, spread the corrections far beyond the noise and are kept.

    The noise of one time is pooled over sizes measured more than once, from the differences of
    a size's successive times (median |difference| / 0.6745 / sqrt 2: a burst of load does not
    set it); 0, no shrinking, until some size is measured twice."""
    gaps = np.abs(np.concatenate([np.diff(r) for r in residuals if len(r) > 1] or [np.zeros(0)]))
    noise = float(np.median(gaps)) / 0.6745 / math.sqrt(2) if len(gaps) else 0.0
    medians = np.array([np.median(r) for r in residuals])
    variance = noise**2 * math.pi / 2 / np.array([len(r) for r in residuals])
    spread = max(0.0, float(np.mean(medians**2 - variance))) if len(medians) else 0.0
    return medians * np.divide(spread, spread + variance, out=np.ones_like(variance), where=spread + variance > 0)


def probe(target, model: LatencyModel, sizes=PROBE_SIZES, context: int = 256, repeats: int = 5, attempts: int = 2) -> None:
    """Time target forwards of `sizes` chain tokens after `context` cached tokens, and fit.
    Timings that cannot be right (see `probe_problem`) are measured again, and refused in one
    sentence if they still are: a fit cached from a busy machine would mis-size every later run."""
    for attempt in range(attempts):
        times = probe_times(target, sizes, context, repeats)
        problem = probe_problem(sizes, times)
        if problem is None:
            break
        if attempt + 1 == attempts:
            raise ValueError(f"The latency probe of {target.name} measured {problem}: the machine looks busy. "
                             "Rerun when it is idle (or use budget=fixed, which needs no probe).")
        warnings.warn(f"latency probe: {problem}; measuring again", stacklevel=2)
    points = {}  # size -> (flops, bytes, median seconds)
    for n, ts in zip(sizes, times):
        flops, moved = model.cost.flops_bytes(np.array([n]), np.array([context]))
        points[n] = (float(flops), float(moved), float(np.median(ts)))
    model.probed = nondecreasing(points)
    model.level = 0.0
    model.fit(fit_shape=True, prior_weight=1e-3)


def probe_times(target, sizes, context: int, repeats: int) -> list[list[float]]:
    """Seconds of `repeats` forwards of each size [sizes][repeats], taken in passes over every
    size (after untimed ones: one, or two for a graphed target, whose forward compiles a shape on
    its first call and records its CUDA graph on its second): a slow second of a shared machine
    then slows one time of every size, which the median drops, rather than all of one size's times."""
    device = target.device
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.args.vocab_size, (1, context + max(sizes)), generator=gen).to(device)
    times, untimed = [[] for _ in sizes], 2 if target.execution == "graphed" else 1
    for _ in tqdm(range(untimed + repeats), desc="latency probe", unit="pass", leave=False):
        for n, runs in zip(sizes, times):
            cache = target.new_cache(1, context + target.padded(n))  # a compiled target runs a bucket of n
            cache.lengths = [context]
            mask = torch.ones(1, n, n, dtype=torch.bool, device=device).tril()
            t0 = now(device)
            hidden, _ = target.forward(tokens[:, context : context + n], torch.arange(n, device=device)[None], mask, cache)
            target.argmax(hidden)  # what a greedy verification reads of it
            runs.append(now(device) - t0)
    return [runs[untimed:] for runs in times]


def nondecreasing(probed: dict[int, tuple[float, float, float]]) -> dict[int, tuple[float, float, float]]:
    """The probe's points (size -> flops, bytes, median seconds) with their times made
    non-decreasing in the size (least squares on log time, by pooling adjacent violators). A
    forward's cost only grows with its tokens, so a size slower than a larger one is noise;
    kept as it was, its correction priced that size above its neighbours, the controller never
    chose it, and nothing ever re-measured it (experiments/NOTES.md). Real steps of the kernels
    (flat, then a jump) are non-decreasing and pass unchanged."""
    sizes = sorted(probed)
    blocks = []  # [sum of log seconds, count] per run of pooled sizes
    for n in sizes:
        blocks.append([math.log(probed[n][2]), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    seconds = [math.exp(total / count) for total, count in blocks for _ in range(count)]
    return {n: (*probed[n][:2], t) for n, t in zip(sizes, seconds)}


def probe_problem(sizes, times: list[list[float]], spread: float = 2.0, drop: float = 0.6, floor: float = 1e-3) -> str | None:
    """What makes a probe's timings untrustworthy, or None. A forward's cost only grows with its
    tokens, and repeats of one forward agree on an idle machine; another process taking the
    cores breaks both: most repeats over `spread` times the fastest (one slow repeat is the
    jitter the median absorbs), or a forward's median under `drop` times a smaller one's (and
    `floor` seconds less: sub-millisecond forwards are all jitter)."""
    medians = [float(np.median(ts)) for ts in times]
    for n, ts, median in zip(sizes, times, medians):
        if median > spread * min(ts):
            return f"repeats of the {n}-token forward from {1e3 * min(ts):.1f} to {1e3 * max(ts):.1f} ms"
    for i, (n, t) in enumerate(zip(sizes, medians)):
        slowest = int(np.argmax(medians[:i])) if i else None
        if slowest is not None and t < drop * medians[slowest] and medians[slowest] - t > floor:
            return f"{1e3 * medians[slowest]:.1f} ms for {sizes[slowest]} tokens but {1e3 * t:.1f} ms for {n}"
    return None


def calibrated(target, hw: HardwareProfile, cache_dir: Path) -> LatencyModel:
    """The probe-fitted model, cached per machine (GPU or CPU model, and the CPU threads torch
    uses or, on a GPU, the host's CPU, whose launches an eager step waits on), torch's version,
    hardware profile (its prior shapes the fit), model, dtype, linear kernels, attention
    path (models/attention.py attention_path), how the forward runs (eager, compiled or as CUDA
    graphs: Target.execution), and what a probe times after the forward (the argmax a greedy
    verification takes): a fit made elsewhere is never reused."""
    model = LatencyModel.from_profile(target.args, target.dtype, hw)
    host = f"-on-{device_name('cpu')}" if target.device.type == "cuda" else f"-{torch.get_num_threads()}threads"
    kernels = (linear_kernels(target.model), attention_path(target.attention, target.device, target.dtype), target.execution, "argmax")
    parts = (device_name(str(target.device)) + host, f"torch{torch.__version__}", hw.name, target.name,
             str(target.dtype).removeprefix("torch."), *kernels)
    path = Path(cache_dir) / "latency" / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', '__'.join(parts))}.json"
    if not read_calibration(path, model):
        started = time.perf_counter()
        probe(target, model)
        atomic_write_text(path, json.dumps({"theta": model.theta.tolist(), "probed": model.probed,
                                            "probe_s": time.perf_counter() - started}))
    model.prior = model.theta.copy()  # online refits stay near the probe's fit unless measurements say otherwise
    return model


def read_calibration(path: Path, model: LatencyModel) -> bool:
    """Set `model`'s fit from the cache file at `path`; False when there is none to use. The
    file only ever holds a measurement this machine redoes in seconds, so one that does not
    parse is re-measured and overwritten, with a warning naming it, rather than stopping the run."""
    if not path.exists():
        return False
    try:
        saved = json.loads(path.read_text())
        if isinstance(saved, dict) and "probed" not in saved and "theta" in saved:
            return False  # an older calibration, whose probe points fitted as today's: probe again
        theta = np.asarray(saved["theta"], dtype=float)  # [4]
        probed = {int(n): tuple(map(float, p)) for n, p in saved["probed"].items()}  # size -> (flops, bytes, seconds)
        if theta.shape != (4,) or any(len(p) != 3 for p in probed.values()):
            raise ValueError("theta or points of the wrong size")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        warnings.warn(f"{path} is not a latency calibration ({error!r}); re-measuring and overwriting it.", stacklevel=3)
        return False
    model.theta, model.probed = theta, nondecreasing(probed)  # a file from before probes were made non-decreasing
    model.correct()
    return True
