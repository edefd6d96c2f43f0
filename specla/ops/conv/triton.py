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


@triton.jit
def _tree_conv_kernel(x, conv_state, weight, bias, parents, y, n, C, s_xb, s_xn,
                      W: tl.constexpr, NP: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr):
    b = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = ch < C
    j = tl.arange(0, NP)
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
            up = tl.load(parents + b * n + a, mask=in_x, other=0).to(tl.int32)
            a = tl.where(a >= 0, up, a - 1)
    if HAS_BIAS:
        acc += tl.load(bias + ch, mask=mc, other=0.0).to(tl.float32)[None, :]
    out = acc * tl.sigmoid(acc)
    tl.store(y + (b * n + j[:, None]).to(tl.int64) * C + ch[None, :], out.to(y.dtype.element_ty),
             mask=mj[:, None] & mc[None, :])


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
