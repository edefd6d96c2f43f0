"""Pure-torch references for the Gated DeltaNet verification and commit ops.

Layout (DESIGN §1-2): state S is [B, HV, K, V] with o = Sᵀq; q, k are [B, n, H, K] (already
l2-normalised), v is [B, n, HV, V], the log-decay g and the write strength beta are [B, n, HV].
Value head hv reads key head hv // (HV // H) (fla's grouped-value convention).

These functions are the specification: every Triton kernel in this package has the same
signature and is tested against them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def factors(xc, a, b, A_log, dt_bias, num_heads: int, head_dim: int, neg_eigval: bool, sdt):
    """The delta rule's inputs from the (SiLU'd) conv output xc [B, n, C] (already in the state
    precision sdt; C = 2·H·K + HV·V): q, k l2-normalised in fla's in-kernel form (eps inside
    the square root), v, the log-decay g = −exp(A_log)·softplus(a + dt_bias) and β = sigmoid(b)
    (×2 with negative eigenvalues). The model, the fused path's compiled regions and the
    prelude references all compute them here."""
    B, n, _ = xc.shape
    H, K = num_heads, head_dim
    qk = xc[..., :2 * H * K].reshape(B, n, 2 * H, K)
    qk = qk / torch.sqrt(qk.square().sum(-1, keepdim=True) + 1e-6)
    v = xc[..., 2 * H * K:].reshape(B, n, a.shape[-1], -1)
    g = -A_log.to(sdt).exp() * F.softplus(a.to(sdt) + dt_bias.to(sdt))
    beta = torch.sigmoid(b.to(sdt))
    if neg_eigval:
        beta = beta * 2
    return qk[:, :, :H], qk[:, :, H:], v, g, beta


def mask_padding(g, beta, valid):
    """g, β [B, T, HV] with the tokens past valid[b] made padding: g = 0 (no decay) and β = 0 (no
    write), so they leave the state as it was (a graph prefill's padded chunk)."""
    real = (torch.arange(g.shape[1], device=g.device)[None] < valid[:, None])[..., None]
    return g * real, beta * real


def _expand_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[B, n, H, K] -> [B, n, HV, K] by repeating each key head over its group of value heads."""
    h = x.shape[2]
    return x if h == hv else x.repeat_interleave(hv // h, dim=2)


def gdn_recurrent(q, k, v, g, beta, state, scale):
    """AR reference: consume a sequence token by token, updating `state` in place.

    Returns o [B, T, HV, V] in the state's dtype.
    """
    HV = v.shape[2]
    dt = state.dtype
    q, k = _expand_heads(q, HV).to(dt), _expand_heads(k, HV).to(dt)
    v, g, beta = v.to(dt), g.to(dt), beta.to(dt)
    o = torch.empty(v.shape, dtype=dt, device=v.device)
    S = state
    for t in range(v.shape[1]):
        S.mul_(g[:, t].exp()[..., None, None])
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S.add_(k[:, t, :, :, None] * u[:, :, None, :])
        o[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t]) * scale
    return o


def gdn_commit(state, k, g, u, path, length):
    """Advance `state` in place along the accepted path (DESIGN §2, factor commit).

    k [B, n, H, K], g [B, n, HV], u [B, n, HV, V] are a verify round's factor records;
    path [B, P] holds node ids (root first), of which the first length[b] are applied, one at a
    time with the verifier's own update, so the result is the state the verify reached there:

        S <- γ_{a_i} S + k_{a_i} u_{a_i}ᵀ   for i = 1..length   (γ = exp g)

    (The closed form Γ_A S + Σ_i (Γ_A / Γ_{a_i}) k_{a_i} u_{a_i}ᵀ is equal in exact arithmetic and
    rounds differently.) Factors past a row's length are the identity: γ = 1, u = 0.
    """
    B, P = path.shape
    HV = u.shape[2]
    dt = state.dtype
    rows = torch.arange(B, device=path.device)[:, None]
    live = torch.arange(P, device=path.device)[None, :] < length[:, None]  # [B, P]
    kp = _expand_heads(k[rows, path], HV).to(dt)  # [B, P, HV, K]
    gp = g[rows, path].to(dt) * live[..., None]  # [B, P, HV]
    up = u[rows, path].to(dt) * live[..., None, None]
    for i in range(P):
        state.mul_(gp[:, i].exp()[..., None, None])
        state.add_(kp[:, i, :, :, None] * up[:, i, :, None, :])


def gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending=None, valid=None):
    """Verify a topology from the durable state (DESIGN §2).

    Every node j starts from the state after its parent (S0 for the root), so it sees exactly
    its ancestors. Returns (o [B, n, HV, V], u [B, n, HV, V]) in the state's dtype, u being the
    corrected update β_j (v_j - S'_jᵀ k_j) the commit consumes.

    `pending = (k, g, u, length)`, a gathered accepted path from the previous round (delayed
    update, path = 0..P-1), is first applied to `state` in place; nothing else is written.

    `valid` [B]: nodes j >= valid[b] are padding (`drafters.base.pad_draft`; no real node lies below
    one). Nothing may read their o and u: this reference and the serial kernel write zeros
    there without running their recurrence; the hybrid kernel takes no `valid` and computes
    them like any node.
    """
    if pending is not None:
        pk, pg, pu, plen = pending
        path = torch.arange(pk.shape[1], device=pk.device).expand(pk.shape[0], -1)
        gdn_commit(state, pk, pg, pu, path, plen)
    B, n, HV, V = v.shape
    dt = state.dtype
    q, k = _expand_heads(q, HV).to(dt), _expand_heads(k, HV).to(dt)
    v, g, beta = v.to(dt), g.to(dt), beta.to(dt)
    rows = torch.arange(B, device=v.device)
    states = []  # state after each node
    o = torch.empty(B, n, HV, V, dtype=dt, device=v.device)
    u = torch.empty(B, n, HV, V, dtype=dt, device=v.device)
    for j in range(n):
        par = parents[:, j]
        if j == 0:
            base = state
        else:  # every row's parent state; parents[:, j] < j
            base = torch.stack(states, 1)[rows, par] if bool((par != par[0]).any()) else states[int(par[0])]
        S = base * g[:, j].exp()[..., None, None]
        u[:, j] = beta[:, j, :, None] * (v[:, j] - (S * k[:, j, :, :, None]).sum(-2))
        S = S + k[:, j, :, :, None] * u[:, j, :, None, :]
        states.append(S)
        o[:, j] = (S * q[:, j, :, :, None]).sum(-2) * scale
    if valid is not None:
        pad = torch.arange(n, device=v.device)[None, :] >= valid.to(v.device)[:, None]  # [B, n]
        o.masked_fill_(pad[:, :, None, None], 0.0)
        u.masked_fill_(pad[:, :, None, None], 0.0)
    return o, u
