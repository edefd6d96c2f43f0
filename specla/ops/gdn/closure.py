"""Triton `ancestor_closure` (same contract as `schedule.ancestor_closure`): one launch.

The parallel verifier's tree mask is rebuilt every round. The reference squares the parent
relation with batched matmuls: on the H200 that was ~10 launches a round (fp32 SIMT GEMMs,
split-K reductions, clamps, the padding). Here one program per batch row squares the same
0/1 matrix in registers: ceil(log2(n - 1)) fp16 tensor-core products with fp32 accumulation,
exact for 0/1 entries and counts up to 64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _closure_kernel(parents, out, n, W, NP: tl.constexpr, STEPS: tl.constexpr):
    b = tl.program_id(0)
    rows = tl.arange(0, NP)
    live = rows < n
    par = tl.load(parents + b * n + rows, mask=live, other=-1)
    r = live[:, None] & ((rows[None, :] == rows[:, None]) | (rows[None, :] == par[:, None]))
    m = r.to(tl.float16)
    for _ in tl.static_range(STEPS):
        m = tl.minimum(tl.dot(m, m, out_dtype=tl.float32), 1.0).to(tl.float16)
    offs = b * W * W + rows[:, None] * W + rows[None, :]
    tl.store(out + offs, m.to(tl.float32), mask=(rows[:, None] < W) & (rows[None, :] < W))


def ancestor_closure(parents: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Same contract as `schedule.ancestor_closure` (n <= width <= 64)."""
    B, n = parents.shape
    W = width or n
    if not n <= W <= 64:
        raise ValueError(f"the closure kernel takes n <= width <= 64, got n={n}, width={W}")
    out = torch.empty(B, W, W, dtype=torch.float32, device=parents.device)
    _closure_kernel[(B,)](parents.contiguous(), out, n, W, NP=max(16, triton.next_power_of_2(W)),
                          STEPS=max(0, n - 2).bit_length())
    return out
