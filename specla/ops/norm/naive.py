"""Pure-torch reference for the GDN output norm (DESIGN §1): rmsnorm(o) · w · act(z) per value
head, the mixer's last step before o_proj."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gated(o: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, eps: float, act: str) -> torch.Tensor:
    """rmsnorm(o) * w * act(z) over the last dim, in o's (fp32/fp64) precision (`model.gated_rms_norm`)."""
    y = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + eps) * weight.to(o.dtype)
    if z is not None:
        z = z.to(o.dtype)
        y = y * (torch.sigmoid(z) if act == "sigmoid" else F.silu(z))
    return y


def gated_rms_norm(o, z, weight, eps: float, act: str, out_dtype: torch.dtype):
    """o [B, n, HV, V] (the verifier's output, state precision), z [B, n, HV·V] or None ->
    [B, n, HV·V] in out_dtype, computed in o's precision and rounded once."""
    B, n, HV, V = o.shape
    zz = None if z is None else z.reshape(B, n, HV, V)
    return gated(o, zz, weight, eps, act).reshape(B, n, HV * V).to(out_dtype)
