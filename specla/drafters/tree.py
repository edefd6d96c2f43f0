"""Draft trees: beam top-k rollout, confidence pruning, packing (SpecLA §6.1, Fig. 8).

A rollout proposes nodes depth by depth. Depth 1: the root's top-k tokens, the best w of
which are the first beams (w, the beam width, is k unless asked: w <= k). Each later depth:
every beam proposes its top-k children, all w·k of them join the *pool*, and the w best by
cumulative log-probability become the next beams. Width 1 is a chain that also offers each
depth's runners-up as leaves: a chain's drafter forwards buy a tree of alternatives. Every
pool node v carries

    q(v) = Σ_{i ≤ depth(v)} log p_draft(t_i | prefix, t_<i)

which never increases along a path (p_draft at a temperature, 1 / `beam_search`'s scale,
1 being the drafter's own distribution: it changes which nodes are kept, never a beam's
tokens). Selection keeps the nodes with q(v) ≥ q* − τ, where q* = max_v q(v) over the whole pool (the paper's global window; it is the best depth-1
score), ranks them by q (shallower first, then pool order, among equal scores) and takes
them in that order while they fit the node budget T, each with its missing ancestors. With
monotone scores the ranked window is already ancestor-closed, so the budget simply cuts it;
the join only matters for scores that are not monotone. Packing numbers the kept nodes depth
by depth, best score first within a depth: a topological order in which every node's
children come best first, so node 1 is the drafter's best first token.

The pool is a flat list in the order the rollout proposes it (`parents[i] < i`, -1 = the
root), so selection and packing are plain functions over scores, testable without a model.
`build_batch` does select + pack for a batch of rollouts on the device, with static shapes and
no host read (the drafter's round stays inside its graph); it relies on the rollout's scores
being monotone, so it equals `build` on every pool `beam_search` produces.
`beam_search` runs the rollout on device tensors around a scoring callback (the drafter's
forward), `expand` is its per-depth step, and `entry_ancestors` the drafter-side tree mask
that lets one forward score all beams of a depth.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specla import ops
from specla.ops.beam import naive as beam_naive
from specla.precision import accumulation_dtype


class DepthPolicy(NamedTuple):
    """Each round's rollout depth from the last round report the host has read: `deep` after a
    round that accepted at least `shallow` draft tokens, else (and at the start) `shallow`.
    Acceptance runs in streaks (easy stretches of text accept whole drafts round after round),
    so a deep rollout pays off after a long acceptance and a shallow one is cheaper otherwise.
    A graphed rollout cannot stop early on the device, so the host picks the round's graph
    when it queues the round; the pipelined loop has then read the report of the round two
    before. Replayed on held-out prompts (`benchmarks/diagnostics/tree_policy.py --adaptive`),
    (6, 10) read two rounds late accepts 6.95 tokens a round against 6.65 at a fixed depth 8; on
    an H100 its rounds cost 4.6% more than depth 8's for 3.5% more tokens (docs/drafter.md), so
    it is not the default."""
    shallow: int
    deep: int

    def choose(self, accepted: int | None) -> int:
        return self.deep if accepted is not None and accepted >= self.shallow else self.shallow


def expand(beam_scores: torch.Tensor, logits: torch.Tensor, topk: int, scale: float = 1.0):
    """One depth of the rollout (`ops.beam_expand`).

    beam_scores [B, nb] are the beams' q; logits [B, nb, V] the drafter's next-token logits at
    each beam (log-probabilities up to a constant per beam). Returns the children, child j of
    beam i at i·topk + j: tokens [B, nb·topk] (each beam's top-k, best first, lower id first
    among equal scores, as AR's argmax), their scores [B, nb·topk], and beams [B, topk]: the
    flat indices of the topk best children (best first, earlier first among equal scores), the
    next beams. At top-1 (the chain drafter) and under `SPECLA_BEAM_EXPAND=torch` it traces
    the reference instead of the custom op: at top-1 that is one argmax and a log-sum-exp, which
    Inductor fuses into the step's kernels, and the op's two launches cost more (H200, demo
    pair: chain propose 0.44 ms traced against 0.50 ms with the op; the top-4 tree's 0.60 ms
    with the op against 0.67 ms traced). scale: the drafter's logits are scored times scale
    (`beam_search`).
    """
    if topk == 1 or ops.BEAM_EXPAND == "torch":
        return beam_naive.beam_expand(logits, beam_scores, topk, scale)
    return ops.beam_expand(logits, beam_scores, topk, scale)


def top1(beam_scores: torch.Tensor, logits: torch.Tensor):
    """`expand` at top-1 when nothing reads the scores (a chain without a pruning window): each
    beam's best token (lowest id among equal logits, as `expand` picks), the scores passed on
    unchanged, so no log-sum-exp over the vocabulary is formed."""
    tok = beam_naive.top_k(logits.to(accumulation_dtype(logits.dtype)), 1)[1].flatten(1)
    return tok, beam_scores, torch.zeros_like(tok)


class Head(NamedTuple):
    """A drafter's output norm and LM head, for a rollout that scores hidden states
    (`beam_search`'s head); entries > 0: the drafter's queries a rollout makes (the root, then
    width a depth, `entry_ancestors`), whose ancestor rows the depth step then also forms."""
    weight: torch.Tensor  # [V, D]
    norm_weight: torch.Tensor  # [D]
    eps: float
    entries: int = 0


def beam_search(step, root: torch.Tensor, topk: int, depth: int, tau: float | None = None,
                scored: bool = True, width: int | None = None, scale: float = 1.0,
                first: torch.Tensor | None = None, head: Head | None = None):
    """The rollout: the pool's tokens, parents (-1 = the root) and scores, [B, P] each.

    step(d, tokens, src, rows) -> logits [B, n, V] scores the n beams of depth d (d = 0: the root
    alone, tokens = root[:, None]); src[b, i] is the beam of depth d - 1 that beam i extends
    (0 at d = 1; zeros at d = 0); rows: the beams' ancestor rows where a head with entries
    formed them (else None). With tau, the rollout stops once every beam is outside the
    window: scores never increase along a path, so nothing deeper could enter it (one host
    read per depth). Without tau there is no host synchronisation: it can be graph-captured.
    scored=False (top-1 without tau): the scores stay 0 (`top1`). width: beams kept a depth
    (default topk). scale: q sums log-softmax(scale · logits), a temperature of 1 / scale on
    the drafter's distribution; it changes which nodes the budget keeps, not the tokens a
    beam proposes. first: zeros [B, 1], the src of every one-beam depth (made here if None).
    head (scored, top-k > 1): step returns the beams' hidden states [B, n, D] instead, and each
    depth scores them with `ops.head_expand`, the head's matmul inside the depth step's kernels,
    which also picks the next beams (and forms their rows): no other kernel between depths.
    """
    B, dev = root.shape[0], root.device
    width = topk if width is None else width
    # one tensor for every width-1 depth's src: inside a compiled rollout each fresh zeros that a
    # custom op (`ops.draft_inputs`) reads is a kernel of its own (8 a chain round on the H200)
    first = torch.zeros(B, 1, dtype=torch.long, device=dev) if first is None else first
    beam_tok, src = root[:, None], first
    beam_pool = torch.full((B, 1), -1, dtype=torch.long, device=dev)  # the root is no pool node
    beam_score, best, size, pool, rows = None, None, 0, [], None
    for d in range(depth):
        if best is not None and tau is not None and bool((beam_score.amax(1) < best - tau).all()):
            break
        out = step(d, beam_tok, src, rows)  # logits, or hidden states with a head
        picked = None  # the next beams' tokens, scores, parent beams and rows, where the depth step gave them
        if head is not None:  # (the root's zero score made inside the op: no kernel of its own)
            entries = head.entries if d + 1 < depth else 0  # the last depth's children are no entries
            tok, score, nxt, *picked = ops.head_expand(out, head.weight, head.norm_weight, head.eps, beam_score,
                                                       topk, scale, rows, 1 + d * width, entries)
        else:
            if beam_score is None:
                beam_score = out.new_zeros(B, 1, dtype=accumulation_dtype(out.dtype))
            tok, score, nxt = expand(beam_score, out, topk, scale) if scored else top1(beam_score, out)
        pool.append((tok, beam_pool[:, :, None].expand(-1, -1, topk).flatten(1), score))
        if best is None:
            best = score[:, 0]  # q*: the best first token; no deeper score exceeds it
        if width == 1:
            # one beam, and its best child is its first (children come best first): constant
            # indices, which a compiled rollout folds into plain slices, as a chain's
            src = first
            beam_pool = torch.full((B, 1), size, dtype=torch.long, device=dev)
            beam_tok, beam_score = tok[:, :1], score[:, :1]
        else:
            nxt = nxt[:, :width]
            beam_pool = size + nxt
            if picked is None:
                src, beam_tok, beam_score = nxt // topk, tok.gather(1, nxt), score.gather(1, nxt)
            else:
                beam_tok, beam_score, src, rows = (t[:, :width] for t in picked)
        size += tok.shape[1]
    return tuple(torch.cat(parts, 1) for parts in zip(*pool))


# the drafter's attention rows of a depth's entries: the ops reference owns them, since
# `ops.head_expand` forms the next depth's inside its merge
entry_ancestors = beam_naive.entry_ancestors


def depths(parents: list[int]) -> list[int]:
    """Depth of every pool node (the root's children have depth 1)."""
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


def select(scores: list[float], parents: list[int], budget: int, tau: float | None = None) -> list[int]:
    """Pool nodes to submit: within tau of the best score, at most `budget`, ancestor-closed.

    Returned in increasing pool order. tau None: no window (only the budget cuts).
    """
    if not scores or budget <= 0:
        return []
    depth = depths(parents)
    best = max(scores)
    window = [i for i, s in enumerate(scores) if tau is None or s >= best - tau]
    kept: set[int] = set()
    for i in sorted(window, key=lambda i: (-scores[i], depth[i], i)):
        need = []
        j = i
        while j >= 0 and j not in kept:
            need.append(j)
            j = parents[j]
        if len(kept) + len(need) <= budget:
            kept.update(need)
            if len(kept) == budget:
                break
    return sorted(kept)


def pack(root: int, tokens: list[int], parents: list[int], scores: list[float],
         kept: list[int]) -> tuple[list[int], list[int]]:
    """The verifier's topology (tokens, parents), root first, from an ancestor-closed `kept`:
    depth by depth, best score first within a depth (pool order among equal scores)."""
    depth = depths(parents)
    order = sorted(kept, key=lambda i: (depth[i], -scores[i], i))
    index = {-1: 0}
    out_tok, out_par = [root], [-1]
    for j, i in enumerate(order, start=1):
        index[i] = j
        out_tok.append(tokens[i])
        out_par.append(index[parents[i]])
    return out_tok, out_par


def build(root: int, tokens: list[int], parents: list[int], scores: list[float], budget: int,
          tau: float | None = None) -> tuple[list[int], list[int]]:
    """Select and pack: the pruned draft tree of one row."""
    return pack(root, tokens, parents, scores, select(scores, parents, budget, tau))


def pool_depths(P: int, topk: int, width: int, device) -> torch.Tensor:
    """[1, P]: the depth of each node of a `beam_search` pool (or of a prefix of it): k nodes at
    depth 1, then w·k a depth. The layout is fixed, so nothing has to be found from parents."""
    starts = topk + width * topk * torch.arange(P, device=device)  # first node of depth 2, 3, ...
    # counted, not divided: a floor division in a dynamic-shape compile failed Inductor (torch 2.13)
    return 1 + (torch.arange(P, device=device)[:, None] >= starts[None]).sum(1)[None]


def build_batch(root: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor,
                budget: int, tau: float | None = None, max_depth: int | None = None,
                depth: torch.Tensor | None = None):
    """`build` for every row of a `beam_search` pool, on the device: (tokens, parents, valid),
    [B, M + 1] with M = min(budget, P) and valid[b] = 1 + the nodes row b keeps; rows that keep
    fewer are padded as `pad_drafts` pads (`ops.build_tree`, whose reference,
    `ops.tree.naive.build_batch`, says how). depth: each node's depth ([B or 1, P];
    `pool_depths`), else found from the parents in max_depth steps (default P)."""
    if depth is None:
        B, P = scores.shape
        depth = torch.ones(B, P, dtype=torch.long, device=scores.device)
        for _ in range((max_depth or P) - 1):  # parents[i] < i: depth d is right after d - 1 rounds
            depth = torch.where(parents < 0, 1, depth.gather(1, parents.clamp(min=0)) + 1)
    return ops.build_tree(root, tokens, parents, scores, budget, tau, depth)
