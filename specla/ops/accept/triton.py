"""Triton `greedy_walk` (same contract as `naive.py`): one program per row, one launch.

Compiled, the reference's walk was a few kernels a node (an indexed write of the path per node
cannot fuse with the next node's test): ~22 launches for a 17-node tree, ~8 for a 9-node chain
(H200 profiles, `tree_shapes.py --profile`). Here a row's tokens, parents and target choices sit
in one warp's registers and the walk picks each node's values with warp reductions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla.ops.gdn.serial import _pick


@triton.jit
def _walk_kernel(tokens, parents, target, valid, path, length, last, n,
                 NP: tl.constexpr, HAS_VALID: tl.constexpr):
    b = tl.program_id(0)
    idx = tl.arange(0, NP)
    inside = idx < n
    tok = tl.load(tokens + b * n + idx, mask=inside, other=0)
    par = tl.load(parents + b * n + idx, mask=inside, other=0)
    tgt = tl.load(target + b * n + idx, mask=inside, other=0)
    real = n
    if HAS_VALID:
        real = tl.load(valid + b)
    cur = tl.program_id(0) * 0
    count = cur + 1
    out = tl.zeros([NP], dtype=tl.int64)
    for j in range(1, n):
        move = (_pick(par, idx, j) == cur) & (_pick(tok, idx, j) == _pick(tgt, idx, cur)) & (j < real)
        out = tl.where(move & (idx == count), j, out)
        count += move.to(count.dtype)
        cur = tl.where(move, j, cur)
    tl.store(path + b * n + idx, out, mask=inside)
    tl.store(length + b, count)
    tl.store(last + b, cur)


def greedy_walk(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor,
                valid: torch.Tensor | None = None):
    """Same contract as `naive.greedy_walk` (n <= 1024)."""
    B, n = tokens.shape
    dev = tokens.device
    path = torch.empty(B, n, dtype=torch.long, device=dev)
    length = torch.empty(B, dtype=torch.long, device=dev)
    last = torch.empty(B, dtype=torch.long, device=dev)
    _walk_kernel[(B,)](tokens.contiguous(), parents.long().contiguous(), target.contiguous(),
                       tokens if valid is None else valid.long().contiguous(), path, length, last, n,
                       NP=max(16, triton.next_power_of_2(n)), HAS_VALID=valid is not None, num_warps=1)
    return path, length, last
