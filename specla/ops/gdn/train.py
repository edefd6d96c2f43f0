"""Differentiable GDN over whole sequences from a zero state, for training.

CUDA: fla's chunk kernel (forward and backward in Triton). Elsewhere: the token recurrence
written out of place so autograd can follow it (tiny shapes only).
"""

from __future__ import annotations

import torch


def gdn_train(q, k, v, g, beta, scale):
    """o [B, T, HV, V] for q, k [B, T, H, K] (l2-normalised), v [B, T, HV, V], g, beta [B, T, HV]."""
    if q.is_cuda:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        dt = torch.bfloat16
        o, _ = chunk_gated_delta_rule(q=q.to(dt), k=k.to(dt), v=v.to(dt), g=g.float(), beta=beta.float(),
                                      scale=scale, output_final_state=False, use_qk_l2norm_in_kernel=False)
        return o
    B, T, HV, V = v.shape
    G = HV // q.shape[2]
    q, k = q.repeat_interleave(G, 2), k.repeat_interleave(G, 2)
    S = q.new_zeros(B, HV, q.shape[-1], V)
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - (S * k[:, t, :, :, None]).sum(-2))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        out.append((S * q[:, t, :, :, None]).sum(-2) * scale)
    return torch.stack(out, 1)
