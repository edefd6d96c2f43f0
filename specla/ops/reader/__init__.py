"""ReaDy state reader ops (docs/ready.md): read the target's committed GDN states.

`state_read(states, pendings, queries, value_map=None, flush=True) -> (reads, sqnorm)`; the
contract is in `naive.py`. Dispatch follows `specla.ops`: the fused Triton kernel
(`triton.py`) when `ops.use_triton(state)` and the states are fp32 and nothing needs
gradients, the torch reference otherwise (float64 models, CPU, training).

`committed_read` is a draft block's read (the flush and the read) as one custom op, so a
compiled block forward stays one graph around it.
"""

from __future__ import annotations

from typing import Optional

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


@torch.library.custom_op("specla::committed_read", mutates_args=("states",))
def committed_read(states: list[torch.Tensor], pending_layers: list[int], keys: list[torch.Tensor],
                   gates: list[torch.Tensor], updates: list[torch.Tensor], lengths: list[torch.Tensor],
                   queries: torch.Tensor, value_map: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`state_read(..., flush=True)` where the layers `pending_layers[j]` hold the pending update
    (keys[j], gates[j], updates[j], lengths[j]) and the others none. The caller zeroes the
    lengths after it (the read was the flush): the pending buffers of several layers are views
    of one bank, and an op writing such views gets copies of them from Inductor, made inside
    the graph (new addresses under capture).

    A custom op declaring what it writes, so that inside a compiled block forward it is one
    opaque call that Inductor runs in place on the target's states: as a graph break it split
    the block forward in two, and the unfused queries and features around it cost ~40 us a
    round on the H200 (block_round_b0eadc4.json) against ~4 us for the kernel. Every tensor is
    the caller's (no placeholder for a layer without an update), so the Triton kernel's address
    table, built in the warm-up before a CUDA graph capture, is the one the capture finds."""
    pendings = [None] * len(states)
    for j, layer in enumerate(pending_layers):
        pendings[layer] = (keys[j], gates[j], updates[j], lengths[j])
    return state_read(states, pendings, queries, value_map, flush=True)


@committed_read.register_fake
def _committed_read_shape(states, pending_layers, keys, gates, updates, lengths, queries, value_map):
    B, HV, K, V = states[0].shape
    R = V if value_map is None else value_map.shape[2]
    dt = states[0].dtype
    return (queries.new_empty(B, queries.shape[1], len(states), HV, R, dtype=dt),
            queries.new_empty(B, len(states), HV, dtype=dt))
