"""The one precision rule: what a computation accumulates in, given its activations' dtype."""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 activations, fp64 for fp64 ones: the recurrent state, softmaxes,
    log-probabilities and rollout scores (fp64 keeps the CPU exactness tests exact)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
