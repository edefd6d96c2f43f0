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
