"""Reference selection and packing of a draft tree's pool (`drafters.tree.build_batch`)."""

from __future__ import annotations

import torch


def _rank(keys: list[torch.Tensor]) -> torch.Tensor:
    """Column indices of [B, n] keys sorted ascending by the keys, most significant first, then
    by index. Counted rather than sorted: an element's place is how many others precede it,
    and the element at each place is found by comparison too. Both are [B, n, n] reductions
    that Inductor fuses, where each stable sort was a radix sort of its own and a scatter an
    eager kernel (H200 profiles; n is the rollout's pool, ~100 at most)."""
    return _invert(_places(keys)) - 1


def _places(keys: list[torch.Tensor]) -> torch.Tensor:
    """[B, n]: each column's place in `_rank`'s order."""
    B, n = keys[0].shape
    idx = torch.arange(n, device=keys[0].device)
    precedes = (idx[None, :] < idx[:, None]).expand(B, n, n)  # [b, i, j]: j comes before i
    for key in reversed(keys):
        ki, kj = key[:, :, None], key[:, None, :]
        precedes = (kj < ki) | ((kj == ki) & precedes)
    return precedes.sum(2)


def _invert(perm: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """[B, width]: out[b, perm[b, i]] = i + 1 for a batch of injections perm [B, n] into
    range(width) (default n), and 0 where nothing maps."""
    n = perm.shape[1]
    slots = torch.arange(width or n, device=perm.device)
    return ((perm[:, None, :] == slots[None, :, None]) * torch.arange(1, n + 1, device=perm.device)).sum(2)


def build_batch(root: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor,
                budget: int, tau: float | None, depth: torch.Tensor):
    """`build` for every row of a `beam_search` pool, on the device: (tokens, parents, valid),
    [B, M + 1] with M = min(budget, P) and valid[b] = 1 + the nodes row b keeps. Rows that keep
    fewer than M nodes are padded as `pad_drafts` pads: a chain under their last node repeating
    its token, ignored by acceptance past `valid`. depth: each node's depth ([B or 1, P];
    `drafters.tree.pool_depths`).

    Scores never increase along a rollout path, so ranking the window by (-q, depth, pool order)
    lists every node after its ancestors: its first min(budget, |window|) nodes are what
    `select` keeps, with no join needed.
    """
    B, P = scores.shape
    dev = scores.device
    M = min(budget, P)
    depth = depth.expand(B, P)
    inside = torch.ones_like(scores, dtype=torch.bool) if tau is None else \
        scores >= scores.amax(1, keepdim=True) - tau
    count = inside.sum(1).clamp(max=M)  # nodes kept per row
    kept = _rank([(~inside).long(), -scores, depth])[:, :M]  # pool indices, window first
    live = torch.arange(M, device=dev)[None] < count[:, None]
    # pack the live ones depth by depth, best score first, pool order; dead slots last
    d, q = depth.gather(1, kept), scores.gather(1, kept)
    packed = _rank([torch.where(live, d, P + 1), -q, kept])
    order, live = kept.gather(1, packed), live.gather(1, packed)
    pos = _invert(order, P)  # pool index -> output position (0 where order does not hold it)
    par = parents.gather(1, order)
    out_par = torch.where(par < 0, 0, pos.gather(1, par.clamp(min=0)))
    out_tok = torch.cat([root[:, None], tokens.gather(1, order)], 1)
    # padding: a chain under the last kept node, repeating its token
    last = out_tok.gather(1, count[:, None])
    out_tok[:, 1:] = torch.where(live, out_tok[:, 1:], last)
    out_par = torch.where(live, out_par, torch.arange(M, device=dev)[None])
    return out_tok, torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), out_par], 1), count + 1
