"""Chain-decomposed hybrid verifier (SpecLA §4.3).

The topology is split into node-disjoint chains (`schedule.hld_schedule`, built on the device
from the parent array, no host sync): heavy-light decomposition of the inner nodes, with every
leaf verified in place by its parent's chain right after its parent (a leaf's o and u need only
the parent's tile, so the chain skips the leaf's update and keeps the parent's tile for the next
node). Each chain runs on the serial verifier's inner loop with its state tile resident; chains
run in parallel as soon as their boundary state is ready. A beam tree is mostly leaves: in
place, Table 1's (4, 4, 32) trees take 7-8 chains instead of 20 (a program and a boundary tile
load per chain and V-tile), for two more visits on the longest chain.

One launch per layer, grid = (chain slots = n) × (rows × value heads × V-tiles). A program takes
a ticket from an atomic counter and works on item `ticket` in chain-major order, so the launch
order of programs does not matter. A chain that starts below the root spins on a per-(boundary
node, tile) flag that its parent chain's program raises right after storing the boundary tile;
chains are ranked topologically, so it only ever waits on a program that is already running.
The schedule is a fixed-size table padded to n chains of n nodes and the grid depends only on
n, so a verify captured in a CUDA graph replays correctly for any topology of the same size.
A chain waits for exactly its own boundary node, not for a whole "level" of chains.

`schedule="auto"` lets a cost model (`schedule.SERIAL_COST`) replace a row's chains by one
serial pass over all its nodes when chains would not pay for their overhead (few nodes, short
chains); the choice is made on the device, so it also holds inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton

from specla.ops.gdn import serial
from specla.ops.gdn.schedule import plan_for

SCHEDULES = ("hld", "auto")


def gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending=None, *,
                    block_v: int = 16, num_warps: int = 4, schedule: str = "hld"):
    """Same contract as `naive.gdn_tree_verify` (fp32 state). schedule: "hld" (heavy-light
    chains) or "auto" (chains or one serial pass per row, by the cost model)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown hybrid schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    B, n, HV, V = v.shape
    BV = serial.block_size(V, block_v)
    n_tiles = B * HV * triton.cdiv(V, BV)
    sched = plan_for(parents).hld(parents, schedule == "auto")  # cached on the caller's tensor: once per round
    parents = parents.contiguous()
    # ticket counter (slot 0) and one ready flag per (row, node, head, V-tile), zeroed per launch
    flags = torch.zeros(1 + n * n_tiles, dtype=torch.int32, device=state.device)
    return serial.launch(q, k, v, g, beta, state, parents, scale, pending,
                         grid=(n * n_tiles,), tree=True,
                         hybrid=(sched.nodes, sched.length, sched.light, sched.count, flags),
                         block_v=BV, num_warps=num_warps)
