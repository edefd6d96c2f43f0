"""Triton short causal convolution over ancestor windows (SpecLA §7, DESIGN §1-2).

Same contracts as `naive.py`. One program per (row, channel block) handles every node: the
window of each node is walked up the parent array with one vector gather per tap (past the
root it continues into the conv state: -1 is the newest consumed input), so no ancestor table
is materialised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla.ops import pdl
from specla.ops.pdl import wait_previous


@triton.jit
def _tree_conv_tile(x, conv_state, weight, bias, parents, b, ch, mc, n, C, s_xb, s_xn,
                    W: tl.constexpr, NP: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
                    CHAIN: tl.constexpr = False, j0=0):
    """silu(conv over each node's ancestors) of channels ch for nodes j0 … j0 + NP - 1, [NP, BC]
    fp32 (rows past n are 0). CHAIN: node j's parent is j - 1 (parents is not read); a chain's
    nodes get the same bits either way, and an AR step is the one-node chain. Every element is
    its own sequence of operations (taps newest first), so a node's values do not depend on NP,
    j0 or the layout."""
    j = j0 + tl.arange(0, NP)
    mj = j < n
    acc = tl.zeros([NP, BC], dtype=tl.float32)
    a = j  # the t-th ancestor of each node (t = 0: itself)
    for t in tl.static_range(W):
        w_t = tl.load(weight + ch * W + (W - 1 - t), mask=mc, other=0.0).to(tl.float32)
        in_x = mj & (a >= 0)
        in_s = mj & (a < 0) & (a >= 1 - W)
        xv = tl.load(x + b.to(tl.int64) * s_xb + a[:, None] * s_xn + ch[None, :],
                     mask=in_x[:, None] & mc[None, :], other=0.0).to(tl.float32)
        sv = tl.load(conv_state + (b * C + ch[None, :]).to(tl.int64) * (W - 1) + (W - 1 + a[:, None]),
                     mask=in_s[:, None] & mc[None, :], other=0.0).to(tl.float32)
        acc += (xv + sv) * w_t[None, :]
        if t + 1 < W:
            if CHAIN:
                a = a - 1
            else:
                up = tl.load(parents + b * n + a, mask=in_x, other=0).to(tl.int32)
                a = tl.where(a >= 0, up, a - 1)
    if HAS_BIAS:
        acc += tl.load(bias + ch, mask=mc, other=0.0).to(tl.float32)[None, :]
    return acc * tl.sigmoid(acc)


@triton.jit
def _tree_conv_kernel(x, conv_state, weight, bias, parents, y, n, C, s_xb, s_xn,
                      W: tl.constexpr, NP: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr):
    b = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = ch < C
    j = tl.arange(0, NP)
    out = _tree_conv_tile(x, conv_state, weight, bias, parents, b, ch, mc, n, C, s_xb, s_xn, W, NP, BC, HAS_BIAS)
    tl.store(y + (b * n + j[:, None]).to(tl.int64) * C + ch[None, :], out.to(y.dtype.element_ty),
             mask=(j < n)[:, None] & mc[None, :])


@triton.jit
def _conv_commit_kernel(conv_state, x, path, length, C, P, s_xb, s_xn,
                        W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = ch < C
    m = tl.arange(0, WP)
    mm = m < W - 1
    src = tl.load(length + b) + m  # index into [old state (W-1 entries) ; x[path]]
    old = mm & (src < W - 1)
    new = mm & (src >= W - 1)
    p_state = conv_state + (b * C + ch[None, :]).to(tl.int64) * (W - 1)
    keep = tl.load(p_state + src[:, None], mask=old[:, None] & mc[None, :], other=0.0)
    node = tl.load(path + b * P + (src - (W - 1)), mask=new, other=0)
    xv = tl.load(x + b.to(tl.int64) * s_xb + node[:, None] * s_xn + ch[None, :],
                 mask=new[:, None] & mc[None, :], other=0.0)
    val = tl.where(old[:, None], keep, xv.to(keep.dtype))
    tl.debug_barrier()  # in place: every thread has read its sources before any entry is overwritten
    tl.store(p_state + m[:, None], val, mask=mm[:, None] & mc[None, :])


def _x_strides(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(2) == 1 else x.contiguous()


def tree_conv(x, conv_state, weight, bias, parents):
    """Same contract as `naive.tree_conv`: silu(causal conv over ancestors), [B, n, C] in x.dtype."""
    B, n, C = x.shape
    W = weight.shape[1]
    x = _x_strides(x)
    y = torch.empty(B, n, C, dtype=x.dtype, device=x.device)
    NP = triton.next_power_of_2(n)
    # the [NP, BC] fp32 accumulator stays within 2048 elements (16 registers a thread)
    BC = min(max(16, 2048 // NP), triton.next_power_of_2(C))
    grid = (B, triton.cdiv(C, BC))
    _tree_conv_kernel[grid](x, conv_state.contiguous(), weight.contiguous(),
                            bias if bias is not None else weight, parents.contiguous(), y, n, C,
                            x.stride(0), x.stride(1), W=W, NP=NP, BC=BC,
                            HAS_BIAS=bias is not None)
    return y


def conv_commit(conv_state, x, path, length, *, block_c: int = 128):
    """Same contract as `naive.conv_commit` (contiguous conv state, updated in place)."""
    B, C, W1 = conv_state.shape
    if W1 == 0:
        return
    x = _x_strides(x)
    BC = min(block_c, triton.next_power_of_2(C))
    grid = (B, triton.cdiv(C, BC))
    _conv_commit_kernel[grid](conv_state, x, path.contiguous(), length.contiguous(), C,
                              path.shape[1], x.stride(0), x.stride(1), W=W1 + 1,
                              WP=triton.next_power_of_2(W1), BC=BC)


@triton.jit
def _shift_conv_state(x, conv_state, b, ch, mc, C, s_xb, W: tl.constexpr, WP: tl.constexpr):
    """The conv state of channels ch moved on by one token (x), in place; the caller has read
    the window it convolves before."""
    m = tl.arange(0, WP)
    p_s = conv_state + (b * C + ch[:, None]).to(tl.int64) * (W - 1) + m[None, :]
    xv = tl.load(x + b.to(tl.int64) * s_xb + ch, mask=mc, other=0.0)
    nxt = tl.load(p_s + 1, mask=mc[:, None] & (m + 1 < W - 1)[None, :], other=0.0)
    nxt = tl.where((m + 1 == W - 1)[None, :], xv[:, None].to(nxt.dtype), nxt)
    tl.debug_barrier()  # every thread has read the window before any entry is overwritten
    tl.store(p_s, nxt, mask=mc[:, None] & (m < W - 1)[None, :])


@triton.jit
def _row_sum(x, R: tl.constexpr, N: tl.constexpr):
    """Σ over the last axis of x [R, N] (N a power of two) in one fixed order — adjacent pairs,
    then pairs of those — so that a row's sum has the same bits whatever the tile's row count,
    warps and layout (tl.sum adds in an order that follows the layout: the l2 norms of an AR
    step and of a 9- or 17-node verify then differed in the last bit)."""
    for i in tl.static_range(1, 16):
        if (N >> i) >= 1:
            lo, hi = tl.split(tl.reshape(x, [R, N >> i, 2]))
            x = lo + hi
    return tl.reshape(x, [R])


@triton.jit
def _l2norm_rows(s, R: tl.constexpr, N: tl.constexpr):
    return s / tl.sqrt(_row_sum(s * s, R, N) + 1e-6)[:, None]


@triton.jit
def _step_conv_kernel(x, conv_state, weight, bias, y, C, s_xb, W: tl.constexpr, WP: tl.constexpr,
                      BC: tl.constexpr, HAS_BIAS: tl.constexpr):
    # the token as node 0 of a one-node chain (a two-row tile, the second empty): the verify's
    # conv code, so the output is the bits `tree_conv` gives that position
    b = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = ch < C
    j = tl.arange(0, 2)
    s = _tree_conv_tile(x, conv_state, weight, bias, x, b, ch, mc, 1, C, s_xb, 0, W, 2, BC, HAS_BIAS, True)
    _shift_conv_state(x, conv_state, b, ch, mc, C, s_xb, W, WP)
    tl.store(y + b.to(tl.int64) * C + j[:, None] * 0 + ch[None, :], s.to(y.dtype.element_ty),
             mask=(j == 0)[:, None] & mc[None, :])


def step_conv(x, conv_state, weight, bias, *, block_c: int = 128):
    """Same contract as `naive.step_conv` (contiguous conv state, advanced in place): one launch
    where `tree_conv` and `conv_commit` took two and three small allocations."""
    B, T, C = x.shape
    if T != 1:
        raise ValueError(f"step_conv takes one token per row, got {T}")
    x = _x_strides(x)
    y = torch.empty(B, 1, C, dtype=x.dtype, device=x.device)
    W = weight.shape[1]
    BC = min(block_c, triton.next_power_of_2(C))
    _step_conv_kernel[(B, triton.cdiv(C, BC))](x, conv_state, weight.contiguous(), bias if bias is not None else weight,
                                               y, C, x.stride(0), W=W, WP=triton.next_power_of_2(W), BC=BC,
                                               HAS_BIAS=bias is not None)
    return y


@triton.jit
def _gates(av, bv, A_log, dt_bias, hv, NEG: tl.constexpr):
    """Value head hv's log-decay g = −exp(A_log)·softplus(a + dt_bias) and write strength
    β = sigmoid(b) (×2 with negative eigenvalues), elementwise over av, bv."""
    z = av.to(tl.float32) + tl.load(dt_bias + hv).to(tl.float32)
    # torch's softplus (threshold 20); log1p(t) as log(u)·t/(u−1), u = 1 + t, accurate where t
    # is tiny (libdevice's log1p has no interpreter twin)
    t = tl.exp(tl.minimum(z, 20.0))
    u = 1.0 + t
    sp = tl.where(z > 20.0, z, tl.where(u == 1.0, t, tl.log(u) * (t / tl.where(u == 1.0, 1.0, u - 1.0))))
    bt = tl.sigmoid(bv.to(tl.float32))
    if NEG:
        bt = bt * 2.0
    return -tl.exp(tl.load(A_log + hv).to(tl.float32)) * sp, bt


@triton.jit
def _step_prelude_kernel(x, conv_state, weight, bias, a, bb, A_log, dt_bias, q, k, v, g, beta, C, s_xb, s_ab, s_bb,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
                         WP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_BIAS: tl.constexpr,
                         NEG: tl.constexpr, PDL: tl.constexpr):
    wait_previous(PDL)  # everything here reads the in-projection before it
    # The token is node 0 of a one-node chain through the verify's own conv and norm code
    # (`_tree_prelude_kernel`), in a two-row tile whose second row is empty: an AR step's
    # factors are then the bits a verify computes for that token in any row of any width.
    head, b = tl.program_id(0), tl.program_id(1)
    j = tl.arange(0, 2)
    first = (j == 0)[:, None]
    if head < 2 * H:  # a q or k head: conv, then l2-normalised over its K channels
        o = tl.arange(0, BK)
        mo = o < K
        ch = head * K + o
        s = _tree_conv_tile(x, conv_state, weight, bias, x, b, ch, mo, 1, C, s_xb, 0, W, 2, BK, HAS_BIAS, True)
        _shift_conv_state(x, conv_state, b, ch, mo, C, s_xb, W, WP)
        s = _l2norm_rows(s.to(x.dtype.element_ty).to(tl.float32), 2, BK)
        m = first & mo[None, :]
        if head < H:
            tl.store(q + (b * H + head) * K + j[:, None] * 0 + o[None, :], s, mask=m)
        else:
            tl.store(k + (b * H + head - H) * K + j[:, None] * 0 + o[None, :], s, mask=m)
    else:  # a v head, and its decay and write strength
        hv = head - 2 * H
        o = tl.arange(0, BV)
        mo = o < V
        ch = 2 * H * K + hv * V + o
        s = _tree_conv_tile(x, conv_state, weight, bias, x, b, ch, mo, 1, C, s_xb, 0, W, 2, BV, HAS_BIAS, True)
        _shift_conv_state(x, conv_state, b, ch, mo, C, s_xb, W, WP)
        s = s.to(x.dtype.element_ty).to(tl.float32)
        tl.store(v + (b * HV + hv) * V + j[:, None] * 0 + o[None, :], s, mask=first & mo[None, :])
        gv, bt = _gates(tl.load(a + b * s_ab + hv), tl.load(bb + b * s_bb + hv), A_log, dt_bias, hv, NEG)
        tl.store(g + b * HV + hv, gv)
        tl.store(beta + b * HV + hv, bt)


def step_prelude(x, conv_state, weight, bias, a, b, A_log, dt_bias, num_heads: int, head_dim: int,
                 neg_eigval: bool, state_dtype=torch.float32):
    """Same contract as `naive.step_prelude` (fp32 outputs; the conv state contiguous, updated
    in place): one launch for the seven small kernels Inductor made of it."""
    B, T, C = x.shape
    H, K, HV = num_heads, head_dim, a.shape[-1]
    V = (C - 2 * H * K) // HV
    if T != 1 or state_dtype != torch.float32:
        raise ValueError(f"step_prelude takes one token per row and an fp32 state, got {T} tokens, {state_dtype}")
    x, a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, a, b))
    f32 = dict(dtype=torch.float32, device=x.device)
    q, k = torch.empty(B, 1, H, K, **f32), torch.empty(B, 1, H, K, **f32)
    v, g, beta = torch.empty(B, 1, HV, V, **f32), torch.empty(B, 1, HV, **f32), torch.empty(B, 1, HV, **f32)
    W = weight.shape[1]
    _step_prelude_kernel[(2 * H + HV, B)](
        x, conv_state, weight.contiguous(), bias if bias is not None else weight, a, b, A_log, dt_bias,
        q, k, v, g, beta, C, x.stride(0), a.stride(0), b.stride(0), H=H, HV=HV, K=K, V=V, W=W,
        WP=triton.next_power_of_2(W), BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V),
        HAS_BIAS=bias is not None, NEG=neg_eigval, **pdl.launch_options(x.device))
    return q, k, v, g, beta


# (nodes a program, warps) of `tree_prelude`: a program per (head, pair of nodes), four warps.
# The fixed-order row sums of the l2 norm cost by the values a thread holds: at the paper's
# shape (K = 256) a [2, 256] tile on 4 warps took 4.3-4.7 µs a layer for 9-17 nodes, [4, 256]
# on 4 warps 6.0-6.3, one [n, 256] tile a head (before) 9.6-15.9 (H100,
# `diagnostics/prelude.py`, docs/kernels.md).
TREE_PRELUDE_TILING = (2, 4)


@triton.jit
def _tree_prelude_kernel(x, conv_state, weight, bias, parents, a, bb, A_log, dt_bias, q, k, v, g, beta, n, C,
                         s_xb, s_xn, s_ab, s_an, s_bb, s_bn,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
                         NB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_BIAS: tl.constexpr,
                         NEG: tl.constexpr, PDL: tl.constexpr):
    wait_previous(PDL)  # everything here reads the in-projection before it
    head, b, j0 = tl.program_id(0), tl.program_id(1), tl.program_id(2) * NB
    j = j0 + tl.arange(0, NB)
    mj = j < n
    if head < 2 * H:  # a q or k head of NB nodes: tree conv, rounded as tree_conv's output, l2norm
        o = tl.arange(0, BK)
        mo = o < K
        s = _tree_conv_tile(x, conv_state, weight, bias, parents, b, head * K + o, mo, n, C, s_xb, s_xn,
                            W, NB, BK, HAS_BIAS, False, j0)
        s = _l2norm_rows(s.to(x.dtype.element_ty).to(tl.float32), NB, BK)
        m = mj[:, None] & mo[None, :]
        if head < H:
            tl.store(q + ((b * n + j[:, None]) * H + head).to(tl.int64) * K + o[None, :], s, mask=m)
        else:
            tl.store(k + ((b * n + j[:, None]) * H + head - H).to(tl.int64) * K + o[None, :], s, mask=m)
    else:
        hv = head - 2 * H
        o = tl.arange(0, BV)
        mo = o < V
        s = _tree_conv_tile(x, conv_state, weight, bias, parents, b, 2 * H * K + hv * V + o, mo, n, C, s_xb, s_xn,
                            W, NB, BV, HAS_BIAS, False, j0)
        s = s.to(x.dtype.element_ty).to(tl.float32)
        tl.store(v + ((b * n + j[:, None]) * HV + hv).to(tl.int64) * V + o[None, :], s,
                 mask=mj[:, None] & mo[None, :])
        gv, bt = _gates(tl.load(a + b * s_ab + j * s_an + hv, mask=mj, other=0.0),
                        tl.load(bb + b * s_bb + j * s_bn + hv, mask=mj, other=0.0), A_log, dt_bias, hv, NEG)
        tl.store(g + (b * n + j) * HV + hv, gv, mask=mj)
        tl.store(beta + (b * n + j) * HV + hv, bt, mask=mj)


def tree_prelude(x, conv_state, weight, bias, parents, a, b, A_log, dt_bias, num_heads: int, head_dim: int,
                 neg_eigval: bool, state_dtype=torch.float32, *, tiling: tuple[int, int] | None = None):
    """Same contract as `naive.tree_prelude` (fp32 outputs, an fp32 state): the tree conv and
    the factors in one launch, nothing else written."""
    B, n, C = x.shape
    H, K, HV = num_heads, head_dim, a.shape[-1]
    V = (C - 2 * H * K) // HV
    if state_dtype != torch.float32:
        raise ValueError(f"tree_prelude takes an fp32 state, got {state_dtype}")
    x, a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, a, b))
    f32 = dict(dtype=torch.float32, device=x.device)
    q, k = torch.empty(B, n, H, K, **f32), torch.empty(B, n, H, K, **f32)
    v, g, beta = torch.empty(B, n, HV, V, **f32), torch.empty(B, n, HV, **f32), torch.empty(B, n, HV, **f32)
    W = weight.shape[1]
    NB, warps = tiling or TREE_PRELUDE_TILING
    _tree_prelude_kernel[(2 * H + HV, B, triton.cdiv(n, NB))](
        x, conv_state.contiguous(), weight.contiguous(), bias if bias is not None else weight, parents.contiguous(),
        a, b, A_log, dt_bias, q, k, v, g, beta, n, C, x.stride(0), x.stride(1), a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), H=H, HV=HV, K=K, V=V, W=W, NB=NB,
        BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V), HAS_BIAS=bias is not None, NEG=neg_eigval,
        num_warps=warps, **pdl.launch_options(x.device))
    return q, k, v, g, beta
