"""Chain-decomposed hybrid verifier (SpecLA §4.3).

The topology is split into node-disjoint chains by heavy-light decomposition
(`schedule.hld_schedule`, built on the device from the parent array, no host sync). Each chain
runs on the serial verifier's inner loop with its state tile resident; chains run in parallel
as soon as their boundary state is ready.

One launch per layer, grid = (chain slots = n) × (rows × value heads × V-tiles). A program takes
a ticket from an atomic counter and works on item `ticket` in chain-major order, so the launch
order of programs does not matter. A chain that starts below the root spins on a per-(boundary
node, tile) flag that its parent chain's program raises right after storing the boundary tile;
chains are ranked topologically, so it only ever waits on a program that is already running.
The schedule is a fixed-size table padded to n chains of n nodes and the grid depends only on
n, so a verify captured in a CUDA graph replays correctly for any topology of the same size.
A chain waits for exactly its own boundary node, not for a whole "level" of chains.

`schedule="replay"` (the default) extends every chain up to the root instead: its program
loads the durable state and replays the chain's ancestors in registers (same inputs, same
arithmetic, so the same bits as the chain that owns them) without writing them, then verifies
its own nodes. No boundary tile is stored, no program waits for another and no flags are
zeroed per launch; the price is recomputing shared prefixes (`specla bench kernels` times
both schedules, Table 1 of BENCHMARKS.md). With a pending (delayed) update every chain applies it to the
tile it loaded and the last one to load writes the advanced tile back, counted on a
self-resetting per-tile counter (`_counters`); launches on one device must therefore not
overlap, as they do not on the decode loop's single stream.
"""

from __future__ import annotations

import torch
import triton

from specla.ops.gdn import serial
from specla.ops.gdn.schedule import plan_for

SCHEDULES = ("replay", "hld")
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Per-tile load counters of the replay schedule; every launch leaves them at zero."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
    return buf


def gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending=None, *,
                    block_v: int = 16, num_warps: int = 4, schedule: str = "replay"):
    """Same contract as `naive.gdn_tree_verify` (fp32 state). schedule: "replay" (heavy-light
    chains extended to the root) or "hld" (heavy-light chains handing boundary tiles over)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown hybrid schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    B, n, HV, V = v.shape
    BV = serial.block_size(V, block_v)
    n_tiles = B * HV * triton.cdiv(V, BV)
    if schedule == "replay":
        sched = plan_for(parents).replay(parents)
        return serial.launch(q, k, v, g, beta, state, parents.contiguous(), scale, pending,
                             grid=(n * n_tiles,), tree=False, replay=True,
                             hybrid=(sched.nodes, sched.length, sched.light, sched.count,
                                     _counters(state.device, n_tiles), sched.skip),
                             block_v=BV, num_warps=num_warps)
    sched = plan_for(parents).hld(parents)  # cached on the caller's tensor: once per round
    parents = parents.contiguous()
    # ticket counter (slot 0) and one ready flag per (row, node, head, V-tile), zeroed per launch
    flags = torch.zeros(1 + n * n_tiles, dtype=torch.int32, device=state.device)
    return serial.launch(q, k, v, g, beta, state, parents, scale, pending,
                         grid=(n * n_tiles,), tree=True,
                         hybrid=(sched.nodes, sched.length, sched.light, sched.count, flags, sched.light),
                         block_v=BV, num_warps=num_warps)
