"""Rotary position embedding, in the half-split form transformers uses (the first 2·R dims of
each head rotated, the rest passed through); the target's attention layers and the drafters
share it, and the draft-attention kernel rotates in-kernel exactly as `apply_rotary` does."""

from __future__ import annotations

import torch


def rotary_inv_freq(rot_dim: int, theta: float, dtype: torch.dtype) -> torch.Tensor:
    """1 / theta^(2i / rot_dim), computed as transformers does (fp32), in fp64 for fp64 models."""
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    return 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).to(ct) / rot_dim))


def apply_rotary(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2 * len(inv_freq) dims of x [B, n, H, D] (half-split pairs) by pos [B, n]."""
    rot = 2 * inv_freq.shape[0]
    if rot == 0:
        return x
    freqs = pos[..., None].to(inv_freq.dtype) * inv_freq  # [B, n, rot/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, :, None], emb.sin().to(x.dtype)[:, :, None]
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([xr * cos + rotated * sin, xp], dim=-1)
