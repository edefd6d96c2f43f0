"""Triton `masked_attention` (same contract as `naive.py`): flash-decoding in one or two launches.

A draft step's attention is a handful of query rows over a cache window of 128 to a few thousand
slots. PyTorch's SDPA sends it, with its boolean mask, to cuDNN (bf16: ~6 µs a call at the demo
shape and ~7 µs at the 1.3B one on the H200) or to its memory-efficient kernel (fp32: 26 µs; the
drafter had replaced that by two matmuls and a softmax).
Here each program owns one (row, head, query) and a stretch of SPLIT slots of the window, runs an
online softmax over it in BW-slot blocks (fp32 multiply-adds, no tensor cores: the products are
a vector against a tile), and either writes the normalised output (one stretch) or its partial
(max, sum, weighted values) for `_combine_kernel`, which merges the stretches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Slots a program owns, and its online softmax's block: one block a program, the window spread
# over many programs and merged by `_combine_kernel`. A sweep on the H200
# (draft_attention_4169fd5.json: windows of 128-1024 slots, 4 x 64 and 16 x 128 heads, 1 or 4
# queries, 20 calls a graph) put one-block programs at 3.6-7.4 µs a call against 4.6-20.0 µs for
# the first tiling (256-slot programs looping over 32- or 64-slot blocks, slower than cuDNN at
# the 1.3B shape). Blocks of 8192 elements: 128 slots of 64 dims on 8 warps, 64 slots of 128 on
# 4 (both measured there, within 20% and 12% of the best tiling at every window; neither spills
# on sm_90).
TILE = 8192


def block_slots(BD: int) -> int:
    return max(16, min(128, TILE // BD))


def block_warps(BW: int) -> int:
    return 8 if BW >= 128 else 4


@triton.jit
def _partial_kernel(q, k, v, allowed, o, pm, pl, pacc, W, scale,
                    s_qb, s_qn, s_qh, s_kb, s_kh, s_kw, s_vb, s_vh, s_vw, s_mb, s_mn, s_ob, s_on,
                    n, NS, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, SPLIT: tl.constexpr,
                    BW: tl.constexpr, FINAL: tl.constexpr):
    bh, i, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    d = tl.arange(0, BD)
    md = d < D
    qv = tl.load(q + b.to(tl.int64) * s_qb + i * s_qn + h * s_qh + d, mask=md, other=0.0).to(tl.float32) * scale
    p_k = k + b.to(tl.int64) * s_kb + h.to(tl.int64) * s_kh
    p_v = v + b.to(tl.int64) * s_vb + h.to(tl.int64) * s_vh
    p_m = allowed + b.to(tl.int64) * s_mb + i * s_mn
    m_i = tl.max(tl.full([BW], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BW], tl.float32), 0)
    acc = tl.zeros([BD], tl.float32)
    for w0 in range(sp * SPLIT, tl.minimum(sp * SPLIT + SPLIT, W), BW):
        w = w0 + tl.arange(0, BW)
        live = w < W
        keep = live & (tl.load(p_m + w, mask=live, other=0) != 0)
        kt = tl.load(p_k + w[:, None] * s_kw + d[None, :], mask=keep[:, None] & md[None, :], other=0.0)
        s = tl.where(keep, tl.sum(kt.to(tl.float32) * qv[None, :], 1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing kept yet: no NaN from -inf - -inf
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe)
        vt = tl.load(p_v + w[:, None] * s_vw + d[None, :], mask=keep[:, None] & md[None, :], other=0.0)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * vt.to(tl.float32), 0)
        m_i = m_new
    if FINAL:
        out = tl.where(l_i > 0, acc / l_i, 0.0)
        tl.store(o + b.to(tl.int64) * s_ob + i * s_on + h * D + d, out.to(o.dtype.element_ty), mask=md)
    else:
        r = (bh * n + i) * NS + sp
        tl.store(pm + r, m_i)
        tl.store(pl + r, l_i)
        tl.store(pacc + r.to(tl.int64) * BD + d, acc)


@triton.jit
def _combine_kernel(o, pm, pl, pacc, n, NS, s_ob, s_on,
                    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, NSP: tl.constexpr):
    bh, i = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    sp = tl.arange(0, NSP)
    ms = sp < NS
    d = tl.arange(0, BD)
    r = (bh * n + i) * NS + sp
    m = tl.load(pm + r, mask=ms, other=float("-inf"))
    lw = tl.load(pl + r, mask=ms, other=0.0)
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    f = tl.where(ms, tl.exp(m - top), 0.0)
    a = tl.load(pacc + r[:, None].to(tl.int64) * BD + d[None, :], mask=ms[:, None], other=0.0)
    l_tot = tl.sum(lw * f, 0)
    out = tl.sum(a * f[:, None], 0)
    out = tl.where(l_tot > 0, out / l_tot, 0.0)
    tl.store(o + b.to(tl.int64) * s_ob + i * s_on + h * D + d, out.to(o.dtype.element_ty), mask=d < D)


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float, *, split: int | None = None, block: int | None = None,
                     num_warps: int | None = None) -> torch.Tensor:
    """Same contract as `naive.masked_attention` (bf16, fp16 or fp32; any strides whose last
    dimension is contiguous). split: window slots per program, block: slots per step of its
    online softmax (default both `block_slots`, on `block_warps` warps); powers of two,
    block <= split."""
    B, n, H, D = q.shape
    W = keys.shape[2]
    q, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, keys, values))
    m = mask if mask.stride(-1) == 1 else mask.contiguous()
    m = m.view(torch.uint8)
    o = torch.empty(B, n, H * D, dtype=q.dtype, device=q.device)
    BD = triton.next_power_of_2(D)
    BW = block or block_slots(BD)
    split = max(split or BW, BW)
    NS = triton.cdiv(W, split)
    final = NS == 1
    if final:
        pm = pl = pacc = o  # unused
    else:
        pm = torch.empty(B * H * n * NS, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty(B * H * n * NS, BD, dtype=torch.float32, device=q.device)
    _partial_kernel[(B * H, n, NS)](
        q, keys, values, m, o, pm, pl, pacc, W, scale,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), m.stride(0), m.stride(1), o.stride(0), o.stride(1),
        n, NS, H=H, D=D, BD=BD, SPLIT=split, BW=BW, FINAL=final, num_warps=num_warps or block_warps(BW))
    if not final:
        _combine_kernel[(B * H, n)](o, pm, pl, pacc, n, NS, o.stride(0), o.stride(1),
                                    H=H, D=D, BD=BD, NSP=triton.next_power_of_2(NS), num_warps=4)
    return o
