"""The decode loop shared by every method.

AR decoding is the same loop with no drafter (each step verifies a root-only tree), DFlash is
`chain`, BASTION is `best_first` sized by its controller. One step: draft a block, build and
size the trees, run them through the target in one forward, accept, commit the KV cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from bastion.drafters.base import DraftContext, Drafter
from bastion.models.kv_cache import fill_holes
from bastion.models.target import Target
from bastion.tree.draft_tree import DraftTree, pack
from bastion.sampling import GREEDY, Sampling
from bastion.verify import sample_children, verify_greedy, verify_sampled


@dataclass
class Step:
    """One decode step of the batch: timings in seconds, and per active row what happened."""

    rows: list[int]  # prompt indices active in this step
    tree_sizes: list[int]  # draft nodes verified per row (root excluded)
    produced: list[int]  # new tokens per row: accepted draft tokens + bonus (before stop truncation)
    expected: list[float]  # A_hat of each row's tree
    draft_s: float
    verify_s: float
    other_s: float
    predicted_verify_s: float | None = None  # the budget controller's forecast of verify_s


@dataclass
class Generation:
    """One prompt's output."""

    tokens: list[int]  # new tokens, the stopping token included
    finish: str  # "eos" | "length" | "stop"
    steps: int = 0  # decode steps (target forwards after prefill) this row took part in
    features: torch.Tensor | None = None  # [prompt + new - 1, F] recorded target features (CPU, fp16)
    top_ids: torch.Tensor | None = None  # [new, k] the target's k likeliest tokens at each new token (CPU, int32)
    top_logprobs: torch.Tensor | None = None  # [new, k] their log-probs (CPU, fp16)


@dataclass
class Decoding:
    """What `generate` returns: per-prompt outputs and the per-step record of the batch."""

    generations: list[Generation]
    prefill_s: float
    steps: list[Step] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return self.prefill_s + sum(s.draft_s + s.verify_s + s.other_s for s in self.steps)


class Stopper:
    """Decides where a row's output ends: first EOS, max_new_tokens, or a stop string."""

    def __init__(self, eos_ids, max_new_tokens: int, stop_strings=(), tokenizer=None):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1 (got {max_new_tokens}).")
        if stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.eos_ids, self.max_new, self.stop_strings, self.tokenizer = set(eos_ids), max_new_tokens, tuple(stop_strings), tokenizer

    def cut(self, tokens: list[int], n_old: int) -> tuple[list[int], str | None]:
        """tokens = old output + this step's new tokens; returns the kept output and the finish
        reason, or None while the row goes on."""
        for i in range(n_old, min(len(tokens), self.max_new)):
            if tokens[i] in self.eos_ids:
                return tokens[: i + 1], "eos"
            if self.stop_strings and self._stops(tokens[: i + 1]):
                return tokens[: i + 1], "stop"
        if len(tokens) >= self.max_new:
            return tokens[: self.max_new], "length"
        return tokens, None

    def _stops(self, tokens: list[int]) -> bool:
        tail = self.tokenizer.decode(tokens[-32:])  # stop strings are short; decode only the tail
        return any(s in tail for s in self.stop_strings)


def _now(device: torch.device) -> float:
    """A timer read that waits for queued device work first, so times are honest on GPUs."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def check_prompts(target: Target, prompts: list[list[int]], max_new_tokens: int) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("Every prompt needs at least one token.")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > target.args.max_position:
        raise ValueError(
            f"A prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the context of "
            f"{target.name} ({target.args.max_position} tokens); shorten the prompt or lower max_new_tokens."
        )


@torch.inference_mode()
def generate(
    target: Target,
    prompts: list[list[int]],
    *,
    drafter: Drafter | None = None,
    policy=None,
    budget=None,
    max_new_tokens: int = 128,
    stop_strings: tuple[str, ...] = (),
    sampling: Sampling = GREEDY,
    seed: int = 0,
    keys: list[int] | None = None,
    record: tuple[int, ...] = (),
    record_top: int = 0,
) -> Decoding:
    """Decode a batch of prompts. Without a drafter this is plain AR decoding.

    Greedy at temperature 0; otherwise sampled with every method drawing from exactly AR's
    distribution. Ranked trees draw keyed samples (sampling.py): the token at output position
    t of prompt i depends only on (seed, keys[i], t), keys defaulting to the prompts' indices,
    so the output equals AR's for the same seed and keys. Sampled trees draw from one stream
    seeded by `seed`.

    `record` names target layers whose outputs are returned per prompt (Generation.features)
    for every token whose KV was committed: the training data of feature-conditioned drafters.
    `record_top` (AR decoding only) returns the target's k most likely tokens and their
    log-probs at every new token (Generation.top_ids / top_logprobs): soft labels for them.
    """
    stopper = Stopper(target.eos_ids, max_new_tokens, stop_strings, target.tokenizer)
    check_prompts(target, prompts, max_new_tokens)
    if drafter is not None and (policy is None or budget is None):
        raise ValueError("A drafter needs a tree policy and a budget controller.")
    device = target.device
    capture = tuple(drafter.feature_layers) if drafter else tuple(record)
    if record and tuple(record) != capture:
        raise ValueError("record must name the drafter's feature layers (or be used without a drafter)")
    if record_top and drafter is not None:
        raise ValueError("record_top records AR decoding's distributions: use it without a drafter")
    max_nodes = budget.max_nodes if drafter else 0
    rides_along = hasattr(drafter, "verify_forward")  # drafts inside the verification forward when it pays
    extra = drafter.extra_tokens(max_nodes) if rides_along else 0
    capacity = max(len(p) for p in prompts) + max_new_tokens + max_nodes + 1 + extra
    cache = target.new_cache(len(prompts), capacity)
    active = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # the prompt each cache row decodes
    rows = [prompts[i] for i in active]  # shortest first, so that prefill chunks waste little on padding

    t0 = _now(device)
    last_hidden, features = _prefill(target, rows, cache, capture)
    generator = None if sampling.keyed else torch.Generator(device=device).manual_seed(seed)
    keys = torch.tensor(range(len(prompts)) if keys is None else keys, device=device)  # [P] per prompt
    first_logits = target.logits(last_hidden)  # [B, V]
    first = _first_tokens(first_logits, sampling, seed, keys[active], generator)
    decoding = Decoding([Generation([], "") for _ in prompts], prefill_s=_now(device) - t0)
    tops = [[] for _ in prompts]  # per prompt: (ids, log-probs) [1, k] of each new token
    if record_top:
        _record_top(tops, active, first_logits, record_top)
    recorded = [[] for _ in prompts]  # per prompt: its recorded features, prefill first
    if record:
        for row, (i, p) in enumerate(zip(active, rows)):
            recorded[i].append(features[row, : len(p)].to("cpu", torch.float16))

    keep = _extend_outputs(decoding, active, [[t] for t in first], stopper, step=False)
    if drafter is not None:
        drafter.reset(len(prompts), capacity)
    ctx = DraftContext([list(p) + [t] for p, t in zip(rows, first)], features, [len(p) for p in rows], cache)
    active = _keep_rows(keep, active, cache, drafter, ctx)

    while active:
        t0 = _now(device)
        roots = [seq[-1] for seq in ctx.sequences]
        proposal = None
        if drafter is not None:
            if budget.drafts() and drafter.drafts(ctx):
                proposal = drafter.propose(ctx)
            else:  # the budget or the drafter chose an AR step; the drafter still reads the new tokens
                drafter.absorb(ctx)
        t1 = _now(device)
        contexts = list(cache.lengths)
        trees = budget.size(policy(proposal, max_nodes), contexts) if proposal is not None else [DraftTree.root_only(r) for r in roots]
        draft_probs = None
        if proposal is not None and not sampling.greedy and sampling.tree_mode == "sampled":
            draft_probs = proposal.distributions(sampling, target.args.vocab_size)
            trees = [sample_children(tree, draft_probs[b], generator) for b, tree in enumerate(trees)]
        tree_tokens, tree_depths, tree_mask = pack(trees, device)
        t2 = _now(device)
        parallel = proposal is not None and rides_along and drafter.parallel(trees, contexts)
        if parallel:
            hidden, features = drafter.verify_forward(cache, trees, tree_tokens, tree_depths, tree_mask), None
        else:
            hidden, features = target.forward(tree_tokens, tree_depths, tree_mask, cache, capture)
        logits = target.logits(hidden)  # [B, M, V]
        t3 = _now(device)
        if record_top:
            _record_top(tops, active, logits[:, 0], record_top)  # AR: M = 1
        if sampling.keyed:
            start = torch.tensor([len(decoding.generations[i].tokens) for i in active], device=device)  # [B] output position of each root's next token
            verdicts = verify_greedy(sampling.scores(logits, seed, keys[active], start, tree_depths), trees)
        else:
            verdicts = verify_sampled(logits, trees, sampling, generator, draft_probs)
        cache.commit([v.path for v in verdicts])
        if parallel:
            drafter.accept([v.path for v in verdicts])
        if capture:
            features = _gather_paths(features, [v.path for v in verdicts])
            if record:
                for row, (i, v) in enumerate(zip(active, verdicts)):
                    recorded[i].append(features[row, : len(v.path)].to("cpu", torch.float16))
        ctx = DraftContext([seq + v.tokens for seq, v in zip(ctx.sequences, verdicts)], features, [len(v.path) for v in verdicts], cache)
        keep = _extend_outputs(decoding, active, [v.tokens for v in verdicts], stopper, step=True)
        step_rows, active = active, _keep_rows(keep, active, cache, drafter, ctx)
        t4 = _now(device)
        step = Step(
            rows=step_rows,
            tree_sizes=[t.n_nodes for t in trees],
            produced=[len(v.tokens) for v in verdicts],
            expected=[t.expected_accepted() for t in trees],
            draft_s=t1 - t0,
            verify_s=t3 - t2,
            other_s=(t2 - t1) + (t4 - t3),
            predicted_verify_s=budget.predicted_s if proposal is not None else None,
        )
        if proposal is not None:  # what ran: the trees, plus the mask groups of parallel drafting
            budget.observe(step, contexts, drafter.forward_width if parallel else tree_tokens.shape[1])
            step.other_s += _now(device) - t4  # the controller's own refits are part of the step
        decoding.steps.append(step)
    if record:
        for gen, prompt, parts in zip(decoding.generations, prompts, recorded):
            gen.features = torch.cat(parts)[: len(prompt) + len(gen.tokens) - 1]
    if record_top:
        for gen, top in zip(decoding.generations, tops):
            gen.top_ids, gen.top_logprobs = (torch.cat(part)[: len(gen.tokens)] for part in zip(*top))
    return decoding


def _first_tokens(logits: torch.Tensor, sampling: Sampling, seed: int, keys: torch.Tensor, generator) -> list[int]:
    """The token prefill produces (output position 0) per row from logits [B, V]."""
    if sampling.keyed:
        zeros = torch.zeros(len(keys), 1, dtype=torch.long, device=logits.device)
        return sampling.scores(logits[:, None], seed, keys, zeros[:, 0], zeros)[:, 0].argmax(-1).tolist()
    return torch.multinomial(sampling.probs(logits), 1, generator=generator)[:, 0].tolist()


def _record_top(tops: list[list], active: list[int], logits: torch.Tensor, k: int) -> None:
    """Append each active row's k likeliest next tokens and their log-probs (logits [B, V])."""
    logprobs, ids = torch.log_softmax(logits.float(), -1).topk(k, -1)
    ids, logprobs = ids.to("cpu", torch.int32), logprobs.to("cpu", torch.float16)
    for row, i in enumerate(active):
        tops[i].append((ids[row : row + 1], logprobs[row : row + 1]))


def _prefill(target: Target, rows: list[list[int]], cache, capture: tuple[int, ...], slack: float = 1.25):
    """Run the prompts `rows` (shortest first) through the target and commit their KV; return
    each row's last hidden state [B, h] and the `capture` features [B, W, F] (right-padded).

    Rows go in chunks of similar length, each right-padded only to its own longest prompt and
    written through a view of its cache rows: a chunk grows while its padded tokens stay within
    `slack` times its real ones, so one long prompt does not make every row pay for its length."""
    device = target.device
    last_hidden, features, start = [], None, 0
    for stop in _chunk_ends([len(p) for p in rows], slack):
        chunk = rows[start:stop]
        B, width = len(chunk), len(chunk[-1])
        tokens = torch.tensor([p + [0] * (width - len(p)) for p in chunk], device=device)
        depths = torch.arange(width, device=device).expand(B, width)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(B, width, width)
        hidden, captured = target.forward(tokens, depths, causal, cache.row_range(start, stop), capture)
        last_hidden.append(hidden[torch.arange(B, device=device), torch.tensor([len(p) - 1 for p in chunk], device=device)])
        if capture:
            if features is None:
                features = captured.new_zeros(len(rows), len(rows[-1]), captured.shape[-1])
            features[start:stop, :width] = captured
        start = stop
    cache.commit([list(range(len(p))) for p in rows])
    return torch.cat(last_hidden), features


def _chunk_ends(lengths: list[int], slack: float) -> list[int]:
    """Where each prefill chunk of the increasing `lengths` ends (exclusive row indices)."""
    ends, start, total = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and n * (i - start + 1) > slack * (total + n):
            ends.append(i)
            start, total = i, 0
        total += n
    return ends + [len(lengths)]


def _gather_paths(features: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
    """features [B, M, F] -> the accepted paths' features [B, A, F], right-padded."""
    width = max(len(p) for p in paths)
    index = torch.tensor([p + [p[-1]] * (width - len(p)) for p in paths], device=features.device)
    return features.gather(1, index[:, :, None].expand(-1, -1, features.shape[-1]))


def _extend_outputs(decoding: Decoding, active: list[int], new_tokens: list[list[int]], stopper: Stopper, step: bool) -> list[int]:
    """Append each active row's new tokens, cut at its stop; return the rows that go on."""
    keep = []
    for row, (i, new) in enumerate(zip(active, new_tokens)):
        gen = decoding.generations[i]
        gen.steps += step
        gen.tokens, finish = stopper.cut(gen.tokens + new, len(gen.tokens))
        if finish is None:
            keep.append(row)
        else:
            gen.finish = finish
    return keep


def _keep_rows(keep: list[int], active: list[int], cache, drafter, ctx: DraftContext) -> list[int]:
    """Shrink the batch to the cache rows in `keep` when some rows finished; return the prompts
    the remaining rows decode."""
    if len(keep) == len(active):
        return active
    keep = fill_holes(keep)  # cheapest order for the caches
    cache.keep_rows(keep)
    if drafter is not None:
        drafter.keep_rows(keep)
    ctx.sequences = [ctx.sequences[r] for r in keep]
    ctx.n_features = [ctx.n_features[r] for r in keep]
    if ctx.features is not None:
        ctx.features = ctx.features[keep]
    return [active[r] for r in keep]
