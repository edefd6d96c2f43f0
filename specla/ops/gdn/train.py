"""Differentiable GDN over whole sequences from a zero state, for training.

The chunked UT/WY form of DESIGN §2 in plain PyTorch: within a chunk of C tokens every
quantity is a batched matrix product (and one unit-triangular solve); only the state
recurrence between chunks is sequential. Autograd differentiates it as written.

Why not fla's chunk kernel: fla 0.6.0 refuses its backward pass on Hopper GPUs with
Triton < 3.7.1 (fla issue #640: incorrect gradients), and the H200 machine has Triton 3.6.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gdn_train(q, k, v, g, beta, scale, chunk: int = 64):
    """o [B, T, HV, V] for q, k [B, T, H, K] (l2-normalised), v [B, T, HV, V], g, beta [B, T, HV]."""
    B, T, HV, V = v.shape
    G = HV // q.shape[2]
    dt = torch.float64 if v.dtype == torch.float64 else torch.float32
    q, k = q.repeat_interleave(G, 2).to(dt), k.repeat_interleave(G, 2).to(dt)
    v, g, beta = v.to(dt), g.to(dt), beta.to(dt)
    pad = (-T) % chunk
    if pad:  # padded tokens: k = v = g = beta = 0 change nothing
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, 0, 0, pad)), F.pad(beta, (0, 0, 0, pad))
    N, C, K = (T + pad) // chunk, chunk, q.shape[-1]
    # [B, HV, N, C, .]
    q, k, v = (x.reshape(B, N, C, HV, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v))
    g, beta = (x.reshape(B, N, C, HV).permute(0, 3, 1, 2) for x in (g, beta))
    gc = g.cumsum(-1)  # log Γ_i from the chunk start, inclusive
    lower = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # Γ_i / Γ_j, i >= j
    kk = k @ k.transpose(-1, -2)
    A = (beta[..., None] * kk * decay).masked_fill(lower.logical_not() | torch.eye(C, dtype=torch.bool,
                                                                                   device=v.device), 0)
    eye = torch.eye(C, dtype=dt, device=v.device).expand_as(A)
    Tm = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)  # (I + A)^-1
    Gam = gc.exp()[..., None]
    Uv = Tm @ (beta[..., None] * v)  # U = Uv - W S0
    W = Tm @ (beta[..., None] * Gam * k)
    attn = (q @ k.transpose(-1, -2)) * decay * scale  # includes the diagonal
    qg = q * Gam * scale
    kd = k * (gc[..., -1:] - gc).exp()[..., None]  # Γ_C / Γ_i
    S = q.new_zeros(B, HV, K, V)
    out = []
    for c in range(N):
        u = Uv[:, :, c] - W[:, :, c] @ S
        out.append(qg[:, :, c] @ S + attn[:, :, c] @ u)
        S = gc[:, :, c, -1].exp()[..., None, None] * S + kd[:, :, c].transpose(-1, -2) @ u
    o = torch.stack(out, 2).permute(0, 2, 3, 1, 4).reshape(B, N * C, HV, V)
    return o[:, :T]
