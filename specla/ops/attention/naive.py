"""Masked attention of a few queries over a KV cache, the torch reference of `triton.py`.

A draft step of the EAGLE drafter asks this: its 1 (chain) to k (beam tree) queries attend over
the leading W slots of the drafter's cache under a boolean mask (committed entries, plus each
query's own path through the rollout's entries).
"""

from __future__ import annotations

import torch

from specla.precision import accumulation_dtype


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
