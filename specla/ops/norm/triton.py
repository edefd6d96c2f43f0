"""Triton GDN output norm; same contract as `naive.py`. One program per (token, value head):
the head's V outputs, its gate and the norm weight are loaded once, the mean square reduced in
registers, the gated result written in the activation dtype (Inductor split this into a
reduction and a pointwise kernel)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla.ops import pdl
from specla.ops.pdl import wait_previous


@triton.jit
def _gated(ov, w, zv, eps, V: tl.constexpr, HAS_Z: tl.constexpr, SIGMOID: tl.constexpr):
    """rmsnorm(o) · w · act(z) of rows of ov (the last axis a head's V outputs, zero-padded)."""
    yv = ov * tl.expand_dims(tl.rsqrt(tl.sum(ov * ov, -1) / V + eps), -1) * w
    if HAS_Z:
        if SIGMOID:
            yv = yv * tl.sigmoid(zv)
        else:
            yv = yv * (zv * tl.sigmoid(zv))
    return yv


@triton.jit
def _gated_rms_norm_kernel(o, z, weight, y, n, s_zb, s_zn, eps, HV: tl.constexpr, V: tl.constexpr,
                           BV: tl.constexpr, HAS_Z: tl.constexpr, SIGMOID: tl.constexpr, PDL: tl.constexpr):
    wait_previous(PDL)  # o is the verify's, just before
    row = tl.program_id(0)  # ((b * n) + t) * HV + hv
    hv, bt = row % HV, row // HV
    c = tl.arange(0, BV)
    m = c < V
    ov = tl.load(o + row.to(tl.int64) * V + c, mask=m, other=0.0).to(tl.float32)
    zv = ov
    if HAS_Z:
        zv = tl.load(z + (bt // n).to(tl.int64) * s_zb + (bt % n) * s_zn + hv * V + c, mask=m, other=0.0)
    w = tl.load(weight + c, mask=m, other=0.0).to(tl.float32)
    yv = _gated(ov[None, :], w[None, :], zv.to(tl.float32)[None, :], eps, V, HAS_Z, SIGMOID)
    tl.store(y + row.to(tl.int64) * V + c[None, :], yv.to(y.dtype.element_ty), mask=m[None, :])


@triton.jit
def gated_norm_rows(o, z, weight, y, b, hv, n, s_zb, s_zn, eps, HV: tl.constexpr, V: tl.constexpr,
                    VP: tl.constexpr, HAS_Z: tl.constexpr, SIGMOID: tl.constexpr):
    """The norm of value head hv's outputs for tokens 0..n-1 of batch row b, 16 tokens at a time,
    inside another kernel (o and y laid out as `gated_rms_norm`'s): o is read past L1, for other
    programs wrote it. VP: V's next power of two."""
    c = tl.arange(0, VP)
    mc = c < V
    w = tl.load(weight + c, mask=mc, other=0.0).to(tl.float32)
    for r0 in range(0, n, 16):
        t = r0 + tl.arange(0, 16)
        m = (t < n)[:, None] & mc[None, :]
        p = ((b * n + t) * HV + hv).to(tl.int64)[:, None] * V + c[None, :]
        ov = tl.load(o + p, mask=m, other=0.0, cache_modifier=".cg")
        zv = ov
        if HAS_Z:
            zv = tl.load(z + b.to(tl.int64) * s_zb + t[:, None] * s_zn + hv * V + c[None, :], mask=m, other=0.0)
        yv = _gated(ov, w[None, :], zv.to(tl.float32), eps, V, HAS_Z, SIGMOID)
        tl.store(y + p, yv.to(y.dtype.element_ty), mask=m)


def gated_rms_norm(o, z, weight, eps: float, act: str, out_dtype: torch.dtype):
    """Same contract as `naive.gated_rms_norm` (fp32 o)."""
    B, n, HV, V = o.shape
    o = o.contiguous()
    y = torch.empty(B, n, HV * V, dtype=out_dtype, device=o.device)
    if z is not None and z.stride(-1) != 1:
        z = z.contiguous()
    _gated_rms_norm_kernel[(B * n * HV,)](
        o, z if z is not None else o, weight, y, n, z.stride(0) if z is not None else 0,
        z.stride(1) if z is not None else 0, eps, HV=HV, V=V, BV=triton.next_power_of_2(V),
        HAS_Z=z is not None, SIGMOID=act == "sigmoid", **pdl.launch_options(o.device))
    return y
