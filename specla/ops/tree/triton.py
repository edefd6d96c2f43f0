"""Triton `build_batch` (same contract as `naive.py`): one program per row, one launch.

Inductor made the reference's ranks, gathers and padding into ~13 kernels once a tree round
(H200 profile, `tree_shapes.py --profile`: ~20 µs of a 0.92 ms round). Here each order is one
register sort of packed int64 keys (bitonic, `tl.sort`): the selection's (outside the window,
-q, depth, pool index) and then, for the kept nodes, the packing's (depth, -q, pool index). The
pool index in the low bits makes every key distinct, so the orders are the reference's. A node's
slot goes through a small scratch row, where the parents read theirs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl



@triton.jit
def _build_kernel(root, tokens, parents, scores, depth, out_tok, out_par, valid, slots, P, M, s_depth, tau,
                  NP: tl.constexpr, HAS_TAU: tl.constexpr):
    b = tl.program_id(0)
    i = tl.arange(0, NP)
    inp = i < P
    q = tl.load(scores + b * P + i, mask=inp, other=float("-inf")).to(tl.float32)
    d = tl.load(depth + b * s_depth + i, mask=inp, other=0).to(tl.int64)
    inside = inp
    if HAS_TAU:
        inside = inp & (q >= tl.max(q, 0) - tau)
    count = tl.minimum(tl.sum(inside.to(tl.int32), 0), M)
    # -q as an order-preserving unsigned 32-bit integer (-0.0 made +0.0 first: they tie as floats)
    nq = tl.where(q == 0.0, 0.0, -q)
    bits = nq.to(tl.int32, bitcast=True)
    uq = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2 ** 31) & 0xFFFFFFFF
    BIG: tl.constexpr = 2 ** 62
    key = ((~inside).to(tl.int64) << 56) | (uq << 16) | (d << 8) | i.to(tl.int64)
    key = tl.sort(tl.where(inp, key, BIG), 0)  # the selection order; the first `count` are kept
    live = i < count
    key = tl.sort(tl.where(live, (((key >> 8) & 0xFF) << 48) | (((key >> 16) & 0xFFFFFFFF) << 8) | (key & 0xFF), BIG), 0)
    node = (key & 0xFF).to(tl.int32)  # the node at slot 1 + i, for i < count
    tok = tl.load(tokens + b * P + node, mask=live, other=0)
    par = tl.load(parents + b * P + node, mask=live, other=-1)
    tl.store(slots + b * NP + node, i + 1, mask=live)
    tl.debug_barrier()  # every slot is written before the parents read theirs
    pslot = tl.load(slots + b * NP + par, mask=live & (par >= 0), other=0)
    base = b * (M + 1)
    tl.store(out_tok + base + 1 + i, tok, mask=live)
    tl.store(out_par + base + 1 + i, pslot, mask=live)
    # slot 0: the root; slots past count: a chain under the last kept node, repeating its token
    r = tl.load(root + b)
    last = tl.sum(tl.where(live & (i == count - 1), tok, 0), 0)
    last = tl.where(count == 0, r, last)
    pad = (i > count) & (i <= M)
    tl.store(out_tok + base + i, tl.where(i == 0, r, last), mask=pad | (i == 0))
    tl.store(out_par + base + i, i - 1, mask=pad | (i == 0))
    tl.store(valid + b, count + 1)


def build_batch(root: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor,
                budget: int, tau: float | None, depth: torch.Tensor):
    """Same contract as `naive.build_batch` (pools of at most 256 nodes, depths below 256)."""
    B, P = scores.shape
    M = min(budget, P)
    dev = scores.device
    out_tok = torch.empty(B, M + 1, dtype=torch.long, device=dev)
    out_par = torch.empty(B, M + 1, dtype=torch.long, device=dev)
    valid = torch.empty(B, dtype=torch.long, device=dev)
    NP = max(16, triton.next_power_of_2(max(P, M + 1)))
    slots = torch.empty(B, NP, dtype=torch.int32, device=dev)
    depth = depth if depth.shape[0] == 1 else depth.contiguous()
    _build_kernel[(B,)](root.contiguous(), tokens.contiguous(), parents.contiguous(), scores.float().contiguous(),
                        depth, out_tok, out_par, valid, slots, P, M, 0 if depth.shape[0] == 1 else depth.stride(0),
                        0.0 if tau is None else float(tau), NP=NP, HAS_TAU=tau is not None, num_warps=4)
    return out_tok, out_par, valid
