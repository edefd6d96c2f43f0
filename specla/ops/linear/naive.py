"""Pure-torch references for the matmuls of a batch-1 decode step: one row (the AR or draft
step's GEMV) and a few rows (a verify's skinny GEMM)."""

from __future__ import annotations

import torch

from specla.ops.norm import naive as norm_ref
from specla.precision import accumulation_dtype


def _rows_times(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(acc) @ weight.to(acc).t()).to(x.dtype)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x Wᵀ for one row x [..., K] (a single row in all) and weight [N, K]: [..., N] in x's
    dtype, products and sums in fp32 (fp64 for fp64 inputs), as cuBLAS's bf16 GEMV."""
    return _rows_times(x, weight)


def skinny(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x Wᵀ for a few rows x [..., K] and weight [N, K], accumulated as `gemv`."""
    return _rows_times(x, weight)


def rowwise(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`skinny`, one row at a time: each row's product is the same one-row call whatever the
    other rows are (a BLAS picks its kernel by the row count), so a row's bits do not depend on
    how many rows came with it."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.cat([_rows_times(r[None], weight) for r in rows] or [_rows_times(rows, weight)])
    return out.reshape(*x.shape[:-1], weight.shape[0])


def fused(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
          residual: torch.Tensor | None = None, glu: bool = False) -> torch.Tensor:
    """A draft step's matmul with what surrounds it, in x's dtype:
    norm_weight: x is RMS-normalised first (fp32, scaled by norm_weight, rounded to x's dtype:
    `layers.RMSNorm`); glu: weight is [gate; up] ([2I, K]) and the result silu(gate) * up [..., I]
    (each rounded to x's dtype, as `layers.GatedMLP`); residual: added to the product (rounded)."""
    if norm_weight is not None:
        x = _rms(x, norm_weight, eps)
    y = _rows_times(x, weight)
    if glu:
        g, u = y.chunk(2, -1)
        y = torch.nn.functional.silu(g) * u
    return y if residual is None else residual + y


def draft_inputs(table: torch.Tensor, tokens: torch.Tensor, h: torch.Tensor, src: torch.Tensor,
                 norm_emb: torch.Tensor, norm_feat: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """An EAGLE draft step's input [B, n, N]: fc([norm_emb(table[tokens]); norm_feat(h[src])]),
    tokens and src [B, n] (src[b, i]: the row of h [B, nb, D] that entry i reads), weight
    [N, 2D]; norms and product as `fused`."""
    D = h.shape[-1]
    feat = h.gather(1, src[..., None].expand(*src.shape, D))
    return fused(torch.cat([_rms(table[tokens], norm_emb, eps), _rms(feat, norm_feat, eps)], -1), weight)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`layers.RMSNorm`: in fp32 (fp64 for fp64), rounded to x's dtype."""
    return norm_ref.gated(x.to(accumulation_dtype(x.dtype)), None, w, eps, "silu").to(x.dtype)
