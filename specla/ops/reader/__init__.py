"""ReaDy state reader ops (docs/ready.md): read the target's committed GDN states.

`state_read(states, pendings, queries, value_map=None, flush=True) -> (reads, sqnorm)`; the
contract is in `naive.py`. Dispatch follows `specla.ops`: the fused Triton kernel
(`triton.py`) when `ops.use_triton(state)` and the states are fp32 and nothing needs
gradients, the torch reference otherwise (float64 models, CPU, training).
"""

from __future__ import annotations

import torch

from specla.ops.reader import naive


def state_read(states, pendings, queries, value_map=None, flush: bool = True):
    from specla import ops

    S0 = states[0]
    grad = torch.is_grad_enabled() and (queries.requires_grad or (value_map is not None and value_map.requires_grad))
    if ops.use_triton(S0) and S0.dtype == torch.float32 and not grad:
        from specla.ops.reader import triton as reader_triton

        return reader_triton.state_read(states, pendings, queries, value_map, flush)
    return naive.state_read(states, pendings, queries, value_map, flush)


def gather_then_read(states, pendings, queries, value_map=None):
    """The unfused baseline (benchmarks): flush each source layer with `ops.gdn_commit`,
    gather the states into one tensor, then read with dense torch ops."""
    from specla import ops

    for S, pend in zip(states, pendings):
        if pend is not None and pend[0].shape[1]:
            pk, pg, pu, plen = pend
            path = torch.arange(pk.shape[1], device=pk.device).expand(pk.shape[0], -1)
            ops.gdn_commit(S, pk, pg, pu, path, plen)
            plen.zero_()
    St = torch.stack(list(states), 1)  # [B, L, HV, K, V]
    r = torch.einsum("bplhk,blhkv->bplhv", queries.to(St.dtype), St)
    if value_map is not None:
        r = torch.einsum("bplhv,lvr->bplhr", r, value_map.to(St.dtype))
    return r, St.square().sum((-2, -1))
