"""Zeroed int32 counters for kernels whose last program to finish does one more step for all
of them (the path verifier's write-back of the root tile): a program counts itself in with an
atomic add, the one that sees every other program counted does the step and zeroes the counter
again. So one buffer per device serves every launch, in stream order, with no fill kernel per
launch (a fill in a CUDA graph is a launch of its own).

Tried for `beam_expand` too (its merge done by the last chunk program instead of a second
launch): on the H200 the one launch cost 5.7 µs a depth against 2.5 + 2.5 for the two
(tree_shapes_cae7848.json), the merge then waiting on the slowest chunk inside the kernel.
"""

from __future__ import annotations

import torch

from specla.graphs import capturing

_BUFFERS: dict = {}


def zeroed(device: torch.device, size: int) -> torch.Tensor | None:
    """At least `size` zeroed int32 counters on `device`, or None inside a CUDA-graph capture
    when there are not enough yet: they are made outside captures (a capture's warm-up makes
    them), where their zeros are really written."""
    buf = _BUFFERS.get(device)
    if buf is None or buf.numel() < size:
        if capturing():
            return None
        buf = _BUFFERS[device] = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
    return buf
