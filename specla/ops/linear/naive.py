"""Pure-torch reference for the single-row matmul of a batch-1 decode step (the GEMV)."""

from __future__ import annotations

import torch


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x Wᵀ for one row x [..., K] (a single row in all) and weight [N, K]: [..., N] in x's
    dtype, products and sums in fp32 (fp64 for fp64 inputs), as cuBLAS's bf16 GEMV."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(acc) @ weight.to(acc).t()).to(x.dtype)
