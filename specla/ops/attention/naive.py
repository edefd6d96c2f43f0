"""Masked attention of a few queries over a KV cache, the torch reference of `triton.py`.

A draft step of the EAGLE drafter asks this: its 1 (chain) to k (beam tree) queries attend over
the leading W slots of the drafter's cache under a boolean mask (committed entries, plus each
query's own path through the rollout's entries). `draft_attention` is that whole step: RoPE,
the entries' cache writes, the mask and the attention.
"""

from __future__ import annotations

import torch

from specla.precision import accumulation_dtype
from specla.rotary import apply_rotary


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [B, n, H, D], keys and values [B, H, W, D], mask [B, n, W] (True: attend) ->
    [B, n, H * D] in q's dtype, computed in the accumulation dtype (fp32 for bf16/fp16).
    A query that may attend to nothing gets zeros."""
    acc = accumulation_dtype(q.dtype)
    s = torch.einsum("bnhd,bhwd->bhnw", q.to(acc), keys.to(acc)) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # an all-masked row: zeros, not NaN
    o = torch.einsum("bhnw,bhwd->bnhd", p, values.to(acc))
    return o.to(q.dtype).flatten(2)


def draft_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    length: torch.Tensor, depth: int, start: int, rows: torch.Tensor | None,
                    inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    """One draft step's attention for its n entries start .. start + n - 1 of a rollout.

    q, k, v [B, n, H, D] (q and k not yet rotated) sit at position length[b] + depth and are
    rotated there (`apply_rotary` with inv_freq); entry i's rotated k and its v are written to
    cache slot length[b] + start + i of keys and values [B, H, W, D] (in place). Query i then
    attends (`masked_attention`) to the committed slots s < length[b], to the earlier entries
    on its path (entry e = s - length[b] < start with rows[b, i, e], rows [B, n, E] as
    `tree.entry_ancestors` builds them; rows None: a chain, every earlier entry) and to its
    own slot; the step's other entries stay hidden. -> [B, n, H * D] in q's dtype.
    """

    B, n, H, D = q.shape
    dev = q.device
    pos = (length + depth)[:, None].expand(B, n)
    q, k = apply_rotary(q, pos, inv_freq), apply_rotary(k, pos, inv_freq)
    entry = start + torch.arange(n, device=dev)
    idx = (length[:, None] + entry)[:, None, :, None].expand(B, H, n, D)
    keys.scatter_(2, idx, k.transpose(1, 2).to(keys.dtype))
    values.scatter_(2, idx, v.transpose(1, 2).to(values.dtype))
    rel = torch.arange(keys.shape[2], device=dev)[None] - length[:, None]  # [B, W]: slot - first entry's slot
    earlier = ((rel >= 0) & (rel < start))[:, None]
    if rows is not None:
        earlier = earlier & rows.gather(2, rel.clamp(0, rows.shape[2] - 1)[:, None].expand(B, n, -1))
    mask = (rel < 0)[:, None] | earlier | (rel[:, None] == entry[None, :, None])
    return masked_attention(q, keys.to(q.dtype), values.to(q.dtype), mask, scale)
