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
def _gated_rms_norm_kernel(o, z, weight, y, n, s_zb, s_zn, eps, HV: tl.constexpr, V: tl.constexpr,
                           BV: tl.constexpr, HAS_Z: tl.constexpr, SIGMOID: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)  # ((b * n) + t) * HV + hv
    hv, bt = row % HV, row // HV
    c = tl.arange(0, BV)
    m = c < V
    # the gate (the in_proj's, before the verify's prelude) and the weight before the wait
    w = tl.load(weight + c, mask=m, other=0.0).to(tl.float32)
    if HAS_Z:
        zv = tl.load(z + (bt // n).to(tl.int64) * s_zb + (bt % n) * s_zn + hv * V + c, mask=m, other=0.0)
        zv = zv.to(tl.float32)
        gate = tl.sigmoid(zv) if SIGMOID else zv * tl.sigmoid(zv)
    wait_previous(PDL)  # o is the verify's, just before
    ov = tl.load(o + row.to(tl.int64) * V + c, mask=m, other=0.0).to(tl.float32)
    yv = ov * tl.rsqrt(tl.sum(ov * ov) / V + eps) * w
    if HAS_Z:
        yv = yv * gate
    tl.store(y + row.to(tl.int64) * V + c, yv.to(y.dtype.element_ty), mask=m)


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
