"""Tree-masked parallel verifier: the UT (WY) form with the tree mask inside A (SpecLA §4.2).

In the layout of DESIGN §2 (S ∈ R^{K×V}, o = Sᵀq), with M̄ the ancestor-or-self mask,
log Γ = M̄ g and D_{ji} = Γ_j / Γ_i:

    A    = (M̄ - I) ∘ D ∘ diag(β) K Kᵀ           strictly lower triangular
    U    = (I + A)⁻¹ diag(β) (V - diag(Γ) K S₀)  forward substitution, rows u_j
    Attn = M̄ ∘ D ∘ Q Kᵀ
    O    = scale (diag(Γ) Q S₀ + Attn U)

One program per (row, value head, V-tile) does everything for all n nodes: a single pass over
K blocks accumulates K Kᵀ, Q Kᵀ, K S₀ and Q S₀ with `tl.dot` (the K×BV state tile is read once),
followed by the substitution on the [n, BV] right-hand side in registers. K Kᵀ and Q Kᵀ are
recomputed per V-tile instead of being staged through memory by a separate kernel. fp32 dots
run in IEEE precision (no TF32) to match the recurrence; K blocks of 16 keep the FMA-dot
operands in registers (wider blocks make ptxas spill).

A pending (delayed) commit is applied by the commit kernel before the launch: the fused form
belongs to the serial and hybrid verifiers, and keeping it out of this kernel keeps its
register use spill-free.

The nodes are padded to NT = max(16, next power of two ≥ n) (tl.dot needs dims ≥ 16 and
Triton tiles are powers of two); M̄ comes from `schedule.ancestor_closure` (device-side, cached
per parent array). Needs K, V ≥ 16. Register use grows as NT²: meant for draft trees (n ≤ 64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla.ops.gdn import commit
from specla.ops.gdn.schedule import plan_for
from specla.ops.gdn.serial import _rows


@triton.jit
def _parallel_verify_kernel(
    q, k, v, g, beta, state, o, u, mask,
    scale, n,
    s_qb, s_qn, s_kb, s_kn, s_vb, s_vn,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BKC: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, NT: tl.constexpr,
):
    pid = tl.program_id(0)
    b, hv, vt = pid // (HV * NV), (pid // NV) % HV, pid % NV
    i_h = hv // (HV // H)
    rows = tl.arange(0, NT)
    live = rows < n
    o_v = vt * BV + tl.arange(0, BV)
    mv = o_v < V

    Mb = tl.load(mask + b * NT * NT + rows[:, None] * NT + rows[None, :]) > 0  # ancestor-or-self
    gg = tl.load(g + (b * n + rows) * HV + hv, mask=live, other=0.0).to(tl.float32)
    bb = tl.load(beta + (b * n + rows) * HV + hv, mask=live, other=0.0).to(tl.float32)
    Gc = tl.sum(tl.where(Mb, gg[None, :], 0.0), 1)  # log Γ_j
    D = tl.where(Mb, tl.exp(Gc[:, None] - Gc[None, :]), 0.0)

    p_q = q + b.to(tl.int64) * s_qb + rows[:, None] * s_qn + i_h * K
    p_k = k + b.to(tl.int64) * s_kb + rows[:, None] * s_kn + i_h * K
    p_S = state + (b * HV + hv).to(tl.int64) * K * V + o_v[None, :]
    KK = tl.zeros([NT, NT], dtype=tl.float32)
    QK = tl.zeros([NT, NT], dtype=tl.float32)
    KS = tl.zeros([NT, BV], dtype=tl.float32)
    QS = tl.zeros([NT, BV], dtype=tl.float32)
    for k0 in range(0, K, BKC):
        o_k = k0 + tl.arange(0, BKC)
        mk = o_k < K
        b_k = tl.load(p_k + o_k[None, :], mask=live[:, None] & mk[None, :], other=0.0).to(tl.float32)
        b_q = tl.load(p_q + o_k[None, :], mask=live[:, None] & mk[None, :], other=0.0).to(tl.float32)
        S = tl.load(p_S + o_k[:, None] * V, mask=mk[:, None] & mv[None, :], other=0.0)
        KK += tl.dot(b_k, tl.trans(b_k), input_precision="ieee")
        QK += tl.dot(b_q, tl.trans(b_k), input_precision="ieee")
        KS += tl.dot(b_k, S, input_precision="ieee")
        QS += tl.dot(b_q, S, input_precision="ieee")

    Gam = tl.exp(Gc)
    Attn = D * QK
    A = tl.where(rows[:, None] > rows[None, :], bb[:, None] * D * KK, 0.0)
    p_v = v + b.to(tl.int64) * s_vb + rows[:, None] * s_vn + hv * V + o_v[None, :]
    b_v = tl.load(p_v, mask=live[:, None] & mv[None, :], other=0.0).to(tl.float32)
    U = bb[:, None] * (b_v - Gam[:, None] * KS)
    # forward substitution (I + A) U = R, one row at a time (A is strictly lower triangular)
    for i in range(1, NT):
        a_i = tl.sum(tl.where(rows[:, None] == i, A, 0.0), 0)  # row i of A
        upd = tl.sum(a_i[:, None] * U, 0)
        U = tl.where(rows[:, None] == i, U - upd[None, :], U)
    O = (Gam[:, None] * QS + tl.dot(Attn, U, input_precision="ieee")) * scale

    p_out = ((b * n + rows[:, None]) * HV + hv).to(tl.int64) * V + o_v[None, :]
    m_out = live[:, None] & mv[None, :]
    tl.store(o + p_out, O, mask=m_out)
    tl.store(u + p_out, U, mask=m_out)


def gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending=None, *,
                    block_v: int | None = None, num_warps: int = 8):
    """Same contract as `naive.gdn_tree_verify` (fp32 state; K, V >= 16). V-tiles of 32, or
    16 from 64 padded nodes on, where the [NT, NT] tiles take most of the registers."""
    B, n, HV, V = v.shape
    H, K = k.shape[2], k.shape[3]
    if K < 16 or V < 16:
        raise ValueError(f"the parallel verifier needs K, V >= 16 (tl.dot), got K={K}, V={V}")
    dev = state.device
    NT = max(16, triton.next_power_of_2(n))
    BV = max(16, min(block_v or (32 if NT <= 32 else 16), triton.next_power_of_2(V)))
    mask = plan_for(parents).closure(parents, NT)  # cached on the caller's tensor: once per round
    q, k, v = _rows(q), _rows(k), _rows(v)
    o = torch.empty(B, n, HV, V, dtype=state.dtype, device=dev)
    u = torch.empty_like(o)
    if pending is not None:
        pk, pg, pu, plen = pending
        commit.gdn_commit(state, pk, pg, pu, torch.arange(pk.shape[1], device=dev).expand(B, -1), plen)
    grid = (B * HV * triton.cdiv(V, BV),)
    _parallel_verify_kernel[grid](
        q, k, v, g.contiguous(), beta.contiguous(), state, o, u, mask,
        scale, n, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        H=H, HV=HV, K=K, V=V, BKC=16, BV=BV,
        NV=triton.cdiv(V, BV), NT=NT, num_warps=num_warps)
    return o, u
