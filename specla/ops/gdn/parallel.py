"""Tree-masked parallel verifier: the UT (WY) form with the tree mask inside A (SpecLA §4.2).

In the layout of DESIGN §2 (S ∈ R^{K×V}, o = Sᵀq), with M̄ the ancestor-or-self mask,
log Γ = M̄ g and D_{ji} = Γ_j / Γ_i:

    A    = (M̄ - I) ∘ D ∘ diag(β) K Kᵀ           strictly lower triangular
    U    = (I + A)⁻¹ diag(β) (V - diag(Γ) K S₀)  rows u_j, the factors the commit consumes
    Attn = M̄ ∘ D ∘ Q Kᵀ
    O    = scale (diag(Γ) Q S₀ + Attn U)

Two launches. `_products_kernel` forms the K-long products, split over K: a program per
(row, value head, V-tile, K stretch) multiplies its stretch of the state tile by the nodes'
keys and queries stacked into one operand ([K; Q] S₀: one product of 2·NT rows, so from NT = 32
a warpgroup's), and one more program per (row, q/k head, K stretch) forms that stretch's
[K; Q] Kᵀ; each writes its partial sums. `_solve_kernel`, a program per
(row, value head, V-tile), sums the partials and does the rest for all n nodes. The state
enters through tensor-core products (accumulated over K blocks), so a node costs no pass over
the tile of its own, unlike the serial verifier, whose recurrence is one latency-bound step per
node. Until 2026-12-06 this was one launch, a program per V-tile looping over the whole of K
and forming K Kᵀ and Q Kᵀ for itself (each of a head's V-tiles alike), with one warp per
multiprocessor partition to issue the loop's chain of dependent products; split, on an H100,
a 17-node tree with a pending update went from 17.5 to 13.0 µs a layer and a 33-node one from
28.2 to 25.4 (`benchmarks/diagnostics/parallel_split.py`, parallel_split_*_h100.json). Stacking
K and Q (2026-12-06, parallel_split_stacked_a147b95_h200.json, ..._07cc048_h100.json) took a
13-node tree with a pending update from 13.7 to 12.0 µs a layer on the H200 (13.6 to 12.3 on an
H100), a 17-node one from 12.8 to 12.7 (13.0 to 12.5), a 33-node one from 25.4 to 24.5 (25.4 to
24.9): the products kernel issues ~17% fewer instructions (ncu) for the same work.

The solve is Jacobi's iteration U ← R − A U from U = R: A has a non-zero (j, i) only where i
is a strict ancestor of j, so after t steps every node at depth ≤ t + 1 holds its final row,
and a node's final row is computed from its ancestors' final rows exactly as forward
substitution would. Steps = the tree's depth − 1, each one small matmul: 3 for the shallow
wide trees of a beam search, where substitution row by row would take n − 1 dependent steps.

The K-long matmuls use `tf32x3` (three TF32 products: ~fp32 accuracy on the tensor cores; q and
k are fp32 after the prelude, and one TF32 pass was 6e-4 off the reference on the H200,
parallel_split_variants_55d95ad_h200.json); the node-by-node products stay IEEE fp32.

With programmatic dependent launch (`ops.pdl`, Hopper) a products program loads, advances and
flushes its first state block before it waits for the prelude's keys and queries, and the solve
loads the mask and the prelude's v, g and beta, and forms the decays, before it waits for the
products (the products' programs only let it launch once they have waited for the prelude); the
first block is peeled off the block loop because Triton's pipeliner hoists a loop's loads above
a wait inside it.

`pending = (k, g, u, length)` (delayed update, SpecLA §5.2) is applied to each state block right
after it is loaded, in the closed rank-P form Γ_P S + Σ_p (Γ_P/Γ_p) k_p u_pᵀ (one more matmul per
block; node by node it would unroll P loads per block), and the advanced block is written
back: the verify is also the flush. `valid` [B]: nodes from valid[b] on are padding (`drafters.base.pad_draft`); their o
and u are written as zeros and the solve stops at the deepest real node.

The nodes are padded to NT = max(16, next power of two ≥ n) rows (`tl.dot` needs dims ≥ 16).
M̄ comes from `ops.ancestor_closure` (on the device, cached per parent array, so shared by every
layer of a round and capturable). Needs K, V ≥ 16. The solve's registers grow as NT²: meant
for draft trees (n ≤ MAX_NODES).

Unlike the serial verifier, a node's output is not computed from its parent's materialised
state, and the flush is not the commit's node-by-node update, so the bits differ from the
serial path's: exact mode (docs/exact.md) keeps the serial verifier.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla.ops import pdl
from specla.ops.gdn.commit import pending_args, real_nodes
from specla.ops.gdn.schedule import plan_for
from specla.ops.gdn.serial import _rows
from specla.ops.pdl import wait_previous


@triton.jit
def _state_block(p_S, o_k, mv, b, i_h, pk, P, pr, livep, Gam_P, WU, flush, H: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, HAS_PENDING: tl.constexpr, PREC: tl.constexpr):
    """Rows o_k of the state tile, advanced by the pending update and flushed (when there is one)."""
    mk = o_k < K
    m_S = mk[:, None] & mv[None, :]
    S = tl.load(p_S + o_k[:, None] * V, mask=m_S, other=0.0)
    if HAS_PENDING:
        # the pending update is elementwise along K, so each block advances on its own
        Kp = tl.load(pk + ((b * P + pr[None, :]) * H + i_h).to(tl.int64) * K + o_k[:, None],
                     mask=mk[:, None] & livep[None, :], other=0.0).to(tl.float32)
        S = Gam_P * S + tl.dot(Kp, WU, input_precision=PREC)
        if flush:
            tl.store(p_S + o_k[:, None] * V, S, mask=m_S)
    return S


@triton.jit
def _kq_times(p_kq, o_k, live2, S, acc, K: tl.constexpr, PREC: tl.constexpr):
    """acc + [K; Q] columns o_k times the state rows o_k."""
    b_kq = tl.load(p_kq[:, None] + o_k[None, :], mask=live2[:, None] & (o_k < K)[None, :], other=0.0)
    return tl.dot(b_kq.to(tl.float32), S, acc, input_precision=PREC)


@triton.jit(do_not_specialize=["n", "P"])
def _products_kernel(
    q, k, state, pk, pg, pu, plen, ks, qs, kk, qk,
    n, P,
    s_qb, s_qn, s_kb, s_kn,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BKC: tl.constexpr, KW: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, NKS: tl.constexpr,
    NT: tl.constexpr, PD: tl.constexpr, HAS_PENDING: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
):
    # axis 0: (row, value head, V-tile), with one more "tile" a value head for K Kᵀ and Q Kᵀ (idle
    # but for a group's first value head under GVA); axis 1: K stretch. Keys and queries are
    # one [2 NT, BKC] operand (rows NT.. the queries): one product of M = 2 NT a block, not two
    pid, s = tl.program_id(0), tl.program_id(1)
    b, hv, vt = pid // (HV * (NV + 1)), (pid // (NV + 1)) % HV, pid % (NV + 1)
    i_h = hv // (HV // H)
    r2 = tl.arange(0, 2 * NT)
    isq = r2 >= NT
    rr = tl.where(isq, r2 - NT, r2)
    live2 = rr < n
    p_kq = tl.where(isq, q + b.to(tl.int64) * s_qb + rr * s_qn, k + b.to(tl.int64) * s_kb + rr * s_kn) + i_h * K
    if vt < NV:
        o_v = vt * BV + tl.arange(0, BV)
        mv = o_v < V
        p_S = state + (b * HV + hv).to(tl.int64) * K * V + o_v[None, :]
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
        else:  # unused: the update is compiled out
            pr, livep, WU, Gam_P, flush = None, None, None, None, None
        # the state and its pending update are this layer's own: with PDL the first block is
        # loaded, advanced and flushed while the prelude still writes the keys and queries. The
        # wait sits before the block loop, whose loads Triton's pipeliner hoists ahead of it
        o_k = s * KW + tl.arange(0, BKC)
        S = _state_block(p_S, o_k, mv, b, i_h, pk, P, pr, livep, Gam_P, WU, flush, H, K, V, HAS_PENDING, PREC)
        wait_previous(PDL)
        KQS = _kq_times(p_kq, o_k, live2, S, tl.zeros([2 * NT, BV], dtype=tl.float32), K, PREC)
        for k0 in range(s * KW + BKC, s * KW + KW, BKC):
            o_k = k0 + tl.arange(0, BKC)
            S = _state_block(p_S, o_k, mv, b, i_h, pk, P, pr, livep, Gam_P, WU, flush, H, K, V, HAS_PENDING, PREC)
            KQS = _kq_times(p_kq, o_k, live2, S, KQS, K, PREC)
        p_o = tl.where(isq, qs, ks)[:, None] + ((((b * HV + hv) * NKS + s) * NT + rr).to(tl.int64) * V)[:, None] \
            + o_v[None, :]
        tl.store(p_o, KQS, mask=live2[:, None] & mv[None, :])
    elif hv % (HV // H) == 0:  # K Kᵀ and Q Kᵀ of the q/k head, formed by its first value head's extra tile
        wait_previous(PDL)
        rows = tl.arange(0, NT)
        live = rows < n
        p_k = k + b.to(tl.int64) * s_kb + i_h * K + rows[:, None] * s_kn
        KQK = tl.zeros([2 * NT, NT], dtype=tl.float32)
        for k0 in range(s * KW, s * KW + KW, BKC):
            o_k = k0 + tl.arange(0, BKC)
            mk = o_k < K
            b_kq = tl.load(p_kq[:, None] + o_k[None, :], mask=live2[:, None] & mk[None, :], other=0.0).to(tl.float32)
            b_k = tl.load(p_k + o_k[None, :], mask=live[:, None] & mk[None, :], other=0.0).to(tl.float32)
            KQK = tl.dot(b_kq, tl.trans(b_k), KQK, input_precision=PREC)
        p_g = tl.where(isq, qk, kk)[:, None] + ((((b * H + i_h) * NKS + s) * NT + rr).to(tl.int64) * NT)[:, None] \
            + rows[None, :]
        tl.store(p_g, KQK)


@triton.jit(do_not_specialize=["n"])
def _solve_kernel(
    v, g, beta, o, u, mask, valid, ks, qs, kk, qk,
    scale, n, s_vb, s_vn,
    H: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, NKS: tl.constexpr,
    NT: tl.constexpr, HAS_VALID: tl.constexpr, PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    b, hv, vt = pid // (HV * NV), (pid // NV) % HV, pid % NV
    i_h = hv // (HV // H)
    rows = tl.arange(0, NT)
    n_real = n
    if HAS_VALID:
        n_real = real_nodes(valid, b, n)
    live = rows < n
    o_v = vt * BV + tl.arange(0, BV)
    mv = o_v < V
    m_o = live[:, None] & mv[None, :]

    # Before the wait: the mask (the round's, made before its first layer) and the prelude's
    # v, g and beta. The prelude ran two launches back: no products program lets this launch
    # start before it has waited for the prelude to finish, so these were complete and visible
    # before any solve program began. What follows the wait is the products'.
    Mb = tl.load(mask + b * NT * NT + rows[:, None] * NT + rows[None, :]) > 0  # ancestor-or-self
    gg = tl.load(g + (b * n + rows) * HV + hv, mask=live, other=0.0).to(tl.float32)
    bb = tl.load(beta + (b * n + rows) * HV + hv, mask=live, other=0.0).to(tl.float32)
    b_v = tl.load(v + b.to(tl.int64) * s_vb + rows[:, None] * s_vn + hv * V + o_v[None, :],
                  mask=m_o, other=0.0).to(tl.float32)
    Gc = tl.sum(tl.where(Mb, gg[None, :], 0.0), 1)  # log Γ_j
    D = tl.where(Mb, tl.exp(Gc[:, None] - Gc[None, :]), 0.0)
    Gam = tl.exp(Gc)
    # Jacobi steps up to the deepest real node (depth = ancestors and itself)
    depth = tl.max(tl.where(rows < n_real, tl.sum(Mb.to(tl.int32), 1), 0), 0)
    wait_previous(PDL)
    KS = tl.zeros([NT, BV], dtype=tl.float32)
    QS = tl.zeros([NT, BV], dtype=tl.float32)
    KK = tl.zeros([NT, NT], dtype=tl.float32)
    QK = tl.zeros([NT, NT], dtype=tl.float32)
    for s in tl.static_range(NKS):
        p_o = (((b * HV + hv) * NKS + s) * NT + rows[:, None]).to(tl.int64) * V + o_v[None, :]
        KS += tl.load(ks + p_o, mask=m_o, other=0.0)
        QS += tl.load(qs + p_o, mask=m_o, other=0.0)
        p_g = (((b * H + i_h) * NKS + s) * NT + rows[:, None]).to(tl.int64) * NT + rows[None, :]
        KK += tl.load(kk + p_g)
        QK += tl.load(qk + p_g)

    A = tl.where(rows[:, None] > rows[None, :], bb[:, None] * D * KK, 0.0)
    R = bb[:, None] * (b_v - Gam[:, None] * KS)
    U = R
    for _ in range(1, depth):
        U = R - tl.dot(A, U, input_precision="ieee")
    O = (Gam[:, None] * QS + tl.dot(D * QK, U, input_precision="ieee")) * scale

    real = rows < n_real
    p_out = ((b * n + rows[:, None]) * HV + hv).to(tl.int64) * V + o_v[None, :]
    tl.store(o + p_out, tl.where(real[:, None], O, 0.0), mask=m_o)
    tl.store(u + p_out, tl.where(real[:, None], U, 0.0), mask=m_o)


# NT -> (BV, KW, BKC, products' warps, solve's warps): KW, the K columns a products program
# takes (a multiple of BKC, its block); the fastest of parallel_split.py's sweeps with a pending
# update (NT = 16 and 32: the H200's, stacked operands, one 64-column block a program; NT = 64:
# the H100's before stacking, with half the K columns: stacked, 64 would spill), and spill-free at
# the paper shape (`python -m specla.ops.aot_check`)
TILINGS = {16: (32, 64, 64, 4, 4), 32: (32, 64, 64, 4, 4), 64: (16, 32, 32, 4, 8)}
# (NT, tiling): what `bench kernels` times besides them (and aot_check compiles)
SWEEP = ((16, (16, 32, 32, 4, 4)), (32, (32, 64, 32, 4, 4)), (32, (16, 64, 64, 4, 4)), (64, (16, 64, 32, 8, 8)))
MAX_NODES = 64


def padded_nodes(n: int) -> int:
    """NT, the block's rows for a topology of n nodes: a power of two, at least 16 (tl.dot)."""
    return max(16, triton.next_power_of_2(n))


def gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending=None, valid=None, *,
                    tiling: tuple[int, int, int, int, int] | None = None, precision: str = "tf32x3"):
    """Same contract as `naive.gdn_tree_verify` (fp32 state; K, V >= 16; n <= MAX_NODES). tiling:
    (BV, KW, BKC, products' warps, solve's warps), default `TILINGS` for the padded node count."""
    B, n, HV, V = v.shape
    H, K = k.shape[2], k.shape[3]
    if K < 16 or V < 16:
        raise ValueError(f"the parallel verifier needs K, V >= 16 (tl.dot), got K={K}, V={V}")
    if n > MAX_NODES:
        raise ValueError(f"the parallel verifier takes up to {MAX_NODES} nodes, got {n}")
    dev = state.device
    NT = padded_nodes(n)
    bv, kw, bk, warps, solve_warps = tiling or TILINGS[NT]
    BV = max(16, min(bv, triton.next_power_of_2(V)))
    BKC = max(16, min(bk, triton.next_power_of_2(K)))
    KW = max(BKC, kw // BKC * BKC)
    NV, NKS = triton.cdiv(V, BV), triton.cdiv(K, KW)
    mask = plan_for(parents).closure(parents, NT)  # cached on the caller's tensor: once per round
    # copies made before the products launch: the solve reads v, g and beta before it waits,
    # which holds only for what was written before the products ran
    q, k, v = _rows(q), _rows(k), _rows(v)
    g, beta, valid = g.contiguous(), beta.contiguous(), None if valid is None else valid.contiguous()
    f32 = dict(dtype=torch.float32, device=dev)
    ks, qs = torch.empty(B, HV, NKS, NT, V, **f32), torch.empty(B, HV, NKS, NT, V, **f32)
    kk, qk = torch.empty(B, H, NKS, NT, NT, **f32), torch.empty(B, H, NKS, NT, NT, **f32)
    pk, pg, pu, plen, P, PP, has_pending = pending_args(pending, dev)
    pdl_options = pdl.launch_options(dev)
    _products_kernel[(B * HV * (NV + 1), NKS)](
        q, k, state, pk, pg, pu, plen, ks, qs, kk, qk, n, P,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        H=H, HV=HV, K=K, V=V, BKC=BKC, KW=KW, BV=BV, NV=NV, NKS=NKS, NT=NT,
        PD=max(16, triton.next_power_of_2(PP)), HAS_PENDING=has_pending, PREC=precision, num_warps=warps,
        **pdl_options)
    o = torch.empty(B, n, HV, V, dtype=state.dtype, device=dev)
    u = torch.empty_like(o)
    _solve_kernel[(B * HV * NV,)](
        v, g, beta, o, u, mask, plen if valid is None else valid,
        ks, qs, kk, qk, scale, n, v.stride(0), v.stride(1),
        H=H, HV=HV, V=V, BV=BV, NV=NV, NKS=NKS, NT=NT, HAS_VALID=valid is not None,
        num_warps=solve_warps, **pdl_options)
    return o, u
