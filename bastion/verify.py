"""Acceptance of a draft tree against the target's logits."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bastion.models.transfer import to_device
from bastion.tree.draft_tree import DraftTree, Packed

SAMPLED_PARENTS = 128  # nodes whose children are drawn together: [128, V] noise, not [B x N, V] (GBs at paper scale)


@dataclass
class Verdict:
    """One row's outcome of a verification pass."""

    path: list[int]  # accepted tree indices from the root (index 0) down; their KV is kept
    tokens: list[int]  # new tokens: the accepted draft tokens, then the target's bonus token


def verify_greedy(choice: torch.Tensor, trees: list[DraftTree], packed: Packed) -> list[Verdict]:
    """Accept the deepest node whose every ancestor's token is the target's choice after its
    parent (the argmax of logits, or of keyed scores at T > 0); the choice after it is the
    bonus token. choice: [B, M], after each of pack's nodes (padding slots are roots).

    Decided on the device for every node at once (whether each node on its path matched: one
    gather of the packed ancestors), then one transfer of each row's deepest accepted node and
    bonus token: a step waits for the device once, whatever the trees' size."""
    tokens, depths, parents, ancestors = packed.tokens, packed.depths, packed.parents, packed.ancestors
    matched = tokens == choice.gather(1, parents.clamp(min=0))  # [B, M]: the node's token is the choice after its parent
    matched[:, 0] = True  # the root is verified (padding slots, roots too, are no node's ancestors: they need no verdict)
    accepted = matched.expand_as(ancestors).gather(2, ancestors).all(0)  # [B, M]: and so did every ancestor's
    deepest = (depths * accepted).argmax(-1)  # [B]; the first such node, should siblings repeat a token
    out = torch.stack([deepest, choice.gather(1, deepest[:, None])[:, 0]], 1).tolist()  # [B, 2]
    verdicts = []
    for tree, (node, bonus) in zip(trees, out):
        path = tree.path(node)
        verdicts.append(Verdict(path, [int(tree.tokens[i]) for i in path[1:]] + [bonus]))  # a few nodes: no array of them
    return verdicts


def verify_sampled(
    target_probs: Callable[[torch.Tensor], torch.Tensor],
    trees: list[DraftTree],
    generator: torch.Generator,
    draft_probs: torch.Tensor | None,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depth: int,
) -> list[Verdict]:
    """Temperature > 0 with sampled children: multi-draft recursive rejection sampling down
    the tree (SpecInfer, Sequoia). Ranked children need none of this: they are verified
    greedily against keyed Gumbel-max scores (sampling.py).

    At each node the children, drawn from q = draft_probs [B, K, V] without replacement, are
    tried in order against the target's distribution p there: child x is accepted w.p.
    min(1, p(x)/q(x)); on rejection p <- norm(max(p - q, 0)) and q loses x. When every child
    is rejected the bonus token is drawn from what is left of p, so the output is distributed
    exactly as AR sampling from p. `target_probs(node)` gives p after each row's node [B] as
    [B, V]: the target's logits are made a level at a time, only where the descent is, not for
    every node ([B, M, V] float32: 2.5 GB at B=16, M=257, 152k tokens). `draft_probs` is None
    only for root-only trees (AR steps); tokens, parents: [B, M], pack's (padding slots are
    roots); no node is deeper than `depth`.

    Every row descends at once on the device, a level and a child slot at a time ([B, V] ops,
    depth x most children rounds), and the paths come back in one transfer."""
    B, device = len(trees), tokens.device
    most = max((len(kids) for tree in trees for kids in tree.children), default=0)
    rows = torch.arange(B, device=device)
    node, live = torch.zeros(B, dtype=torch.long, device=device), torch.ones(B, dtype=torch.bool, device=device)
    p, bonus, steps = target_probs(node), torch.zeros(B, dtype=torch.long, device=device), []
    for level in range(depth + 1):
        chosen = torch.full((B,), -1, device=device)
        if most and level < depth:
            q, kids = draft_probs[:, level], parents == node[:, None]  # [B, V], [B, M]: the node's children
            rank = kids.cumsum(1) - 1  # [B, M]: a child's place among its siblings
            for j in range(most):
                jth = kids & (rank == j)
                c = torch.where(jth.any(1), jth.int().argmax(1), -1)  # [B]: the node's j-th child, or none
                x = tokens[rows, c.clamp_min(0)]
                u = torch.rand(B, generator=generator, device=device, dtype=p.dtype)
                trying = live & (c >= 0) & (chosen < 0)
                accept = trying & (u * q[rows, x] < p[rows, x])
                chosen = torch.where(accept, c, chosen)
                reject = (trying & ~accept)[:, None]
                residual = (p - q).clamp_min(0.0)
                total = residual.sum(-1, keepdim=True)
                p = torch.where(reject & (total > 0), residual / total, p)  # total = 0 only when p == q up to rounding
                q = torch.where(reject, q.scatter(1, x[:, None], 0.0), q)
                q = torch.where(reject, q / q.sum(-1, keepdim=True), q)
        drawn = torch.multinomial(p, 1, generator=generator)[:, 0]
        bonus = torch.where(live & (chosen < 0), drawn, bonus)
        live = live & (chosen >= 0)
        steps.append(torch.where(live, chosen, -1))
        node = torch.where(live, chosen, node)
        if level < depth:  # the last level's p is never read
            p = torch.where(live[:, None], target_probs(node), p)
    verdicts = []
    for tree, (*path, last) in zip(trees, torch.stack([*steps, bonus], 1).tolist()):  # [B, depth + 2]
        path = [0, *(n for n in path if n >= 0)]
        verdicts.append(Verdict(path, tree.tokens[path[1:]].tolist() + [last]))
    return verdicts


def sample_children(trees: list[DraftTree], draft_probs: torch.Tensor, generator: torch.Generator) -> list[DraftTree]:
    """The trees' shapes with each node's children drawn from q without replacement, the nodes
    of every row together (SAMPLED_PARENTS at a time): the k largest of log q + Gumbel noise
    are such a draw of k.

    draft_probs: [B, K, V], row d being q for depth d + 1. A node keeps at most as many children
    as q has tokens of nonzero probability; dropped children take their subtrees with them.
    """
    parents = [(b, node, depth) for b, tree in enumerate(trees)
               for node, (kids, depth) in enumerate(zip(tree.children, tree.depths.tolist())) if kids]
    if not parents:
        return trees
    most = max(len(kids) for tree in trees for kids in tree.children)
    b, depth = to_device([(b, depth) for b, _, depth in parents], draft_probs.device).unbind(1)
    chunks = []
    for rows, depths in zip(b.split(SAMPLED_PARENTS), depth.split(SAMPLED_PARENTS)):
        q = draft_probs[rows, depths]  # [P, V]
        u = torch.rand(q.shape, generator=generator, device=q.device, dtype=q.dtype).clamp_min(torch.finfo(q.dtype).tiny)  # rand's 0 would bar a token
        draws = (q.log() - (-u.log()).log()).topk(most, dim=-1).indices  # [P, most]
        logq = q.gather(1, draws).log()  # -inf: past q's nonzero tokens
        chunks.append(torch.stack([draws.to(logq.dtype), logq], 1))
    drawn = iter(torch.cat(chunks).tolist())  # one transfer: per parent, its draws and their log q
    sampled = []
    for tree in trees:
        tokens, tree_parents, tree_logq, tree_depths, renumbered = [int(tree.tokens[0])], [-1], [0.0], [0], {0: 0}
        for node, kids in enumerate(tree.children):
            if not kids:
                continue
            xs, qs = next(drawn)
            if node not in renumbered:
                continue
            for kid, x, qx in zip(kids, xs, qs):
                if qx == -math.inf:
                    break
                renumbered[kid] = len(tokens)
                tokens.append(int(x))
                tree_parents.append(renumbered[node])
                tree_logq.append(tree_logq[renumbered[node]] + qx)
                tree_depths.append(tree_depths[renumbered[node]] + 1)
        sampled.append(DraftTree(tokens, tree_parents, tree_logq, known_depths=tree_depths))
    return sampled
