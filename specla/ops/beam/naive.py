"""One depth of a beam top-k rollout (SpecLA §6.1), the torch reference of `triton.py`.

`beam_expand` takes each beam's next-token logits, not log-probabilities: the top-k tokens of a
row are those of its logits (a log-softmax shifts a row by one constant), and only the k chosen
ones need the row's log-sum-exp subtracted, so no log-softmax of the whole vocabulary is formed.
"""

from __future__ import annotations

import torch

from specla.ops.linear import naive as linear_ref
from specla.precision import accumulation_dtype


# Inductor reduces a row in one program, and an index reduction is never split: the drafter's
# top-1 over 32k logits was one 6.5 µs program a draft step on the H200
# (controlled_55d95ad_h200.json). In chunks it is two reductions, the first over many programs.
MAX_CHUNK = 512


def first_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x.max(-1): the largest value along the last dimension and its first index, taken over
    chunks of MAX_CHUNK (each chunk's first maximum, then the first chunk holding the
    largest), so a compiled region spreads a long row over many programs."""
    V = x.shape[-1]
    if V <= 2 * MAX_CHUNK:
        return x.max(-1)
    pad = -V % MAX_CHUNK
    chunks = torch.nn.functional.pad(x, (0, pad), value=float("-inf")).unflatten(-1, (-1, MAX_CHUNK))
    vals, idx = chunks.max(-1)
    best, c = vals.max(-1)
    return best, idx.gather(-1, c[..., None]).squeeze(-1) + c * MAX_CHUNK


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of x along the last dimension, best first, the lowest index first
    among equal values (also at the cut, where `torch.topk` picks any), as k max-reductions:
    for a small k they fuse under torch.compile, where topk stays one slow radix-select kernel
    per call (~15-40 µs on an 8k vocabulary)."""
    vals, idx = [], []
    for j in range(k):
        v, i = first_max(x)
        vals.append(v)
        idx.append(i)
        if j + 1 < k:
            x = x.scatter(-1, i[..., None], float("-inf"))
    return torch.stack(vals, -1), torch.stack(idx, -1)


def beam_expand(logits: torch.Tensor, beam_scores: torch.Tensor, topk: int, scale: float = 1.0):
    """logits [B, nb, V] at each beam, beam_scores [B, nb] the beams' cumulative log-probability.
    scale (> 0): the logits are taken times scale, a softmax temperature of 1 / scale.

    Returns the children, child j of beam i at i·topk + j: tokens [B, nb·topk] (each beam's
    top-k by logit, best first, lower id first among equal logits), their scores [B, nb·topk]
    (beam score + the token's log-probability), and beams [B, topk]: the flat indices of the
    topk best children (best first, earlier first among equal scores), the next beams.
    Computed in `accumulation_dtype`.
    """
    acc = accumulation_dtype(logits.dtype)
    x = logits.to(acc) * scale
    val, tok = top_k(x, topk)
    lp = val - torch.logsumexp(x, -1, keepdim=True)
    scores = (beam_scores.to(acc)[..., None] + lp).flatten(1)
    return tok.flatten(1), scores, top_k(scores, topk)[1]


def head_expand(h: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                beam_scores: torch.Tensor | None, topk: int, scale: float = 1.0, rows: torch.Tensor | None = None,
                start: int = 0, entries: int = 0):
    """`beam_expand` from the beams' hidden states h [B, nb, D]: their logits are the drafter's
    head, RMS-normalised h times weight [V, D] (`ops.linear.naive.fused`, rounded to h's dtype as
    the modules' are). Besides beam_expand's (tok, scores, beams), the next beams' tokens, scores
    and parent beams [B, topk] (of the children `beams` picks), which the rollout would
    otherwise gather and divide. beam_scores None: zeros (the root's depth, without a kernel
    to make them).

    The seventh output, [B, topk, entries] (bool), is the next beams' ancestor-or-self rows over
    the `entries` queries of an EAGLE rollout (`entry_ancestors`): next beam j is
    entry start + j and extends the beam whose row is rows[:, src_j] ([B, nb, entries]; None:
    the beams are the root, entry 0, whose row is itself). entries 0: an empty [B, topk, 0]."""
    if beam_scores is None:
        beam_scores = h.new_zeros(h.shape[:2], dtype=accumulation_dtype(h.dtype))
    tok, scores, beams = beam_expand(linear_ref.fused(h, weight, norm_weight, eps), beam_scores, topk, scale)
    src = beams // topk
    if rows is None:  # the root, entry 0
        rows = entry_ancestors(None, src[:, :1], 0, entries)
    next_rows = entry_ancestors(rows, src, start, entries)
    return tok, scores, beams, tok.gather(1, beams), scores.gather(1, beams), src, next_rows


def entry_ancestors(prev: torch.Tensor | None, src: torch.Tensor, start: int, entries: int) -> torch.Tensor:
    """Ancestor-or-self rows [B, m, E] of m new drafter entries start .. start+m-1.

    An entry is the drafter's query for one expanded node; E (`entries`) counts every entry of
    the rollout. prev [B, m', E] holds the rows of the previous depth's entries (None at the
    root, which sees itself only), and new entry i extends prev's entry src[:, i]. A new entry
    sees its parent's ancestors and itself, so one forward over all beams of a depth attends
    exactly along each beam's own path. Built as values from the previous depth's rows, not
    written into a buffer of all rows: a compiled rollout then forms them inside the kernel
    that builds the attention mask (a buffer's slice write was a kernel of its own each depth).
    """
    B, m = src.shape
    own = torch.arange(entries, device=src.device)[None, None] == \
        (start + torch.arange(m, device=src.device))[None, :, None]
    if prev is None:
        return own.expand(B, m, entries)
    return prev.gather(1, src[:, :, None].expand(B, m, entries)) | own
