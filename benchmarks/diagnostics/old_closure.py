"""Triton `ancestor_closure` and `path_tables` (same contracts as `schedule`'s): one launch each.

The parallel verifier's tree mask is rebuilt every round. The reference squares the parent
relation with batched matmuls: on the H200 that was ~10 launches a round (fp32 SIMT GEMMs,
split-K reductions, clamps, the padding). Here one program per batch row squares the same
0/1 matrix in registers: ceil(log2(n - 1)) fp16 tensor-core products with fp32 accumulation,
exact for 0/1 entries and counts up to 64. `path_tables` squares it the same way and then
lists every leaf's root-to-leaf path (the path verifier's schedule, built once a round instead of
by each of its programs in every layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla.ops.gdn.commit import real_nodes


@triton.jit
def _closure(par, rows, live, STEPS: tl.constexpr):
    """[NP, NP] fp16 0/1: row c holds c and its ancestors (live rows only), by squaring."""
    m = (live[:, None] & ((rows[None, :] == rows[:, None]) | (rows[None, :] == par[:, None]))).to(tl.float16)
    for _ in tl.static_range(STEPS):
        m = tl.minimum(tl.dot(m, m, out_dtype=tl.float32), 1.0).to(tl.float16)
    return m


@triton.jit
def _closure_kernel(parents, out, n, W, NP: tl.constexpr, STEPS: tl.constexpr):
    b = tl.program_id(0)
    rows = tl.arange(0, NP)
    live = rows < n
    par = tl.load(parents + b * n + rows, mask=live, other=-1)
    m = _closure(par, rows, live, STEPS)
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


@triton.jit
def _paths_kernel(parents, valid, table, path_len, n_leaves, n, NP: tl.constexpr, TS: tl.constexpr,
                  STEPS: tl.constexpr, HAS_VALID: tl.constexpr):
    b = tl.program_id(0)
    rows = tl.arange(0, NP)
    real = n
    if HAS_VALID:
        real = real_nodes(valid, b, n)
    live = rows < real
    par = tl.load(parents + b * n + rows, mask=live, other=-1).to(tl.int32)
    on = (_closure(par, rows, live, STEPS) > 0) & live[None, :]  # [c, i]: real node i is c or one of its ancestors
    leaf = live & (tl.max((par[:, None] == rows[None, :]).to(tl.int32), 0) == 0)
    pos = tl.cumsum(on.to(tl.int32), 1) - 1
    tl.store(table + (b * n + rows[:, None]) * TS + pos, rows[None, :] + 0 * pos, mask=on & leaf[:, None])
    tl.store(path_len + b * n + rows, tl.where(leaf, tl.sum(on.to(tl.int32), 1), 0), mask=rows < n)
    tl.store(n_leaves + b, tl.sum(leaf.to(tl.int32), 0))


def path_tables(parents: torch.Tensor, valid: torch.Tensor | None = None):
    """Same contract as `schedule.path_tables` (n <= 64)."""
    B, n = parents.shape
    if n > 64:
        raise ValueError(f"the path-table kernel takes n <= 64, got n={n}")
    TS = triton.next_power_of_2(n)
    dev = parents.device
    table = torch.empty(B, n, TS, dtype=torch.int32, device=dev)
    length = torch.empty(B, n, dtype=torch.int32, device=dev)
    leaves = torch.empty(B, dtype=torch.int32, device=dev)
    _paths_kernel[(B,)](parents.contiguous(), parents if valid is None else valid.contiguous(), table, length,
                        leaves, n, NP=max(16, TS), TS=TS, STEPS=max(0, n - 2).bit_length(),
                        HAS_VALID=valid is not None)
    return table, length, leaves
