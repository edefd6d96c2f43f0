"""Pure-torch references for the matmuls of a batch-1 decode step: one row (the AR or draft
step's GEMV) and a few rows (a verify's skinny GEMM)."""

from __future__ import annotations

import torch


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
