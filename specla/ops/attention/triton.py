"""Triton `masked_attention` and `draft_attention` (same contracts as `naive.py`): flash-decoding in
one or two launches.

A draft step's attention is a handful of query rows over a cache window of 128 to a few thousand
slots. PyTorch's SDPA sends it, with its boolean mask, to cuDNN (bf16: ~6 µs a call at the demo
shape and ~7 µs at the 1.3B one on the H200) or to its memory-efficient kernel (fp32: 26 µs; the
drafter had replaced that by two matmuls and a softmax).
Here each program owns one (row, head, query) and a stretch of SPLIT slots of the window, runs an
online softmax over it in BW-slot blocks (fp32 multiply-adds, no tensor cores: the products are
a vector against a tile), and either writes the normalised output (one stretch) or its partial
(max, sum, weighted values) for `_combine_kernel`, which merges the stretches.

`draft_attention` is the EAGLE draft step's whole attention in those launches: `_draft_kernel`
rotates its query and key (RoPE), writes the entry's key and value into the cache (split 0's
program only) and builds the tree mask from the entry's ancestor row in registers, where the
compiled rollout had an Inductor kernel for RoPE + cache store and another for the mask. No
program reads a slot the launch writes: an entry's own slot comes from its registers.
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
def _block(qv, p_k, p_v, s_kw, s_vw, w, keep, d, md, m_i, l_i, acc):
    """One BW-slot block of the online softmax; only kept slots are read from memory."""
    kt = tl.load(p_k + w[:, None] * s_kw + d[None, :], mask=keep[:, None] & md[None, :], other=0.0)
    s = tl.where(keep, tl.sum(kt.to(tl.float32) * qv[None, :], 1), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing kept yet: no NaN from -inf - -inf
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe)
    vt = tl.load(p_v + w[:, None] * s_vw + d[None, :], mask=keep[:, None] & md[None, :], other=0.0)
    l_i = l_i * alpha + tl.sum(p, 0)
    acc = acc * alpha + tl.sum(p[:, None] * vt.to(tl.float32), 0)
    return m_new, l_i, acc


@triton.jit
def _emit(o, pm, pl, pacc, m_i, l_i, acc, b, h, i, bh, sp, n, NS, s_ob, s_on, d, md,
          D: tl.constexpr, BD: tl.constexpr, FINAL: tl.constexpr):
    """The normalised output (a window of one stretch) or the stretch's partial for `_combine_kernel`."""
    if FINAL:
        out = tl.where(l_i > 0, acc / l_i, 0.0)
        tl.store(o + b.to(tl.int64) * s_ob + i * s_on + h * D + d, out.to(o.dtype.element_ty), mask=md)
    else:
        r = (bh * n + i) * NS + sp
        tl.store(pm + r, m_i)
        tl.store(pl + r, l_i)
        tl.store(pacc + r.to(tl.int64) * BD + d, acc)


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
        m_i, l_i, acc = _block(qv, p_k, p_v, s_kw, s_vw, w, keep, d, md, m_i, l_i, acc)
    _emit(o, pm, pl, pacc, m_i, l_i, acc, b, h, i, bh, sp, n, NS, s_ob, s_on, d, md, D, BD, FINAL)


@triton.jit
def _rope(p, d, md, rot, partner, c, s):
    """The head vector at p rotated as `apply_rotary` computes it eagerly: each product and the
    sum rounded to its dtype (s carries the sign of the half-split pair). Bit for bit only
    without FMA contraction (`draft_attention` launches with enable_fp_fusion=False): with it,
    a product and the sum became one FMA, and on the H200 a quarter of the rotated keys (bf16
    and fp32) were an ulp off the reference's."""
    x = tl.load(p + d, mask=md, other=0.0)
    xp = tl.load(p + partner, mask=rot, other=0.0)
    a = (x.to(tl.float32) * c).to(x.dtype)
    e = (xp.to(tl.float32) * s).to(x.dtype)
    return tl.where(rot, (a.to(tl.float32) + e.to(tl.float32)).to(x.dtype), x)


@triton.jit
def _draft_kernel(q, k, v, keys, values, length, rows, inv_freq, o, pm, pl, pacc, W, scale, depth, start,
                  s_qb, s_qn, s_qh, s_kb, s_kn, s_kh, s_vb, s_vn, s_vh,
                  s_cb, s_ch, s_cw, s_db, s_dh, s_dw, s_rb, s_rn, s_ob, s_on,
                  n, NS, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, R: tl.constexpr,
                  SPLIT: tl.constexpr, BW: tl.constexpr, FINAL: tl.constexpr, CHAIN: tl.constexpr):
    bh, i, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    d = tl.arange(0, BD)
    md = d < D
    L = tl.load(length + b).to(tl.int32)
    # RoPE at position L + depth: the angle in fp32, its cos and sin rounded to q's dtype
    rot = d < 2 * R
    first = d < R
    f = (L + depth).to(tl.float32) * tl.load(inv_freq + tl.where(first, d, d - R), mask=rot, other=0.0)
    c = tl.cos(f).to(q.dtype.element_ty).to(tl.float32)
    s = tl.sin(f).to(q.dtype.element_ty).to(tl.float32)
    s = tl.where(first, -s, s)
    partner = tl.where(first, d + R, d - R)
    qv = _rope(q + b64 * s_qb + i * s_qn + h * s_qh, d, md, rot, partner, c, s).to(tl.float32) * scale
    kr = _rope(k + b64 * s_kb + i * s_kn + h * s_kh, d, md, rot, partner, c, s)
    vr = tl.load(v + b64 * s_vb + i * s_vn + h * s_vh + d, mask=md, other=0.0)
    p_k = keys + b64 * s_cb + h64 * s_ch
    p_v = values + b64 * s_db + h64 * s_dh
    # this entry's slot: written by split 0's program, which also starts its softmax with it
    me = L + start + i
    own = sp == 0
    tl.store(p_k + me * s_cw + d, kr, mask=md & own & (me < W))
    tl.store(p_v + me * s_dw + d, vr, mask=md & own & (me < W))
    m_i = tl.where(own, tl.sum(kr.to(tl.float32) * qv, 0), float("-inf"))
    l_i = tl.where(own, 1.0, 0.0)
    acc = tl.where(own, vr.to(tl.float32), 0.0)
    # from L + start on, the slots are this step's entries (being written): never read. lo + SPLIT
    # outermost: ptxas then sees the loop's trip count bound (SPLIT / BW), and needs 120-150
    # registers at the demo shape instead of 206-240 (aot_check)
    lo = sp * SPLIT
    hi = tl.minimum(lo + SPLIT, tl.minimum(W, L + start))
    p_r = rows + b64 * s_rb + i * s_rn
    for w0 in range(lo, hi, BW):
        w = w0 + tl.arange(0, BW)
        keep = w < hi
        if not CHAIN:  # an earlier entry only on the query's path (a chain's are all on it)
            e = w - L
            keep = keep & ((e < 0) | (tl.load(p_r + e, mask=keep & (e >= 0), other=0) != 0))
        m_i, l_i, acc = _block(qv, p_k, p_v, s_cw, s_dw, w, keep, d, md, m_i, l_i, acc)
    _emit(o, pm, pl, pacc, m_i, l_i, acc, b, h, i, bh, sp, n, NS, s_ob, s_on, d, md, D, BD, FINAL)


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


def _plan(q: torch.Tensor, W: int, split: int | None, block: int | None):
    """The output, the tiling (BD, BW, split, stretches NS) and, for a window of several
    stretches, the partials `_combine_kernel` merges (else the output stands in for them)."""
    B, n, H, D = q.shape
    o = torch.empty(B, n, H * D, dtype=q.dtype, device=q.device)
    BD = triton.next_power_of_2(D)
    BW = block or block_slots(BD)
    split = max(split or BW, BW)
    NS = triton.cdiv(W, split)
    if NS == 1:
        return o, (BD, BW, split, NS), (o, o, o)
    pm = torch.empty(B * H * n * NS, dtype=torch.float32, device=q.device)
    pacc = torch.empty(B * H * n * NS, BD, dtype=torch.float32, device=q.device)
    return o, (BD, BW, split, NS), (pm, torch.empty_like(pm), pacc)


def _combine(o, partials, H, D, BD, NS):
    if NS > 1:
        B, n = o.shape[:2]
        _combine_kernel[(B * H, n)](o, *partials, n, NS, o.stride(0), o.stride(1),
                                    H=H, D=D, BD=BD, NSP=triton.next_power_of_2(NS), num_warps=4)
    return o


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
    o, (BD, BW, split, NS), partials = _plan(q, W, split, block)
    _partial_kernel[(B * H, n, NS)](
        q, keys, values, m, o, *partials, W, scale,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), m.stride(0), m.stride(1), o.stride(0), o.stride(1),
        n, NS, H=H, D=D, BD=BD, SPLIT=split, BW=BW, FINAL=NS == 1, num_warps=num_warps or block_warps(BW))
    return _combine(o, partials, H, D, BD, NS)


def draft_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    length: torch.Tensor, depth: int, start: int, rows: torch.Tensor | None,
                    inv_freq: torch.Tensor, scale: float, *, split: int | None = None, block: int | None = None,
                    num_warps: int | None = None) -> torch.Tensor:
    """Same contract as `naive.draft_attention` (bf16, fp16 or fp32, inv_freq fp32; q, k, v
    with a contiguous last dimension or copied to one). keys and values are written in place:
    q's dtype, contiguous last dimension. split, block, num_warps: as `masked_attention`'s."""
    B, n, H, D = q.shape
    W = keys.shape[2]
    if keys.dtype != q.dtype or values.dtype != q.dtype or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("draft_attention writes the cache in place: keys and values need q's dtype "
                         "and a contiguous last dimension")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    length = length.contiguous()
    o, (BD, BW, split, NS), partials = _plan(q, W, split, block)
    r = o if rows is None else (rows if rows.stride(-1) == 1 else rows.contiguous()).view(torch.uint8)
    _draft_kernel[(B * H, n, NS)](
        q, k, v, keys, values, length, r, inv_freq, o, *partials, W, scale, depth, start,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), r.stride(0), r.stride(1), o.stride(0), o.stride(1),
        n, NS, H=H, D=D, BD=BD, R=inv_freq.shape[0], SPLIT=split, BW=BW, FINAL=NS == 1, CHAIN=rows is None,
        num_warps=num_warps or block_warps(BW), enable_fp_fusion=False)  # RoPE's roundings (`_rope`)
    return _combine(o, partials, H, D, BD, NS)
