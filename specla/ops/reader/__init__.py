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


@torch.library.custom_op("specla::committed_read", mutates_args=("states", "lengths"))
def committed_read(states: list[torch.Tensor], ks: list[torch.Tensor], gs: list[torch.Tensor],
                   us: list[torch.Tensor], lengths: list[torch.Tensor], queries: torch.Tensor,
                   value_map: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What a drafter reads at decode time: `state_read` of the committed states, each pending
    update (k, g, u, length) applied and written back (the read is its flush), then the pending
    lengths zeroed. One opaque op, so a compiled drafter (`torch.compile(fullgraph=True)`)
    keeps the Triton launch, whose address table is host state, out of its trace."""
    reads, sqn = state_read(states, list(zip(ks, gs, us, lengths)), queries, value_map, flush=True)
    for n in lengths:
        n.zero_()
    return reads, sqn


@committed_read.register_fake
def _(states, ks, gs, us, lengths, queries, value_map):
    B, NQ, L, HV, _ = queries.shape
    R = states[0].shape[-1] if value_map is None else value_map.shape[-1]
    dt = states[0].dtype
    return queries.new_empty(B, NQ, L, HV, R, dtype=dt), queries.new_empty(B, L, HV, dtype=dt)
