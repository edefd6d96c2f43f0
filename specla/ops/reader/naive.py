"""Torch reference for the ReaDy state reader (the specification of `triton.state_read`).

    state_read(states, pendings, queries, value_map=None, flush=True) -> (reads, sqnorm)

- `states`: L tensors [B, HV, K, V] (fp32, or fp64 for float64 models): the durable GDN state
  `S` of each source layer, layout of DESIGN §1 (o = Sᵀq).
- `pendings`: L entries, each None or a delayed accepted update `(k [B, P, H, K], g [B, P, HV],
  u [B, P, HV, V], length [B])` as `GDNLayerState.pending` holds it (path = 0..P-1, the first
  length[b] rows live). The *committed* state is S advanced by it (the same factor update as
  `ops.gdn_commit`).
- `queries` [B, NQ, L, HV, K]: one key-space query per draft position, source layer and value
  head (the reader's queries are learned, so GVA groups need not share them).
- `value_map` [L, V, R] or None: the rank-R value compression, one per source layer, shared
  by its heads. With it the reads are (Sᵀq)ᵀ W = qᵀ S W, [B, NQ, L, HV, R]; without it the raw
  reads Sᵀq, [B, NQ, L, HV, V] (full rank, or compress afterwards: `reads @ value_map[l]`).
- `sqnorm` [B, L, HV]: ‖S‖²_F of each committed head state (the reader's state-scale feature).
- `flush`: write the committed state back to `states[l]` in place (the read is then also the
  flush); the caller zeroes the pending lengths afterwards. With flush=False nothing is written.

Differentiable in `queries` and `value_map` (training reads states without pending updates).
Runs outside autocast, in the state's precision.
"""

from __future__ import annotations

import torch

from specla.ops.gdn import naive as gdn_ref


def committed(state: torch.Tensor, pending) -> torch.Tensor:
    """The committed state: `state` advanced by its pending update (a new tensor if one is live)."""
    if pending is None or pending[0].shape[1] == 0:
        return state
    pk, pg, pu, plen = pending
    S = state.detach().clone()
    path = torch.arange(pk.shape[1], device=pk.device).expand(pk.shape[0], -1)
    gdn_ref.gdn_commit(S, pk, pg, pu, path, plen)
    return S


def state_read(states, pendings, queries, value_map=None, flush: bool = True):
    L = len(states)
    if queries.shape[2] != L or len(pendings) != L:
        raise ValueError(f"{L} states, {len(pendings)} pendings, queries for {queries.shape[2]} layers")
    if value_map is not None and value_map.shape[0] != L:
        raise ValueError(f"value map for {value_map.shape[0]} layers, {L} states")
    dev = states[0].device
    with torch.autocast(dev.type, enabled=False):
        reads, norms = [], []
        for i, (S0, pend) in enumerate(zip(states, pendings)):
            S = committed(S0, pend)
            if flush and S is not S0:
                S0.copy_(S)
            q = queries[:, :, i].to(S.dtype)  # [B, NQ, HV, K]
            r = torch.einsum("bphk,bhkv->bphv", q, S)
            if value_map is not None:
                r = r @ value_map[i].to(S.dtype)
            reads.append(r)
            norms.append(S.square().sum((-2, -1)))
        return torch.stack(reads, 2), torch.stack(norms, 1)
