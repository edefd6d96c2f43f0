"""Triton factor commit (SpecLA §5.1, DESIGN §2): advance S along an accepted path in place.

    S <- Γ_A S + Σ_i (Γ_A / Γ_{a_i}) k_{a_i} u_{a_i}ᵀ

One program per (row, value head, V-tile) loads its K×BV state tile once, gathers the A
accepted factor rows at once (so their loads overlap instead of paying one memory latency per
accepted token), applies the rank-A update in registers and stores the tile. The rank-A sum is
one `tl.dot` of the weighted keys and the updates (A padded to 16) when the V-tile is at least
16 wide; narrower tiles pick the rows out of registers one at a time. `advance_tile` is
the same update as a device function: the verifiers call it to apply a pending (delayed) commit
to the tile they just loaded (SpecLA §5.2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
def advance_tile(S, b, hv, i_h, k, g, u, path, length, n_src, P,
                 o_k, mk, o_v, mv,
                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 PP: tl.constexpr, HAS_PATH: tl.constexpr, USE_DOT: tl.constexpr):
    """Apply the first length[b] factors of row b (nodes path[b, :], or 0.. without a path).

    k [B, n_src, H, K], g [B, n_src, HV], u [B, n_src, HV, V] are contiguous; S is the
    [BK, BV] fp32 tile of rows o_k, columns o_v.
    """
    # Every load below is independent of length[b] (rows past it are read, then zeroed with
    # `where`, never multiplied, so garbage there cannot turn into NaN): the factor loads are
    # issued together with the caller's state load instead of one memory latency after it.
    n_live = tl.load(length + b)
    if USE_DOT:
        i = tl.arange(0, PP)
        inb = i < P
        live = inb & (i < n_live)
        if HAS_PATH:
            nodes = tl.load(path + b * P + i, mask=inb, other=0).to(tl.int64)
            nodes = tl.minimum(tl.maximum(nodes, 0), n_src - 1)
        else:
            nodes = i.to(tl.int64)
        row = b * n_src + nodes
        kk = tl.load(k + (row[:, None] * H + i_h) * K + o_k[None, :],
                     mask=inb[:, None] & mk[None, :], other=0.0).to(tl.float32)  # [PP, BK]
        gg = tl.load(g + row * HV + hv, mask=inb, other=0.0).to(tl.float32)  # [PP]
        uu = tl.load(u + (row[:, None] * HV + hv) * V + o_v[None, :],
                     mask=inb[:, None] & mv[None, :], other=0.0).to(tl.float32)  # [PP, BV]
        gg = tl.where(live, gg, 0.0)
        G = tl.cumsum(gg, 0)  # log Γ_i (dead rows add 0)
        GA = tl.sum(gg, 0)
        kw = tl.where(live[:, None], kk * tl.exp(GA - G)[:, None], 0.0)
        uu = tl.where(live[:, None], uu, 0.0)
        S = S * tl.exp(GA) + tl.dot(tl.trans(kw), uu, input_precision="tf32x3")
    else:
        # narrow tiles: one rank-1 update per factor, each row loaded straight into the
        # vector layout it is used in (no picking rows out of a register block)
        GA = 0.0
        for p in tl.static_range(PP):
            _, _, gp = _factor(path, g, b, hv, p, P, n_live, n_src, HV, HAS_PATH)
            GA += gp
        S = S * tl.exp(GA)
        G = 0.0
        for p in tl.static_range(PP):
            row, livep, gp = _factor(path, g, b, hv, p, P, n_live, n_src, HV, HAS_PATH)
            G += gp
            kr = tl.load(k + (row * H + i_h) * K + o_k, mask=mk & (p < P), other=0.0).to(tl.float32)
            ur = tl.load(u + (row * HV + hv) * V + o_v, mask=mv & (p < P), other=0.0).to(tl.float32)
            kr = tl.where(livep, kr * tl.exp(GA - G), 0.0)
            ur = tl.where(livep, ur, 0.0)
            S += kr[:, None] * ur[None, :]
    return S


@triton.jit
def _commit_kernel(state, k, g, u, path, length, n, P,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, PP: tl.constexpr,
                   USE_DOT: tl.constexpr):
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
                     H, HV, K, V, PP, True, USE_DOT)
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
    PP, use_dot = update_width(P, BV, K)
    _commit_kernel[(B * HV * NV,)](state, k.contiguous(), g.contiguous(), u.contiguous(), path.contiguous(),
                                   length.contiguous(), n, P, H=H, HV=HV, K=K, V=V,
                                   BK=triton.next_power_of_2(K), BV=BV, NV=NV, PP=PP, USE_DOT=use_dot,
                                   num_warps=num_warps)


def update_width(P: int, BV: int, K: int) -> tuple[int, bool]:
    """(padded path width PP, whether the rank-PP update is a tl.dot): dots need dims >= 16."""
    use_dot = BV >= 16 and K >= 16
    return max(16 if use_dot else 1, triton.next_power_of_2(max(P, 1))), use_dot


def pending_args(pending, device, BV: int, K: int):
    """Kernel arguments for an optional pending update: (k, g, u, length, P, PP, use_dot, present)."""
    if pending is None or pending[0].shape[1] == 0:
        dummy = torch.empty(1, device=device)
        return dummy, dummy, dummy, torch.zeros(1, dtype=torch.long, device=device), 0, 1, False, False
    pk, pg, pu, plen = pending
    P = pk.shape[1]
    PP, use_dot = update_width(P, BV, K)
    return pk.contiguous(), pg.contiguous(), pu.contiguous(), plen.contiguous(), P, PP, use_dot, True
