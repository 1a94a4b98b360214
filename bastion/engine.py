"""The decode loop shared by every method.

AR decoding is the same loop with no drafter (each step verifies a root-only tree), DFlash is
`chain`, BASTION is `best_first` sized by its controller. One step: draft a block, build and
size the trees, run them through the target in one forward, accept, commit the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bastion.budget.base import Budget
from bastion.drafters.base import DraftContext, Drafter
from bastion.models.dynamo import compiled_graphs
from bastion.models.kv_cache import KVCache, fill_holes
from bastion.models.target import Target
from bastion.models.timer import Clock, now
from bastion.models.transfer import to_device
from bastion.recorder import Recorder
from bastion.sampling import GREEDY, Sampling
from bastion.tree.draft_tree import DraftTree, Packed, pack
from bastion.verify import sample_children, verify_greedy, verify_sampled

NOTHING = Recorder()  # generate records nothing beside its tokens by default


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
    drafted: bool = False  # False: an AR step (the budget or the drafter chose not to draft)
    compiled: bool = False  # torch.compile built a graph, or recorded a CUDA graph, during this step (decode.compile, flex): its times are not the method's
    paths: list[list[int]] = field(default_factory=list)  # per row, the accepted tree indices from the root, in the
    # trees as the budget sized them (none where children were drawn after sizing: sampled trees, T > 0)


@dataclass
class Generation:
    """One prompt's output."""

    tokens: list[int]  # new tokens, the stopping token included
    finish: str  # "eos" | "length" | "stop"
    steps: int = 0  # decode steps (target forwards after prefill) this row took part in


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


def check_prompts(target: Target, prompts: list[list[int]], max_new_tokens: int) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("Every prompt needs at least one token.")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > target.args.max_position:
        raise ValueError(
            f"A prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the context of "
            f"{target.name} ({target.args.max_position} tokens); shorten the prompt or lower max_new_tokens."
        )


@dataclass
class _Method:
    """How a batch is decoded: everything a step reads and does not change."""

    target: Target
    drafter: Drafter | None
    policy: object
    budget: Budget | None
    sampling: Sampling
    seed: int
    keys: torch.Tensor  # [P] the key each prompt is sampled under
    generator: torch.Generator | None  # sampled trees' stream (keyed sampling needs none)
    capture: tuple[int, ...]  # target layers whose outputs the forwards return
    recorder: Recorder
    stopper: Stopper
    clock: Clock


@dataclass
class _Batch:
    """What a step updates: the rows still decoding and what they have produced."""

    cache: KVCache
    ctx: DraftContext
    active: list[int]  # the prompt each cache row decodes
    decoding: Decoding


@torch.inference_mode()
def generate(
    target: Target,
    prompts: list[list[int]],
    *,
    drafter: Drafter | None = None,
    policy=None,
    budget: Budget | None = None,
    max_new_tokens: int = 128,
    stop_strings: tuple[str, ...] = (),
    sampling: Sampling = GREEDY,
    seed: int = 0,
    keys: list[int] | None = None,
    recorder: Recorder = NOTHING,
) -> Decoding:
    """Decode a batch of prompts. Without a drafter this is plain AR decoding.

    Greedy at temperature 0; otherwise sampled with every method drawing from exactly AR's
    distribution. Ranked trees draw keyed samples (sampling.py): the token at output position
    t of prompt i depends only on (seed, keys[i], t), keys defaulting to the prompts' indices,
    so the output equals AR's for the same seed and keys. Sampled trees draw from one stream
    seeded by `seed`. A `recorder` (recorder.py) keeps training data along the way.
    """
    check_prompts(target, prompts, max_new_tokens)
    capture = _check_method(drafter, policy, budget, recorder, sampling)
    device = target.device
    max_nodes = budget.max_nodes if drafter else 0
    longest = max(len(p) for p in prompts)
    widest = target.padded(max_nodes + 1 + (drafter.extra_tokens(max_nodes) if drafter else 0))  # a step's forward
    capacity = max(longest + max_new_tokens + widest, target.padded(longest))
    cache = target.new_cache(len(prompts), capacity)
    active = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # the prompt each cache row decodes
    rows = [prompts[i] for i in active]  # shortest first, so that prefill chunks waste little on padding
    keys = torch.tensor(range(len(prompts)) if keys is None else keys, device=device)
    generator = None if sampling.keyed else torch.Generator(device=device).manual_seed(seed)
    method = _Method(target, drafter, policy, budget, sampling, seed, keys, generator, capture, recorder,
                     Stopper(target.eos_ids, max_new_tokens, stop_strings, target.tokenizer), Clock(device))

    t0 = now(device)
    last_hidden, features = _prefill(target, rows, cache, capture)
    first_logits = target.logits(last_hidden)  # [B, V]
    first = _first_tokens(first_logits, sampling, seed, keys[active], generator)
    decoding = Decoding([Generation([], "") for _ in prompts], prefill_s=now(device) - t0)
    recorder.record(active, [len(p) for p in rows], features, first_logits)
    keep = _extend_outputs(decoding, active, [[t] for t in first], method.stopper, step=False)
    if drafter is not None:
        drafter.reset(len(prompts), capacity)
        budget.reset()
    ctx = DraftContext([list(p) + [t] for p, t in zip(rows, first)], features, [len(p) for p in rows], cache)
    batch = _Batch(cache, ctx, _keep_rows(keep, active, cache, drafter, ctx), decoding)
    while batch.active:
        decoding.steps.append(_step(method, batch))
    recorder.finish(prompts, [g.tokens for g in decoding.generations])
    return decoding


def _check_method(drafter: Drafter | None, policy, budget: Budget | None, recorder: Recorder, sampling: Sampling) -> tuple[int, ...]:
    """Refuse a method that cannot run; return the target layers its forwards capture."""
    if drafter is not None and (policy is None or budget is None):
        raise ValueError("A drafter needs a tree policy and a budget controller.")
    if drafter is not None and drafter.proposes_trees and not sampling.keyed:
        raise ValueError("A drafter that grows its own trees (EAGLE-3) drafts ranked children only: use decode.tree_mode=ranked.")
    capture = tuple(drafter.feature_layers) if drafter else recorder.layers
    if recorder.layers and recorder.layers != capture:
        raise ValueError("A recorder must record the drafter's feature layers (or be used without a drafter).")
    if recorder.top_k and drafter is not None:
        raise ValueError("Top-k recording records AR decoding's distributions: use it without a drafter.")
    return capture


def _step(m: _Method, batch: _Batch) -> Step:
    """One decode step: draft, build and size the trees, verify them in one target forward,
    accept, commit the KV cache, and let finished rows leave the batch."""
    device, ctx, cache, clock = m.target.device, batch.ctx, batch.cache, m.clock
    t0 = clock.mark()
    graphs = compiled_graphs()
    proposal = None
    if m.drafter is not None:
        if m.budget.drafts():
            if m.drafter.proposes_trees:
                ctx.max_depth = m.budget.max_depth()
            proposal = m.drafter.propose(ctx)
        else:  # the budget chose an AR step; the drafter still reads the new tokens
            m.drafter.absorb(ctx)
    t1 = clock.mark()
    contexts = list(cache.lengths)
    if proposal is None:
        trees, draft_probs = [DraftTree.root_only(seq[-1]) for seq in ctx.sequences], None
    else:
        trees, draft_probs = _draft_trees(m, proposal, contexts)
    packed = pack(trees, device)
    tokens, depths, tree_mask = packed.tokens, packed.depths, packed.mask
    if proposal is not None:  # whether FlexDraft drafts inside the verification forward: host work, not the forward's
        parallel = m.budget.parallel(tokens.shape[1], lambda: m.drafter.parallel_tokens(trees), contexts)
    t2 = clock.mark()
    if proposal is None:
        hidden, features = m.target.forward(tokens, depths, tree_mask, cache, m.capture)
        width = 1
    else:  # the drafter's verification forward
        hidden, features, width = m.drafter.verify_forward(m.target, cache, trees, tokens, depths, tree_mask, m.capture, parallel)
    scores = _scores(m, batch, hidden, depths, packed.depth)
    t3 = clock.mark()
    verdicts = _verify(m, scores, trees, packed, draft_probs)  # waits for the device once
    paths = [v.path for v in verdicts]
    cache.commit(paths)
    if proposal is not None:
        m.drafter.accept(paths)
    if m.capture:
        features = _gather_paths(features, paths)
    committed = [len(p) for p in paths]
    m.recorder.record(batch.active, committed, features, m.target.logits(hidden[:, 0]) if m.recorder.top_k else None)
    batch.ctx = DraftContext([seq + v.tokens for seq, v in zip(ctx.sequences, verdicts)], features, committed, cache)
    keep = _extend_outputs(batch.decoding, batch.active, [v.tokens for v in verdicts], m.stopper, step=True)
    rows, batch.active = batch.active, _keep_rows(keep, batch.active, cache, m.drafter, batch.ctx)
    t4 = clock.mark()
    step = Step(rows, [t.n_nodes for t in trees], [len(v.tokens) for v in verdicts], [t.expected_accepted() for t in trees],
                draft_s=clock.seconds(t0, t1), verify_s=clock.seconds(t2, t3),
                other_s=clock.seconds(t1, t2) + clock.seconds(t3, t4),
                predicted_verify_s=m.budget.predicted_s if proposal is not None else None, drafted=proposal is not None,
                compiled=compiled_graphs() > graphs, paths=paths if m.sampling.keyed else [])
    if m.drafter is not None and not step.compiled:  # a compiling step's times would mislead the budget's forecasts
        m.budget.observe(step, contexts, width)  # width: what ran, the trees plus parallel drafting's mask groups
        step.other_s += clock.seconds(t4, clock.mark())  # the controller's own refits are part of the step
    return step


def _draft_trees(m: _Method, proposal, contexts: list[int]):
    """The policy's trees sized by the budget; with sampled children at T > 0 their children
    drawn from the draft distributions q [B, K, V] (returned too, for verification)."""
    trees = m.budget.size(m.policy(proposal, m.budget.max_nodes), contexts)
    if m.sampling.keyed:
        return trees, None
    draft_probs = proposal.distributions(m.sampling, m.target.args.vocab_size)
    return sample_children(trees, draft_probs, m.generator), draft_probs


def _scores(m: _Method, batch: _Batch, hidden: torch.Tensor, depths: torch.Tensor, depth: int) -> torch.Tensor:
    """What verification reads of the forward's hidden states [B, M, h], the device's part of
    it: the target's choice after each node [B, M] (its argmax, without float32 logits, or the
    argmax of keyed scores, a chunk of nodes at a time), or for sampled children the hidden
    states themselves (verify_sampled makes logits where its descent goes). `depth`: no node
    is deeper."""
    if m.sampling.greedy:
        return m.target.argmax(hidden)
    if not m.sampling.keyed:
        return hidden
    start = to_device([len(batch.decoding.generations[i].tokens) for i in batch.active], hidden.device)  # [B] output position after each root
    keys = m.keys[to_device(batch.active, m.keys.device, torch.long)]  # indexed by a host list, a GPU would wait for a blocking copy
    noise = m.sampling.noise(m.seed, keys, start, depth + 1, m.target.args.vocab_size)  # [B, depth + 1, V]

    def keyed(logits: torch.Tensor, nodes: slice) -> torch.Tensor:
        return m.sampling.scores(logits, noise, depths[:, nodes])

    return m.target.argmax(hidden, score=keyed)


def _verify(m: _Method, scores: torch.Tensor, trees: list[DraftTree], packed: Packed, draft_probs):
    """Each row's accepted path and new tokens: the deepest node the target's choices agree
    with, or by rejection sampling of sampled children."""
    if m.sampling.keyed:  # greedy included
        return verify_greedy(scores, trees, packed)
    rows = torch.arange(len(trees), device=scores.device)

    def target_probs(node: torch.Tensor) -> torch.Tensor:  # [B] -> [B, V]: p after each row's node
        return m.sampling.probs(m.target.logits(scores[rows, node]))

    return verify_sampled(target_probs, trees, m.generator, draft_probs, packed.tokens, packed.parents, packed.depth)


def _first_tokens(logits: torch.Tensor, sampling: Sampling, seed: int, keys: torch.Tensor, generator) -> list[int]:
    """The token prefill produces (output position 0) per row from logits [B, V]."""
    if sampling.keyed:
        zeros = torch.zeros(len(keys), 1, dtype=torch.long, device=logits.device)
        noise = sampling.noise(seed, keys, zeros[:, 0], 1, logits.shape[-1])  # [B, 1, V]
        return sampling.scores(logits[:, None], noise, zeros)[:, 0].argmax(-1).tolist()
    return torch.multinomial(sampling.probs(logits), 1, generator=generator)[:, 0].tolist()


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
        hidden, captured = target.forward(tokens, depths, None, cache.row_range(start, stop), capture)
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
    index = to_device([p + [p[-1]] * (width - len(p)) for p in paths], features.device)
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
        ctx.features = ctx.features[to_device(keep, ctx.features.device, torch.long)]  # (an empty list: no rows)
    return [active[r] for r in keep]
