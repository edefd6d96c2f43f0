"""Triton factor commit (SpecLA §5.1, DESIGN §2): advance S along an accepted path in place.

    for each accepted node a_i in order:  S <- γ_{a_i} S + k_{a_i} u_{a_i}ᵀ

One program per (row, value head, V-tile) loads its K×BV state tile once, applies the accepted
factors in registers and stores the tile. The factors are applied one by one with exactly the
arithmetic the verifiers use to advance their resident tile (`decay_update`), not in the
closed rank-A form Γ_A S + Σ (Γ_A/Γ_i) k_i u_iᵀ: a committed state is then bit-for-bit the
state the verifier reached at that node, so a speculative round and an AR step through the
same verify compute identical logits at every position (`docs/exact.md`). Rows past the
accepted length are neither loaded nor applied. `advance_tile` is the update as a device
function: the verifiers and the state reader call it to apply a pending (delayed) commit to the
tile they just loaded (SpecLA §5.2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def decay_update(S, gamma, k, u):
    """S <- γ S + k uᵀ with the rounding pinned (one product, then a fused multiply-add), so
    every kernel that advances a tile (verify, commit, pending) gets the same bits."""
    return tl.fma(k[:, None], u[None, :], S * gamma)


@triton.jit
def real_nodes(valid, b, n):
    """Row b's real nodes: valid[b] clamped into [0, n] (the rest is a fixed-width verify's
    padding); shared by the verifiers and the path tables."""
    return tl.minimum(tl.maximum(tl.load(valid + b).to(tl.int32), 0), n)


@triton.jit
def _factor(path, g, b, hv, p, P, n_live, n_src, HV: tl.constexpr, HAS_PATH: tl.constexpr):
    """Factor p of row b: its source row (path[b, p] clamped into range, or p without a path),
    whether it is live (p < length[b]), and its log-decay (0 when not live)."""
    if HAS_PATH:
        node = tl.load(path + b * P + p, mask=p < P, other=0).to(tl.int64)
        node = tl.minimum(tl.maximum(node, 0), n_src - 1)
    else:
        node = p
    row = b * n_src + node
    live = (p < P) & (p < n_live)
    gp = tl.load(g + row * HV + hv, mask=p < P, other=0.0).to(tl.float32)
    return row, live, tl.where(live, gp, 0.0)


@triton.jit
def _factor_rows(k, g, u, path, b, hv, i_h, p, P, n_live, n_src, o_k, mk, o_v, mv,
                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, HAS_PATH: tl.constexpr):
    """Factor p's k and u rows, each loaded straight into the vector layout it is used in and only
    if the factor is live, its log-decay and whether it is live."""
    row, live, gp = _factor(path, g, b, hv, p, P, n_live, n_src, HV, HAS_PATH)
    kr = tl.load(k + (row * H + i_h) * K + o_k, mask=mk & live, other=0.0).to(tl.float32)
    ur = tl.load(u + (row * HV + hv) * V + o_v, mask=mv & live, other=0.0).to(tl.float32)
    return kr, ur, gp, live


@triton.jit
def advance_tile(S, b, hv, i_h, k, g, u, path, length, n_src, P,
                 o_k, mk, o_v, mv,
                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 PP: tl.constexpr, HAS_PATH: tl.constexpr):
    """Apply the first length[b] factors of row b (nodes path[b, :], or 0.. without a path).

    k [B, n_src, H, K], g [B, n_src, HV], u [B, n_src, HV, V] are contiguous; S is the
    [BK, BV] fp32 tile of rows o_k, columns o_v; PP (>= P) rows are visited, unrolled.
    """
    n_live = tl.load(length + b)
    # factor p + 2's rows are requested before factor p is applied: loaded just before its own
    # update, each factor stalled the loop for a load's latency (the update itself is one FMA per
    # tile element), which made the fused commit-and-verify cost grow with the accepted length
    # (kernels.json, Fig 11b). A dead factor is skipped, not applied as the identity: a chain
    # buffer has 16 padded rows and ~5 accepted ones, and the 16-long FMA chain over the tile
    # cost more than the verify's first nodes (H200, pending_update_9fe7990.json)
    k0, u0, g0, live0 = _factor_rows(k, g, u, path, b, hv, i_h, 0, P, n_live, n_src, o_k, mk, o_v, mv,
                                     H, HV, K, V, HAS_PATH)
    k1, u1, g1, live1 = _factor_rows(k, g, u, path, b, hv, i_h, 1, P, n_live, n_src, o_k, mk, o_v, mv,
                                     H, HV, K, V, HAS_PATH)
    for p in tl.static_range(PP):
        k2, u2, g2, live2 = _factor_rows(k, g, u, path, b, hv, i_h, p + 2, P, n_live, n_src, o_k, mk, o_v, mv,
                                         H, HV, K, V, HAS_PATH)
        if live0:
            S = decay_update(S, tl.exp(g0), k0, u0)
        k0, u0, g0, live0 = k1, u1, g1, live1
        k1, u1, g1, live1 = k2, u2, g2, live2
    return S


@triton.jit
def _commit_kernel(state, k, g, u, path, length, n, P,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, PP: tl.constexpr):
    pid = tl.program_id(0)
    b, hv, vt = pid // (HV * NV), (pid // NV) % HV, pid % NV
    i_h = hv // (HV // H)
    o_k = tl.arange(0, BK)
    o_v = vt * BV + tl.arange(0, BV)
    mk, mv = o_k < K, o_v < V
    p_S = state + (b * HV + hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    m_S = mk[:, None] & mv[None, :]
    S = tl.load(p_S, mask=m_S, other=0.0)
    S = advance_tile(S, b, hv, i_h, k, g, u, path, length, n, P, o_k, mk, o_v, mv,
                     H, HV, K, V, PP, True)
    tl.store(p_S, S, mask=m_S)


def gdn_commit(state, k, g, u, path, length, *, block_v: int = 16, num_warps: int = 4):
    """Same contract as `naive.gdn_commit` (fp32 state, updated in place)."""
    B, HV, K, V = state.shape
    n, H = k.shape[1], k.shape[2]
    P = path.shape[1]
    if P == 0:
        return
    BV = min(block_v, triton.next_power_of_2(V))
    NV = triton.cdiv(V, BV)
    _commit_kernel[(B * HV * NV,)](state, k.contiguous(), g.contiguous(), u.contiguous(), path.contiguous(),
                                   length.contiguous(), n, P, H=H, HV=HV, K=K, V=V,
                                   BK=triton.next_power_of_2(K), BV=BV, NV=NV, PP=P,
                                   num_warps=num_warps)


def pending_args(pending, device):
    """Kernel arguments for an optional pending update: (k, g, u, length, P, PP, present); PP, the
    rows `advance_tile` unrolls over, is the buffer's P itself, not a power of two: every row
    visited costs time even when dead (a 9-row chain buffer padded to 16 rows cost ~0.75 us a
    layer more at the paper shape, H100, pending_update_c5c8bdd_h100.json)."""
    if pending is None or pending[0].shape[1] == 0:
        # never read (every load sits under HAS_PENDING): uninitialised, so no fill kernel joins
        # each layer's launch (it cost ~13 us of a 0.37 ms AR step of the demo target)
        dummy = torch.empty(1, device=device)
        return dummy, dummy, dummy, torch.empty(1, dtype=torch.long, device=device), 0, 1, False
    pk, pg, pu, plen = pending
    P = pk.shape[1]
    return pk.contiguous(), pg.contiguous(), pu.contiguous(), plen.contiguous(), P, P, True
