"""Tree-masked parallel verifier: the UT (WY) form with the tree mask inside A (SpecLA §4.2).

In the layout of DESIGN §2 (S ∈ R^{K×V}, o = Sᵀq), with M̄ the ancestor-or-self mask,
log Γ = M̄ g and D_{ji} = Γ_j / Γ_i:

    A    = (M̄ - I) ∘ D ∘ diag(β) K Kᵀ           strictly lower triangular
    U    = (I + A)⁻¹ diag(β) (V - diag(Γ) K S₀)  rows u_j, the factors the commit consumes
    Attn = M̄ ∘ D ∘ Q Kᵀ
    O    = scale (diag(Γ) Q S₀ + Attn U)

One program per (row, value head, V-tile) does everything for all n nodes, and nothing in it
waits on another node's result but the solve. The state tile enters through four matmuls
(K Kᵀ, Q Kᵀ, K S₀, Q S₀, accumulated over K blocks on the tensor cores), so a node costs no
pass over the tile of its own, unlike the serial verifier, whose recurrence over the tile is
one latency-bound step per node.

The solve is Jacobi's iteration U ← R − A U from U = R: A has a non-zero (j, i) only where i
is a strict ancestor of j, so after t steps every node at depth ≤ t + 1 holds its final row,
and a node's final row is computed from its ancestors' final rows exactly as forward
substitution would. Steps = the tree's depth − 1, each one small matmul: 3 for the shallow
wide trees of a beam search, where substitution row by row would take n − 1 dependent steps.

The K-long matmuls use `tf32x3` (three TF32 products: ~fp32 accuracy on the tensor cores; the
bf16 activations are exact in TF32); the node-by-node products stay IEEE fp32.

`pending = (k, g, u, length)` (delayed update, SpecLA §5.2) is applied to each state block right
after it is loaded, in the closed rank-P form Γ_P S + Σ_p (Γ_P/Γ_p) k_p u_pᵀ (one more matmul per
block; node by node it would unroll P loads per block), and the advanced block is written
back: the verify is also the flush. `valid` [B]: nodes from valid[b] on are padding (`drafters.base.pad_draft`); their o
and u are written as zeros and the solve stops at the deepest real node.

The nodes are padded to NT = max(16, next power of two ≥ n) rows (`tl.dot` needs dims ≥ 16),
except where node 0 is peeled off (`peels`: a tree of 32 drafts, 33 nodes, whose 64-row block
spilled and ran 2.3x slower than the peeled 32-row one). Node 0 is the root (`topology`), so its
u row is its R row, final before any solve, and its products with the state and the other
nodes (S₀ᵀk₀, S₀ᵀq₀, K k₀, Q k₀, q₀·k₀) are summed beside the block's matmuls; its
descendants see it as one known term in R (−β D_{j0} (k_j·k₀) u₀) and in O. M̄
comes from `ops.ancestor_closure` (on the device, cached per parent array, so shared by every
layer of a round and capturable). Needs K, V ≥ 16. Registers grow as NT²: meant for draft
trees (n ≤ MAX_NODES).

Unlike the serial verifier, a node's output is not computed from its parent's materialised
state, and the flush is not the commit's node-by-node update, so the bits differ from the
serial path's: exact mode (docs/exact.md) keeps the serial verifier.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla.ops.gdn.commit import pending_args, real_nodes
from specla.ops.gdn.schedule import plan_for
from specla.ops.gdn.serial import _rows


@triton.jit(do_not_specialize=["n", "P"])
def _parallel_verify_kernel(
    q, k, v, g, beta, state, o, u, mask,
    pk, pg, pu, plen, valid,
    scale, n, P,
    s_qb, s_qn, s_kb, s_kn, s_vb, s_vn,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BKC: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, NT: tl.constexpr, MW: tl.constexpr,
    PD: tl.constexpr, PEEL: tl.constexpr, HAS_PENDING: tl.constexpr, HAS_VALID: tl.constexpr, PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    b, hv, vt = pid // (HV * NV), (pid // NV) % HV, pid % NV
    i_h = hv // (HV // H)
    rows = tl.arange(0, NT)
    node = rows + 1 if PEEL else rows  # with PEEL the block's rows are nodes 1..NT (module docstring)
    n_real = n
    if HAS_VALID:
        n_real = real_nodes(valid, b, n)
    live = node < n
    o_v = vt * BV + tl.arange(0, BV)
    mv = o_v < V

    p_M = mask + b * MW * MW  # the closure is MW wide, zero past n
    Mb = tl.load(p_M + node[:, None] * MW + node[None, :]) > 0  # ancestor-or-self
    gg = tl.load(g + (b * n + node) * HV + hv, mask=live, other=0.0).to(tl.float32)
    bb = tl.load(beta + (b * n + node) * HV + hv, mask=live, other=0.0).to(tl.float32)
    p_v = v + b.to(tl.int64) * s_vb + node[:, None] * s_vn + hv * V + o_v[None, :]
    b_v = tl.load(p_v, mask=live[:, None] & mv[None, :], other=0.0).to(tl.float32)
    p_q0 = q + b.to(tl.int64) * s_qb + i_h * K
    p_k0 = k + b.to(tl.int64) * s_kb + i_h * K
    p_q = p_q0 + node[:, None] * s_qn
    p_k = p_k0 + node[:, None] * s_kn
    p_S = state + (b * HV + hv).to(tl.int64) * K * V + o_v[None, :]
    if PEEL:
        g0 = tl.load(g + b * n * HV + hv).to(tl.float32)
        b0 = tl.load(beta + b * n * HV + hv).to(tl.float32)
        v0 = tl.load(v + b.to(tl.int64) * s_vb + hv * V + o_v, mask=mv, other=0.0).to(tl.float32)
        # node 0's products (K k₀, Q k₀ over the block's rows, S₀ᵀk₀, S₀ᵀq₀, q₀·k₀), accumulated
        # elementwise in the blocks' own layouts and reduced once after the loop: a reduction
        # per block put a cross-warp exchange on the loop's critical path (+40% at 17 nodes)
        Kk0 = tl.zeros([NT, BKC], dtype=tl.float32)
        Qk0 = tl.zeros([NT, BKC], dtype=tl.float32)
        k0S = tl.zeros([BKC, BV], dtype=tl.float32)
        q0S = tl.zeros([BKC, BV], dtype=tl.float32)
        q0k0 = tl.zeros([BKC], dtype=tl.float32)
    if HAS_PENDING:
        # S <- Γ_P S + Σ_p (Γ_P / Γ_p) k_p u_pᵀ over the live pending factors, as one product
        # per K block; rows past the length are masked, never multiplied (garbage stays out)
        pr = tl.arange(0, PD)
        n_live = tl.load(plen + b)
        livep = pr < tl.minimum(n_live, P)
        gp = tl.load(pg + (b * P + pr) * HV + hv, mask=livep, other=0.0).to(tl.float32)
        g_all = tl.sum(gp, 0)
        W = tl.where(livep, tl.exp(g_all - tl.cumsum(gp, 0)), 0.0)
        WU = W[:, None] * tl.load(pu + ((b * P + pr[:, None]) * HV + hv).to(tl.int64) * V + o_v[None, :],
                                  mask=livep[:, None] & mv[None, :], other=0.0).to(tl.float32)
        Gam_P = tl.exp(g_all)
        flush = n_live > 0  # an empty pending buffer leaves the state as it is
    KK = tl.zeros([NT, NT], dtype=tl.float32)
    QK = tl.zeros([NT, NT], dtype=tl.float32)
    KS = tl.zeros([NT, BV], dtype=tl.float32)
    QS = tl.zeros([NT, BV], dtype=tl.float32)
    for k0 in range(0, K, BKC):
        o_k = k0 + tl.arange(0, BKC)
        mk = o_k < K
        b_k = tl.load(p_k + o_k[None, :], mask=live[:, None] & mk[None, :], other=0.0).to(tl.float32)
        b_q = tl.load(p_q + o_k[None, :], mask=live[:, None] & mk[None, :], other=0.0).to(tl.float32)
        m_S = mk[:, None] & mv[None, :]
        S = tl.load(p_S + o_k[:, None] * V, mask=m_S, other=0.0)
        if HAS_PENDING:
            # the pending update is elementwise along K, so each block advances on its own
            Kp = tl.load(pk + ((b * P + pr[None, :]) * H + i_h).to(tl.int64) * K + o_k[:, None],
                         mask=mk[:, None] & livep[None, :], other=0.0).to(tl.float32)
            S = Gam_P * S + tl.dot(Kp, WU, input_precision=PREC)
            if flush:
                tl.store(p_S + o_k[:, None] * V, S, mask=m_S)
        KK = tl.dot(b_k, tl.trans(b_k), KK, input_precision=PREC)
        QK = tl.dot(b_q, tl.trans(b_k), QK, input_precision=PREC)
        KS = tl.dot(b_k, S, KS, input_precision=PREC)
        QS = tl.dot(b_q, S, QS, input_precision=PREC)
        if PEEL:
            r_k = tl.load(p_k0 + o_k, mask=mk, other=0.0).to(tl.float32)
            r_q = tl.load(p_q0 + o_k, mask=mk, other=0.0).to(tl.float32)
            Kk0 += b_k * r_k[None, :]
            Qk0 += b_q * r_k[None, :]
            k0S += r_k[:, None] * S
            q0S += r_q[:, None] * S
            q0k0 += r_q * r_k

    Gc = tl.sum(tl.where(Mb, gg[None, :], 0.0), 1)  # log Γ_j
    if PEEL:
        Gc += g0  # node 0, the root, is every node's ancestor
    D = tl.where(Mb, tl.exp(Gc[:, None] - Gc[None, :]), 0.0)
    Gam = tl.exp(Gc)
    A = tl.where(rows[:, None] > rows[None, :], bb[:, None] * D * KK, 0.0)
    R = bb[:, None] * (b_v - Gam[:, None] * KS)
    if PEEL:
        # node 0 has no ancestors: its row of the solve is its R row, final at once
        u0 = b0 * (v0 - tl.exp(g0) * tl.sum(k0S, 0))
        D0 = tl.exp(Gc - g0)  # Γ_j / Γ_0
        R -= (bb * D0 * tl.sum(Kk0, 1))[:, None] * u0[None, :]
    # Jacobi steps up to the deepest real node of the block (depth = ancestors and itself)
    depth = tl.max(tl.where(node < n_real, tl.sum(Mb.to(tl.int32), 1), 0), 0)
    U = R
    for _ in range(1, depth):
        U = R - tl.dot(A, U, input_precision="ieee")
    O = Gam[:, None] * QS + tl.dot(D * QK, U, input_precision="ieee")
    if PEEL:
        O += (D0 * tl.sum(Qk0, 1))[:, None] * u0[None, :]
    O = O * scale

    real = node < n_real
    p_out = ((b * n + node[:, None]) * HV + hv).to(tl.int64) * V + o_v[None, :]
    m_out = live[:, None] & mv[None, :]
    tl.store(o + p_out, tl.where(real[:, None], O, 0.0), mask=m_out)
    tl.store(u + p_out, tl.where(real[:, None], U, 0.0), mask=m_out)
    if PEEL:
        O0 = (tl.exp(g0) * tl.sum(q0S, 0) + tl.sum(q0k0, 0) * u0) * scale
        p_out0 = (b * n * HV + hv).to(tl.int64) * V + o_v
        tl.store(o + p_out0, tl.where(n_real > 0, O0, 0.0), mask=mv)
        tl.store(u + p_out0, tl.where(n_real > 0, u0, 0.0), mask=mv)


# (NT, PEEL) -> (BV, BKC, warps): spill-free at the paper shape (`python -m specla.ops.aot_check`)
TILINGS = {(16, False): (16, 32, 4), (32, False): (16, 32, 4), (32, True): (16, 16, 4)}
# (NT, PEEL, BV, BKC, warps): what `bench kernels` times besides them (and aot_check compiles)
SWEEP = ((16, False, 32, 32, 4), (32, False, 16, 16, 4), (32, False, 32, 16, 8), (32, True, 16, 16, 8))
MAX_NODES = 33  # NT = 32 with node 0 peeled; at NT = 64 the pending update spills


def peels(n: int) -> bool:
    """Whether node 0 is peeled off: only where it halves the block (33 nodes: 32 rows, not 64,
    whose pending update spills). At 17 nodes the 16-row peeled block was slower than the 32-row
    one (H100: 16.9 against 16.2 µs a layer with a pending update; parallel_peel_9ca4006_h100.json)."""
    return n > 32


def _block_rows(n: int) -> int:
    """A block's rows for n nodes: a power of two, at least 16 (tl.dot)."""
    return max(16, triton.next_power_of_2(n))


def padded_nodes(n: int) -> int:
    """NT, the block's rows for a topology of n nodes."""
    return _block_rows(n - 1 if peels(n) else n)


def gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending=None, valid=None, *,
                    block_v: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, precision: str = "tf32x3"):
    """Same contract as `naive.gdn_tree_verify` (fp32 state; K, V >= 16; n <= MAX_NODES). The tiling
    defaults to `TILINGS` for the padded node count."""
    B, n, HV, V = v.shape
    H, K = k.shape[2], k.shape[3]
    if K < 16 or V < 16:
        raise ValueError(f"the parallel verifier needs K, V >= 16 (tl.dot), got K={K}, V={V}")
    dev = state.device
    NT = padded_nodes(n)
    if n > MAX_NODES:
        raise ValueError(f"the parallel verifier takes up to {MAX_NODES} nodes, got {n}")
    bv, bk, warps = TILINGS[NT, peels(n)]
    BV = max(16, min(block_v or bv, triton.next_power_of_2(V)))
    BKC = max(16, min(block_k or bk, triton.next_power_of_2(K)))
    MW = _block_rows(n)  # the closure's width: every row of the block lies inside
    mask = plan_for(parents).closure(parents, MW)  # cached on the caller's tensor: once per round
    q, k, v = _rows(q), _rows(k), _rows(v)
    o = torch.empty(B, n, HV, V, dtype=state.dtype, device=dev)
    u = torch.empty_like(o)
    pk, pg, pu, plen, P, PP, has_pending = pending_args(pending, dev)
    grid = (B * HV * triton.cdiv(V, BV),)
    _parallel_verify_kernel[grid](
        q, k, v, g.contiguous(), beta.contiguous(), state, o, u, mask,
        pk, pg, pu, plen, plen if valid is None else valid.contiguous(),
        scale, n, P, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        H=H, HV=HV, K=K, V=V, BKC=BKC, BV=BV, NV=triton.cdiv(V, BV), NT=NT, MW=MW,
        PD=max(16, triton.next_power_of_2(PP)), PEEL=peels(n), HAS_PENDING=has_pending, HAS_VALID=valid is not None, PREC=precision, num_warps=num_warps or warps,
        **({"num_stages": num_stages} if num_stages else {}))
    return o, u
