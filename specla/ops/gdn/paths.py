"""Path-parallel tree verifier: every root-to-leaf path walked by a program of its own.

The serial verifier's inner loop (`serial.tree_verify_kernel`, PATHS mode) run once per leaf:
program (tile, c) walks the c-th leaf's nodes root..leaf in order, with the state tile
resident, and computes every node exactly as an AR step or a chain verify would: the same
update (`decay_update`), the same reduction over K, the same tiling. The paths are listed once a
round for every layer (`schedule.path_tables`, one launch) and read one node ahead. A node
shared by several paths is computed by each of them, with the same bits, and written by each.
Nothing is restored or waited for. Its outputs are bitwise those of the serial pass, so bf16 trees emit
AR's tokens (H200, demo pair: 480 / 480 prompts, 81–89% on the parallel verifier, whose closed
form rounds otherwise), at the parallel verifier's cost a round (10.6 against 9.4 µs a layer;
a 9-node chain verify takes 7.3, the serial pass 11.6: docs/kernels.md).

The work is the sum of the path lengths rather than the node count, and the grid is
tiles × nodes: the dispatch (`ops.gdn_tree_verify`) sends a tree here only while that grid is
small against the GPU (`ops.PATHS_MAX_PROGRAMS`); at the paper's shape (128 tiles a row) the
parallel and serial verifiers already fill it.

The tables list the leaves first, so the walking programs lead the grid and the programs past
the leaves, which only exit, come last. The pending (delayed) update is applied by every path to
its own copy of the root tile; the durable tile is written back, after its walk, by whichever
path loaded it last (a per-tile counter, reset by that program, `ops.counters`), so no path
reads a tile another has already advanced. With programmatic dependent launch (`ops.pdl`) the
tile is loaded and advanced before the program waits for the prelude by the first EARLY table
rows' programs, walking or not (the path tables are read after the wait, since at the first
layer they come from the launch just before), as a chain verify does; the rest take it after
the wait if they walk. Until 2026-12-06 the paths launched without PDL.
"""

from __future__ import annotations

import triton

from specla.ops import counters
from specla.ops.gdn import serial
from specla.ops.gdn.schedule import plan_for

# With PDL, the table rows whose programs load and advance their tile before the wait. Every
# row used to: a 17-node tree's 272 programs each advanced a tile while 3-5 walked (the demo's
# trees: 2-9 leaves, at most 8 in 99.7% of rounds, 18 prompts on the CPU); the rows past EARLY
# wait first and take the tile only if they hold a leaf. Read at each launch.
EARLY = 8


def gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending=None, valid=None, *,
                    block_v: int = 16, num_warps: int = 4):
    """Same contract as `naive.gdn_tree_verify` (fp32 state), for valid[b] >= 1 (the root is
    always real: with no real node there is no path, and a pending update would not be
    written back)."""
    B, n, HV, V = v.shape
    BV = serial.block_size(V, block_v)
    tiles = B * HV * triton.cdiv(V, BV)
    ticket = counters.zeroed(state.device, tiles)
    if ticket is None:  # first seen inside a capture: the serial pass computes the same bits
        return serial.gdn_tree_verify(q, k, v, g, beta, state, parents, scale, pending, valid,
                                      block_v=block_v, num_warps=num_warps)
    parents = parents.contiguous()
    valid = None if valid is None else valid.contiguous()
    table, length, leaves = plan_for(parents).paths(parents, valid)  # cached on the caller's tensor: once a round
    return serial.launch(q, k, v, g, beta, state, parents, scale, pending, grid=(tiles, n), tree=True,
                         paths=(table, length, leaves, ticket), valid=valid,
                         block_v=BV, num_warps=num_warps, early=EARLY)
