"""Triton matmuls of a batch-1 decode step, y = x Wᵀ with W [N, K] row-major: the GEMV of
one row (an AR or draft step) and the skinny GEMM of a few rows (a verify's 2-32 nodes).

cuBLAS reads the 1.3B shape's o_proj and down weights at 31% and 47% of the H200's copy
bandwidth in a decode step (`specla bench gemv`). Here one program owns BN output rows and
streams them over K in BK-wide tiles (each row's tile one contiguous read), multiply-adding into
a [BN, BK] fp32 accumulator that is reduced once at the end: no split-K pass, and enough
programs (N / BN) to cover every SM for the narrow matrices. `TILINGS` holds the (BN, BK, warps)
`specla bench gemv` sweeps; same signature as `naive.gemv`.

`skinny` does the same for up to 32 rows on the tensor cores: one program per BN output rows,
the BM (16 or 32) input rows padded with zeros, W's tile read once per K step and multiplied
against all rows by `tl.dot` (bf16 products are exact in fp32; fp32 inputs use IEEE dots).
`SKINNY_TILINGS` holds its (BM, BN, BK, warps); same signature as `naive.skinny`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILINGS = ((4, 512, 4), (4, 1024, 4), (8, 256, 4), (8, 512, 4), (8, 1024, 8), (8, 2048, 8), (16, 256, 4),
           (16, 512, 8), (32, 256, 8))
SKINNY_MAX_ROWS = 32
SKINNY_TILINGS = ((16, 16, 256, 4), (16, 32, 128, 4), (16, 32, 256, 4), (16, 64, 128, 4), (32, 32, 128, 4),
                  (32, 64, 128, 8))


@triton.jit  # n_in specialises on divisibility by 16: without it no weight load is vectorised
def _gemv_kernel(x, weight, y, n_out, n_in, BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.arange(0, BK)
    mr = rows < n_out
    p_w = weight + rows[:, None].to(tl.int64) * n_in + cols[None, :]
    p_x = x + rows[:, None] * 0 + cols[None, :]
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, n_in, BK):
        m = mr[:, None] & (k0 + cols < n_in)[None, :]
        # x is loaded once per tile row, in the tile's own layout (from L1 after the first): a
        # smaller load would be moved into that layout through shared memory, two barriers a tile
        xv = tl.load(p_x + k0, mask=m, other=0.0).to(tl.float32)
        # each weight is read once per step: keep it from displacing what the next kernels reuse
        wv = tl.load(p_w + k0, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
        acc += wv * xv
    tl.store(y + rows, tl.sum(acc, 1).to(y.dtype.element_ty), mask=mr)


def gemv(x: torch.Tensor, weight: torch.Tensor, *, block_n: int = 8, block_k: int = 512,
         num_warps: int = 4) -> torch.Tensor:
    """Same contract as `naive.gemv` (fp32 accumulation; fp64 inputs are not taken)."""
    N, K = weight.shape
    if x.numel() != K or x.shape[-1] != K:
        raise ValueError(f"gemv takes one row of {K} values, got x of shape {tuple(x.shape)}")
    weight = weight.contiguous()
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](x.contiguous(), weight, y, N, K, BN=block_n,
                                              BK=min(block_k, triton.next_power_of_2(K)), num_warps=num_warps)
    return y


@triton.jit
def _skinny_kernel(x, weight, y, n_rows, n_out, n_in, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   PREC: tl.constexpr):
    outs = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BK)
    mo, mr = outs < n_out, rows < n_rows
    p_w = weight + outs[:, None].to(tl.int64) * n_in + cols[None, :]
    p_x = x + rows[:, None] * n_in + cols[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, n_in, BK):
        mk = (k0 + cols < n_in)[None, :]
        xt = tl.load(p_x + k0, mask=mr[:, None] & mk, other=0.0)
        wt = tl.load(p_w + k0, mask=mo[:, None] & mk, other=0.0, eviction_policy="evict_first")
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PREC)
    p_y = y + rows[:, None] * n_out + outs[None, :]
    tl.store(p_y, acc.to(y.dtype.element_ty), mask=mr[:, None] & mo[None, :])


def skinny(x: torch.Tensor, weight: torch.Tensor, *, block_m: int | None = None, block_n: int = 32,
           block_k: int = 128, num_warps: int = 4) -> torch.Tensor:
    """Same contract as `naive.skinny` for up to SKINNY_MAX_ROWS rows (fp64 is not taken)."""
    N, K = weight.shape
    M = x.numel() // K if x.shape[-1] == K else -1
    if not 1 <= M <= SKINNY_MAX_ROWS or K < 16:
        raise ValueError(f"skinny takes 1-{SKINNY_MAX_ROWS} rows of K >= 16 values, got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    BM = block_m or (16 if M <= 16 else 32)
    if BM < M:
        raise ValueError(f"block_m={BM} holds fewer than the {M} rows")
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # bf16 products are exact either way
    _skinny_kernel[(triton.cdiv(N, block_n),)](x.contiguous(), weight.contiguous(), y, M, N, K, BM=BM, BN=block_n,
                                               BK=min(block_k, max(16, triton.next_power_of_2(K))), PREC=prec,
                                               num_warps=num_warps)
    return y


@triton.jit
def _rows_kernel(x, weight, y, n_rows, n_out, n_in, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    outs = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BK)
    mo, mr = outs < n_out, rows < n_rows
    p_w = weight + outs[:, None].to(tl.int64) * n_in + cols[None, :]
    p_x = x + rows[:, None] * n_in + cols[None, :]
    acc = tl.zeros([BM, BN, BK], dtype=tl.float32)
    for k0 in range(0, n_in, BK):
        mk = (k0 + cols < n_in)[None, :]
        xt = tl.load(p_x + k0, mask=mr[:, None] & mk, other=0.0).to(tl.float32)
        wt = tl.load(p_w + k0, mask=mo[:, None] & mk, other=0.0, eviction_policy="evict_first").to(tl.float32)
        acc += xt[:, None, :] * wt[None, :, :]
    p_y = y + rows[:, None] * n_out + outs[None, :]
    tl.store(p_y, tl.sum(acc, 2).to(y.dtype.element_ty), mask=mr[:, None] & mo[None, :])


def rows(x: torch.Tensor, weight: torch.Tensor, *, num_warps: int = 4) -> torch.Tensor:
    """`naive.skinny` for up to SKINNY_MAX_ROWS fp32 rows by multiply-adds, no `tl.dot`: each
    program keeps a [BM, BN, BK] accumulator (rows × outputs × a K tile, as the GEMV keeps
    [BN, BK]) and reduces it over K once. IEEE `tl.dot` took ~16 µs for the demo target's 9-
    and 17-row products on the H200 (`_skinny_kernel`, rounds_fp32_2bad5ed.json), cuBLAS
    26-32 µs for some of them."""
    N, K = weight.shape
    M = x.numel() // K if x.shape[-1] == K else -1
    if not 1 <= M <= SKINNY_MAX_ROWS:
        raise ValueError(f"rows takes 1-{SKINNY_MAX_ROWS} rows of K values, got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    BM = max(2, triton.next_power_of_2(M))
    BN = min(16, max(2, triton.next_power_of_2(N // 64)))  # ~64+ programs: spread over the SMs
    BK = min(128, max(16, 4096 // (BM * BN)))  # 32 accumulators a thread at 4 warps
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    _rows_kernel[(triton.cdiv(N, BN),)](x.contiguous(), weight.contiguous(), y, M, N, K, BM=BM, BN=BN, BK=BK,
                                        num_warps=num_warps)
    return y


FUSED_MAX_ROWS = 16
FUSED_ONE_TILE = 1024  # the fused kernels read a row as one tile: rows up to this long
# Outputs a program: about one per FUSED_SPREAD outputs (~3 programs an SM of the H200's 132), at
# most 8, on one warp per 2048 products. `diagnostics/fused_linear.py` on the H200
# (fused_linear_adcfc79.json: the demo drafter's five matmuls at 1 and 4 rows, 1-32 outputs a
# program, 1-4 warps) put this rule's tiling at the best one in 6 of 9 cases and within 0.26 µs
# in all: 2.0-2.8 µs a call against 4.1-6.0 µs for the modules' kernels (norm, cuBLAS, gate,
# add); 4 warps and up to 16 outputs, its first tiling, took 2.2-4.0 µs. The tenth case, the
# LM head at 4 rows, stays on the modules (`ops.fuses_linear`).
FUSED_SPREAD = 384


@triton.jit
def _rms_normed(xf, g, n_in, eps, dtype: tl.constexpr):
    """Rows xf [BM, BK] (fp32, zero past n_in) RMS-normalised, scaled by g [BK] and rounded to
    dtype, as the norm module's output is, then back in fp32 for the products."""
    rstd = tl.rsqrt(tl.sum(xf * xf, 1) / n_in + eps)
    return (xf * rstd[:, None] * g[None, :]).to(dtype).to(tl.float32)


@triton.jit
def _fused_kernel(x, norm_w, weight, res, y, n_rows, n_out, n_in, eps, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr, RES: tl.constexpr):
    outs = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BK)
    mo, mr, mk = outs < n_out, rows < n_rows, cols < n_in
    # the whole row is one tile: weights, rows and norm weight all requested at once (a norm pass
    # before a K loop made the first version 4.8 µs a call against cuBLAS's 2.8 on the H200)
    p_w = weight + outs[:, None].to(tl.int64) * n_in + cols[None, :]
    wm = mo[:, None] & mk[None, :]
    wt = tl.load(p_w, mask=wm, other=0.0, eviction_policy="evict_first").to(tl.float32)
    if GLU:  # up's row n is weight row n_out + n
        wu = tl.load(p_w + n_out * n_in, mask=wm, other=0.0, eviction_policy="evict_first").to(tl.float32)
    xf = tl.load(x + rows[:, None] * n_in + cols[None, :], mask=mr[:, None] & mk[None, :], other=0.0).to(tl.float32)
    if NORM:  # every program normalises the few rows itself: they come from L2
        xf = _rms_normed(xf, tl.load(norm_w + cols, mask=mk, other=0.0).to(tl.float32), n_in, eps,
                         x.dtype.element_ty)
    out = tl.sum(xf[:, None, :] * wt[None], 2)
    if GLU:
        gate = out.to(y.dtype.element_ty).to(tl.float32)
        up = tl.sum(xf[:, None, :] * wu[None], 2).to(y.dtype.element_ty).to(tl.float32)
        out = (gate * tl.sigmoid(gate)).to(y.dtype.element_ty).to(tl.float32) * up
    m = mr[:, None] & mo[None, :]
    if RES:
        r = tl.load(res + rows[:, None] * n_out + outs[None, :], mask=m, other=0.0).to(tl.float32)
        out = out.to(y.dtype.element_ty).to(tl.float32) + r
    tl.store(y + rows[:, None] * n_out + outs[None, :], out.to(y.dtype.element_ty), mask=m)


def fused_tiling(M: int, N: int, K: int, glu: bool = False,
                 block_n: int | None = None) -> tuple[int, int, int, int]:
    """(BM, BN, BK, warps) of `_fused_kernel` for M rows, N outputs, rows of K (the whole row:
    one tile); block_n outputs a program if given."""
    BM = triton.next_power_of_2(M)
    BK = triton.next_power_of_2(K)
    BN = block_n or min(8, max(1, triton.next_power_of_2(N // FUSED_SPREAD + 1) // 2))
    return BM, BN, BK, min(4, max(1, BM * BN * BK // 2048))


def fused(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
          residual: torch.Tensor | None = None, glu: bool = False, *, block_n: int | None = None,
          num_warps: int | None = None) -> torch.Tensor:
    """Same contract as `naive.fused` for up to FUSED_MAX_ROWS rows, one launch: a draft step's
    matmuls with the RMS norm before them, SwiGLU's gate after, or the residual add (a launch
    each in the drafter's compiled step). Multiply-adds as `rows` (no fp64)."""
    N, K = weight.shape
    if glu:
        if N % 2:
            raise ValueError(f"a GLU weight stacks gate and up: an even row count, got {N}")
        N //= 2
    M = x.numel() // K if x.shape[-1] == K else -1
    if not 1 <= M <= FUSED_MAX_ROWS or K > FUSED_ONE_TILE:
        raise ValueError(f"fused takes 1-{FUSED_MAX_ROWS} rows of at most {FUSED_ONE_TILE} values, got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}")
    if residual is not None and residual.shape != (*x.shape[:-1], N):
        raise ValueError(f"the residual must be {(*x.shape[:-1], N)}, got {tuple(residual.shape)}")
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    BM, BN, BK, warps = fused_tiling(M, N, K, glu, block_n)
    x = x.contiguous()
    _fused_kernel[(triton.cdiv(N, BN),)](
        x, x if norm_weight is None else norm_weight.contiguous(), weight.contiguous(),
        y if residual is None else residual.contiguous(), y, M, N, K, eps, BM=BM, BN=BN, BK=BK,
        NORM=norm_weight is not None, GLU=glu, RES=residual is not None, num_warps=num_warps or warps)
    return y


@triton.jit
def _draft_inputs_kernel(emb_table, tokens, h, src, norm_emb, norm_feat, weight, y, n_rows, n, nb, n_out, D, eps,
                         BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    outs = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.arange(0, BM)
    d = tl.arange(0, BD)
    mo, mr, md = outs < n_out, rows < n_rows, d < D
    p_w = weight + outs[:, None].to(tl.int64) * (2 * D) + d[None, :]
    wm = mo[:, None] & md[None, :]
    w_emb = tl.load(p_w, mask=wm, other=0.0, eviction_policy="evict_first").to(tl.float32)
    w_feat = tl.load(p_w + D, mask=wm, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tok = tl.load(tokens + rows, mask=mr, other=0)
    hrow = (rows // n) * nb + tl.load(src + rows, mask=mr, other=0)  # entry (b, i) reads h[b, src[b, i]]
    m = mr[:, None] & md[None, :]
    e = tl.load(emb_table + tok[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    f = tl.load(h + hrow[:, None].to(tl.int64) * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    e = _rms_normed(e, tl.load(norm_emb + d, mask=md, other=0.0).to(tl.float32), D, eps, y.dtype.element_ty)
    f = _rms_normed(f, tl.load(norm_feat + d, mask=md, other=0.0).to(tl.float32), D, eps, y.dtype.element_ty)
    out = tl.sum(e[:, None, :] * w_emb[None] + f[:, None, :] * w_feat[None], 2)
    tl.store(y + rows[:, None] * n_out + outs[None, :], out.to(y.dtype.element_ty), mask=mr[:, None] & mo[None, :])


def draft_inputs(table: torch.Tensor, tokens: torch.Tensor, h: torch.Tensor, src: torch.Tensor,
                 norm_emb: torch.Tensor, norm_feat: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """Same contract as `naive.draft_inputs` for up to FUSED_MAX_ROWS entries and D up to
    FUSED_ONE_TILE / 2, one launch: the embedding lookup, the parents' h, both norms and fc (on
    the demo drafter's step they were two Inductor kernels and cuBLAS's)."""
    B, n = tokens.shape
    nb, D = h.shape[1], h.shape[2]
    N = weight.shape[0]
    M = B * n
    if not 1 <= M <= FUSED_MAX_ROWS or 2 * D > FUSED_ONE_TILE or weight.shape[1] != 2 * D:
        raise ValueError(f"draft_inputs takes 1-{FUSED_MAX_ROWS} entries of D <= {FUSED_ONE_TILE // 2} and "
                         f"a [N, 2D] weight, got tokens {tuple(tokens.shape)}, h {tuple(h.shape)}, "
                         f"weight {tuple(weight.shape)}")
    y = torch.empty(B, n, N, dtype=h.dtype, device=h.device)
    BM, BN, BK, warps = fused_tiling(M, N, 2 * D)
    _draft_inputs_kernel[(triton.cdiv(N, BN),)](
        table.contiguous(), tokens.contiguous(), h.contiguous(), src.contiguous(), norm_emb.contiguous(),
        norm_feat.contiguous(), weight.contiguous(), y, M, n, nb, N, D, eps, BM=BM, BN=BN, BD=BK // 2,
        num_warps=warps)
    return y
