"""FlexDraft: an attention-tuned drafter that is the frozen target itself.

Drafting is a target forward of a group of G mask tokens placed right after a verified prefix.
In the last L layers mask tokens use a trainable copy of the attention projections (Q/K/V/O);
everywhere else, and always for clean tokens, the target's own weights run. Mask tokens see
the clean prefix (the target's KV cache) and, bidirectionally, their own group, never another
group; their K/V are scratch and never enter the cache. The first mask sits where the bonus
token goes (still unknown when drafting in parallel with verification); masks 2..G predict
the K = G - 1 tokens after it. With `bonus=clean` that first slot is the bonus token itself,
known once verification has ended: such a drafter drafts after verification only. That slot
sees the prefix and itself only, so the forward is, for it, the target's own: its hidden state
is the target's at the bonus, and the first draft is the target's own next token (the mask
after it is a placeholder the later masks attend to). A bonus-guided calibration MLP on [guide,
mask hidden state] adds a bias to the masks' logits; the guide is the embedding of the bonus
the verifier produced (steering drafts made before the bonus was known towards it) or, with a
clean bonus, the target's hidden state at it, which says more. Trained on math and code
answers, the MLP can steer the wrong way on other text; `calibration=auto` keeps it only while
it measurably helps: every drafted
step, the top-1 drafts with and without it are both scored against the tokens the target then
produced (an unbiased race on the same positions, free: both logits exist), and the drafts
come from whichever has won more steps in this decode.

Drafting runs after each verification (one extra, small forward: sequential) or rides along
the verification forward (parallel), with one group per tree node (every possible accepted
path), keeping only groups whose draft confidence passes *selective verification*. Which one a
step runs, and whether it drafts at all, is the budget's decision (budget/base.py: `mode`,
`pause_drafting`; flex decoding is `budget.mode=flex`).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from bastion.drafters.base import DraftContext, Drafter, DraftVocabulary
from bastion.drafters.checkpoint import read_checkpoint
from bastion.models.attention import attend, within_group
from bastion.models.kv_cache import KVCache
from bastion.models.target import Target
from bastion.models.transfer import to_device
from bastion.tree.draft_tree import DraftTree
from bastion.tree.proposal import BlockProposal, top_candidates

CALIBRATION = ("on", "off", "auto")
SELECTIONS = ("min_confidence", "cumulative_product")
BONUS = ("mask", "clean")
CLEAN_FIRST_SLOT = "target"  # a clean bonus slot runs as the target's own token (drafters trained before saw their masks)


class FlexDraftDrafter(nn.Module, DraftVocabulary, Drafter):
    def __init__(self, target: Target, tuned_layers: int = 4, group_size: int = 8, calibration_hidden: int = 256,
                 selection: str = "min_confidence", threshold: float = 0.1, top_k: int = 8,
                 mask_token_id: int | None = None, draft_vocab_size: int | None = None, bonus: str = "mask"):
        super().__init__()
        args = target.args
        if not 1 <= tuned_layers <= args.n_layers:
            raise ValueError(f"drafter.tuned_layers must be in 1..{args.n_layers} for {target.name} (got {tuned_layers}).")
        if group_size < 2:
            raise ValueError(f"drafter.group_size must be at least 2 (the bonus slot plus one draft; got {group_size}).")
        if selection not in SELECTIONS:
            raise ValueError(f"drafter.selection must be one of {', '.join(SELECTIONS)} (got {selection}).")
        if bonus not in BONUS:
            raise ValueError(f"drafter.bonus must be one of {', '.join(BONUS)} (got {bonus}).")
        self.bonus = bonus  # the group's first slot: a mask where the bonus goes (the paper's), or the bonus token itself
        self.target = target  # a plain dataclass: frozen weights, not registered here
        self.first_tuned = args.n_layers - tuned_layers
        self.group_size, self.top_k = group_size, top_k
        self.selection, self.threshold = selection, threshold
        self.calibration_mode = "on"  # the MLP: on | off | auto (while it wins; see the module docstring)
        self._race: tuple[torch.Tensor, torch.Tensor] | None = None  # auto: top-1 drafts [B, K] without / with the MLP at the last draft
        self.mlp_wins = [0, 1]  # auto: steps won without / with the MLP in this decode (a prior of one win for the MLP)
        self.tuned = nn.ModuleList(copy.deepcopy(target.model.layers[i].self_attn) for i in range(self.first_tuned, args.n_layers))
        self.tuned.requires_grad_(True)  # copies of a frozen target's weights would stay frozen
        embed = target.model.embed_tokens.weight
        start = embed[mask_token_id] if mask_token_id is not None else embed.mean(0)
        self.mask_embedding = nn.Parameter(start.detach().clone())
        # an optional draft vocabulary (DraftVocabulary): the head and the calibration bias cover it alone
        self.register_buffer("draft_vocab", torch.arange(draft_vocab_size) if draft_vocab_size else None)
        self.calibration = nn.Sequential(nn.Linear(2 * args.hidden_size, calibration_hidden), nn.SiLU(),
                                         nn.Linear(calibration_hidden, draft_vocab_size or args.vocab_size))
        nn.init.zeros_(self.calibration[2].weight)  # starts as "no correction"
        nn.init.zeros_(self.calibration[2].bias)
        self.config = {"architectures": ["FlexDraftDrafter"], "target": target.name, "num_target_layers": args.n_layers,
                       "hidden_size": args.hidden_size, "vocab_size": args.vocab_size, "tuned_layers": tuned_layers,
                       "group_size": group_size, "calibration_hidden": calibration_hidden, "bonus": bonus,
                       **({"first_slot": CLEAN_FIRST_SLOT} if bonus == "clean" else {}),
                       **({"draft_vocab_size": draft_vocab_size} if draft_vocab_size else {})}
        self._pending: dict[int, torch.Tensor] = {}  # row -> hidden of the group drafted for its accepted node
        self._groups = None  # (kept nodes, their groups' hidden states) of a parallel verification
        self._lengths: list[int] | None = None  # auto: rows' sequence lengths when the raced drafts were made

    # ---- the forward shared by drafting, parallel verification and training -------------------
    def run_layers(self, x, positions, mask, is_mask, extend_kv, layers: range | None = None):
        """Target layers over clean and mask tokens together. x: [B, N, h]; is_mask: [B, N, 1]
        (None: every token is a mask, and the target's own projections are not computed);
        mask: a Layout, training's Groups or a dense [B, 1, N, S] mask (models/attention.py); extend_kv(layer) -> the K/V extender of that layer. `layers`: a
        range of them (all by default); the final norm follows the last."""
        model = self.target.model
        layers = range(len(model.layers)) if layers is None else layers
        cos, sin = model.rotary(positions, x.dtype)
        for i in layers:
            layer = model.layers[i]
            if i < self.first_tuned:
                x = layer(x, cos, sin, mask, extend_kv(i))
                continue
            attn, tuned = layer.self_attn, self.tuned[i - self.first_tuned]
            h = layer.input_layernorm(x)
            k, v = _per_token(is_mask, lambda a: a.keys_values(h, cos, sin), tuned, attn, heads=True)
            k, v = extend_kv(i)(k, v)
            (q,) = _per_token(is_mask, lambda a: (a.queries(h, cos, sin),), tuned, attn, heads=True)
            out = attend(q, k, v, mask)
            (o,) = _per_token(is_mask, lambda a: (a.o_proj(out),), tuned, attn, heads=False)
            x = x + o
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.norm(x) if layers.stop == len(model.layers) else x

    def calibration_input(self, hidden: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        """Group hidden states [..., G, h] and bonus tokens [...] -> the MLP's input [..., G-1, 2h]
        for each mask after the first slot: [guide, the mask's hidden state]."""
        masks = hidden[..., 1:, :]
        guide = hidden[..., :1, :] if self.bonus == "clean" else self.target.model.embed_tokens(bonus)[..., None, :]
        return torch.cat([guide.to(masks.dtype).expand_as(masks), masks], dim=-1)

    def draft_logits(self, hidden: torch.Tensor, bonus: torch.Tensor, plain: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Group hidden states [..., G, h] and bonus tokens [...] -> draft logits [..., G-1, V]
        (float32, -inf outside the draft vocabulary) for the tokens after the bonus, without and
        with the calibration MLP's bias (None when calibration is off; the plain ones None with
        `plain=False` and calibration on: a decode that reads only the calibrated ones does not
        make [B, G-1, V] float32 twice). With a clean bonus the first draft is the target's own,
        over its whole vocabulary (the draft head would be cheaper, but misses the target's
        choice wherever it lies outside the draft vocabulary, more often on chat than the time
        saved repays), and the MLP leaves it be."""
        drafts = self.draft_head(hidden[..., 1:, :]).float()  # [..., G-1, V']
        own = self.target.model.lm_head(hidden[..., :1, :]).float() if self.bonus == "clean" else None  # [..., 1, V]

        def in_full(logits: torch.Tensor) -> torch.Tensor:  # [..., G-1, V'] -> [..., G-1, V]
            logits = self.in_full_vocab(logits)
            if own is not None:
                logits[..., :1, :] = own
            return logits

        if self.calibration_mode == "off":
            return in_full(drafts), None
        calibrated = in_full(drafts + self.calibration(self.calibration_input(hidden, bonus)).float())
        return in_full(drafts) if plain else None, calibrated

    def uses_mlp(self) -> bool:
        return self.calibration_mode == "on" or (self.calibration_mode == "auto" and self.mlp_wins[1] >= self.mlp_wins[0])

    # ---- decoding -------------------------------------------------------------------------------
    def reset(self, batch_size: int, capacity: int) -> None:
        self._pending, self._lengths, self._race, self._groups = {}, None, None, None
        self.mlp_wins = [0, 1]

    def keep_rows(self, rows: list[int]) -> None:
        self._pending = {new: self._pending[old] for new, old in enumerate(rows) if old in self._pending}
        if self._lengths is not None:
            self._lengths = [self._lengths[r] for r in rows]
        if self._race is not None:
            index = to_device(rows, self._race[0].device, torch.long)  # a host list as an index: a blocking copy on a GPU
            self._race = tuple(drafts[index] for drafts in self._race)

    def absorb(self, ctx: DraftContext) -> None:
        """An AR step (the budget's choice): groups drafted for this step are stale by the next."""
        self._score_race(ctx)
        self._pending = {}

    def _score_race(self, ctx: DraftContext) -> None:
        """calibration=auto: score the last drafted step's race of top-1 drafts without and
        with the MLP against what the target produced (accepted drafts + bonus); the one that
        matches further wins, ties teach nothing."""
        if self._race is None:
            return
        width = self._race[0].shape[1]  # every row at once: one send, one read
        rows = [seq[n : n + width] for seq, n in zip(ctx.sequences, self._lengths)]
        truth = to_device([row + [-1] * (width - len(row)) for row in rows], self._race[0].device)  # [B, G-1]; -1: nothing yet
        matched = torch.stack([(drafts == truth).int().cumprod(1).sum(1) for drafts in self._race])  # [2, B]
        for plain, with_mlp in zip(*matched.tolist()):
            if plain != with_mlp:
                self.mlp_wins[with_mlp > plain] += 1
        self._lengths = self._race = None

    def extra_tokens(self, max_nodes: int) -> int:
        return mask_slots(self.group_size, max_nodes)

    @property
    def drafts_inside_verification(self) -> bool:
        """A group that reads the bonus token drafts only after verification, once it is known."""
        return self.bonus == "mask"

    @property
    def draft_tokens(self) -> int:
        """A sequential draft is a forward of one group through the target's layers."""
        return self.group_size

    def parallel_tokens(self, trees: list[DraftTree]) -> tuple[int, int]:
        """Drafting inside the verification forward adds the kept nodes' groups; after it, a
        forward of one group."""
        if not self.drafts_inside_verification:
            return 0, 0
        return max(len(self.selected_nodes(t)) for t in trees) * self.group_size, self.draft_tokens

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> BlockProposal:
        self._score_race(ctx)
        roots = [seq[-1] for seq in ctx.sequences]
        B = len(roots)
        hidden = [self._pending.get(b) for b in range(B)]
        missing = [b for b in range(B) if hidden[b] is None]
        if missing:  # sequential drafting (or a parallel group that selective verification pruned)
            drafted = self.draft_after_prefix(ctx.cache, missing, roots)
            for b, h in zip(missing, drafted):
                hidden[b] = h
        self._pending = {}
        device = self.mask_embedding.device
        plain, calibrated = self.draft_logits(torch.stack(hidden), to_device(roots, device), plain=self.calibration_mode != "on")
        if self.calibration_mode == "auto":
            self._lengths, self._race = [len(s) for s in ctx.sequences], (plain.argmax(-1), calibrated.argmax(-1))
        return top_candidates(calibrated if self.uses_mlp() else plain, roots, self.top_k)

    def draft_after_prefix(self, cache: KVCache, rows: list[int], roots: list[int]) -> list[torch.Tensor]:
        """One group per row in `rows`, right after its verified prefix (its first slot the root,
        the bonus the last verification produced, where `bonus` is clean): [G, h] each."""
        B, G = len(cache.lengths), self.group_size
        device = self.mask_embedding.device
        tree_mask = within_group(G, self.bonus == "clean", device).expand(B, G, G)
        write_pos, mask = cache.prepare(G, tree_mask)
        x, is_mask = self.group_inputs(to_device(roots, device))
        hidden = self.run_layers(x, write_pos, mask, is_mask, lambda i: _writer(cache, i, write_pos, mask))
        return [hidden[b] for b in rows]

    def group_inputs(self, bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Groups' inputs [..., G, h] and which slots are masks [..., G, 1] (None: all of them),
        for bonus tokens [...]: mask embeddings, the first slot the bonus's embedding where
        `bonus` is clean. Shared by drafting and training."""
        x = self.mask_embedding.expand(*bonus.shape, self.group_size, -1)
        if self.bonus == "mask":
            return x, None
        first = (torch.arange(self.group_size, device=bonus.device) == 0)[:, None]  # [G, 1]
        x = torch.where(first, self.target.model.embed_tokens(bonus)[..., None, :].to(x.dtype), x)
        return x, ~first.expand(*bonus.shape, self.group_size, 1)

    def verify_forward(self, target, cache: KVCache, trees: list[DraftTree], tokens, depths, tree_mask, capture,
                       parallel: bool = False):
        """Draft inside the verification forward when the budget says so (`parallel`), else
        verify with the target's own forward (and draft after it, in propose)."""
        self._groups = None
        if not parallel:
            return super().verify_forward(target, cache, trees, tokens, depths, tree_mask, capture)
        hidden, width = self.verify_and_draft(cache, trees, tokens, depths, tree_mask)
        return hidden, None, width

    @torch.inference_mode()
    def verify_and_draft(self, cache: KVCache, trees: list[DraftTree], tokens, depths, tree_mask):
        """Parallel mode: verify `trees` and, in the same forward, draft one group after every
        node that selective verification keeps. Returns the clean tokens' final hidden states
        [B, M, h] and the tokens per row the forward ran; the groups wait for propose()."""
        B, M = tokens.shape
        G = self.group_size
        device = tokens.device
        keep = [self.selected_nodes(t) for t in trees]
        full, group_depth = group_layout(tree_mask, depths, keep, G)
        N, n_groups = full.shape[1], group_depth.shape[1]
        x = torch.cat([self.target.model.embed_tokens(tokens), self.mask_embedding.expand(B, n_groups * G, -1)], dim=1)
        write_pos, mask = cache.prepare(N, full)
        base = write_pos[:, :1]  # the root's slot is its position
        mask_pos = (base + group_depth)[:, :, None] + torch.arange(G, device=device)
        positions = torch.cat([base + depths, mask_pos.flatten(1)], dim=1)
        is_mask = (torch.arange(N, device=device) >= M)[None, :, None].expand(B, N, 1)
        hidden = self.run_layers(x, positions, mask, is_mask, lambda i: _writer(cache, i, write_pos, mask))
        self._groups = (keep, hidden[:, M:].view(B, n_groups, G, -1))
        return hidden[:, :M], N

    def accept(self, paths: list[list[int]]) -> None:
        """After parallel verification: keep the group drafted after each row's last accepted node."""
        if self._groups is None:
            return
        (keep, groups), self._groups = self._groups, None  # read once: the forward's hidden states are freed after
        self._pending = {b: groups[b, keep[b].index(path[-1])] for b, path in enumerate(paths) if path[-1] in keep[b]}

    def selected_nodes(self, tree: DraftTree) -> list[int]:
        """Selective verification: the nodes worth a draft group (the root always is).
        min_confidence keeps node i when its path probability reaches the threshold;
        cumulative_product keeps nodes by decreasing path probability until they cover the
        threshold's complement of the probability that some path ends there."""
        probs = [math.exp(s) for s in tree.logq.tolist()]
        if self.selection == "min_confidence":
            return [i for i, p in enumerate(probs) if i == 0 or p >= self.threshold]
        order = sorted(range(len(probs)), key=lambda i: -probs[i])
        kept, covered = [], 0.0
        for i in order:
            kept.append(i)
            covered += probs[i]
            if covered >= (1 - self.threshold) * sum(probs):
                break
        return sorted(set(kept) | {0})

    # ---- checkpoints ------------------------------------------------------------------------------

def group_layout(tree_mask: torch.Tensor, depths: torch.Tensor, keep: list[list[int]], G: int):
    """Parallel mode's attention over a verified tree of M tokens and one group of G mask tokens
    after each kept node: tree_mask [B, M, M], depths [B, M], keep[b] the nodes of row b that
    get a group. Returns the mask [B, N, N] (N = M + K * G, K the most groups a row has) and
    each group's depth [B, K]. Tree tokens see their ancestors; a group sees its node's path and
    itself; a row's groups past its own keep see only themselves, at depth 0. Built with no
    per-node tensor op (a row of 16 groups at B=16 was 256 slice writes a step)."""
    B, M, _ = tree_mask.shape
    K, device = max(1, max(map(len, keep))), tree_mask.device
    nodes = to_device([k + [0] * (K - len(k)) for k in keep], device)  # [B, K]
    real = to_device([[g < len(k) for g in range(K)] for k in keep], device)  # [B, K]
    full = torch.zeros(B, M + K * G, M + K * G, dtype=torch.bool, device=device)
    full[:, :M, :M] = tree_mask
    sees = tree_mask.gather(1, nodes[:, :, None].expand(B, K, M)) & real[:, :, None]  # [B, K, M]
    full[:, M:, :M] = sees.repeat_interleave(G, dim=1)
    full[:, M:, M:] = torch.eye(K, dtype=torch.bool, device=device).repeat_interleave(G, 0).repeat_interleave(G, 1)
    return full, torch.where(real, depths.gather(1, nodes) + 1, 0)


def _per_token(is_mask, project, tuned, attn, heads: bool) -> tuple[torch.Tensor, ...]:
    """`project(module)`'s outputs with the tuned attention for mask tokens and the target's
    for clean ones (is_mask [B, N, 1]; None: all masks, the target's not computed). heads:
    outputs are [B, H, N, D] rather than [B, N, h]."""
    masked = project(tuned)
    if is_mask is None:
        return masked
    sel = is_mask[:, None] if heads else is_mask  # [B, 1, N, 1] broadcast over heads
    return tuple(torch.where(sel, m, c) for m, c in zip(masked, project(attn)))


def _writer(cache: KVCache, layer: int, write_pos, mask):
    return lambda k, v: cache.write(layer, k, v, write_pos, mask.n_keys)


def mask_slots(group_size: int, max_nodes: int) -> int:
    """Cache slots a verification forward may need beyond its tree: the mask groups of every
    node and the root (drafting inside it). The memory plan counts them before any loading."""
    return (max_nodes + 1) * group_size


def load_flexdraft(target: Target, checkpoint: str | None, selection: str = "min_confidence", threshold: float = 0.1,
                   top_k: int = 8, calibration: bool | str = True, bonus: str | None = None) -> FlexDraftDrafter:
    calibration_mode = {True: "on", False: "off"}.get(calibration, calibration)
    if calibration_mode not in CALIBRATION:
        raise ValueError(f"drafter.calibration must be true, false or auto (got {calibration}).")
    config, state = read_checkpoint(checkpoint, "flexdraft", target.name)
    a = target.args
    if (config["num_target_layers"], config["hidden_size"], config["vocab_size"]) != (a.n_layers, a.hidden_size, a.vocab_size):
        raise ValueError(
            f"This FlexDraft drafter was trained for {config['target']} ({config['num_target_layers']} layers, hidden "
            f"{config['hidden_size']}, vocab {config['vocab_size']}); target {target.name} has {a.n_layers}, {a.hidden_size}, {a.vocab_size}."
        )
    if config.get("bonus") == "clean" and config.get("first_slot") != CLEAN_FIRST_SLOT:
        raise ValueError(f"This FlexDraft drafter ({checkpoint}) was trained with a bonus slot that saw its masks, which "
                         f"drafting no longer runs; retrain it: python train.py drafter=flexdraft target={target.name}")
    drafter = FlexDraftDrafter(target, config["tuned_layers"], config["group_size"], config["calibration_hidden"],
                               selection, threshold, top_k, draft_vocab_size=config.get("draft_vocab_size"),
                               bonus=bonus or config.get("bonus", "mask"))  # by default the layout it was trained with
    drafter.load_state_dict(state)
    drafter.calibration_mode = calibration_mode
    return drafter.to(device=target.device, dtype=target.dtype).eval()
